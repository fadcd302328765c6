#!/usr/bin/env bash
# Build llama-server from the llama.cpp sources vendored in the PyPI sdist of
# llama-cpp-python (the only route to llama.cpp's source from a registry).
# Cached and idempotent: a second run with the binary present does nothing.
# Usage: bench/build_llama_server.sh [OUT_DIR]   (default build/peers)
set -euo pipefail
VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
OUT="${1:-build/peers}"
PY="${PYTHON:-.venv/bin/python}"
JOBS="${JOBS:-2}"
BIN="$OUT/llama-server"
if [ -x "$BIN" ]; then echo "llama-server: cached at $BIN"; exit 0; fi
for tool in cmake c++ cc; do
  command -v "$tool" >/dev/null || { echo "llama-server: $tool not found" >&2; exit 1; }
done
mkdir -p "$OUT"
SDIST="$OUT/llama_cpp_python-$VERSION.tar.gz"
if [ ! -f "$SDIST" ]; then
  "$PY" -m pip download --no-binary :all: --no-deps "llama-cpp-python==$VERSION" -d "$OUT"
fi
SRC="$OUT/llama_cpp_python-$VERSION/vendor/llama.cpp"
[ -d "$SRC" ] || tar -xzf "$SDIST" -C "$OUT"
GEN=()
command -v ninja >/dev/null && GEN=(-G Ninja)
cmake -S "$SRC" -B "$OUT/llama.cpp-build" "${GEN[@]}" \
  -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON \
  -DBUILD_SHARED_LIBS=OFF -DGGML_NATIVE=ON
nice -n 19 cmake --build "$OUT/llama.cpp-build" --target llama-server -j "$JOBS"
cp "$OUT/llama.cpp-build/bin/llama-server" "$BIN"
echo "llama-server: built $BIN"
