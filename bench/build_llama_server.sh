#!/usr/bin/env bash
# Build llama-server, and llama-perplexity beside it (bench/perplexity.py), from the
# llama.cpp sources vendored in the PyPI sdist of llama-cpp-python (the only route to
# llama.cpp's source from a registry).
# Cached and idempotent: a second run with the binaries present does nothing.
# Usage: [LLAMA_ISA=avx2] bench/build_llama_server.sh [OUT_DIR]   (default build/peers)
set -euo pipefail
VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
OUT="${1:-build/peers}"
PY="${PYTHON:-.venv/bin/python}"
JOBS="${JOBS:-2}"
BIN="$OUT/llama-server"
PPL="$OUT/llama-perplexity"
if [ -x "$BIN" ] && [ -x "$PPL" ]; then echo "llama-server: cached at $BIN"; exit 0; fi
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
# Not -march=native: built with AMX by GCC 12 (Debian 12's), llama.cpp's AMX kernels
# die with SIGILL (`tilezero`) at the first matmul, even where Linux grants the tile
# state. GCC 12's _tile_loadconfig tells the compiler it reads 8 bytes, so the stores
# that fill the rest of llama.cpp's local tile configuration are dropped and its tiles
# stay unconfigured. Name the vector ISA the CPU reports instead, AMX left out.
# LLAMA_ISA=avx2 builds it as for a CPU with AVX2 alone (no AVX-512, no AVX-VNNI), the
# peer of Sluice's `--isa avx2` emulation (bench/emulated_isa.py).
LLAMA_ISA="${LLAMA_ISA:-native}"
case "$LLAMA_ISA" in native | avx2) ;; *) echo "llama-server: LLAMA_ISA is native or avx2" >&2; exit 1 ;; esac
flag() {
  if [ "$LLAMA_ISA" = avx2 ] && [[ "$1" == avx512* || "$1" == avx_vnni ]]; then echo OFF; return; fi
  grep -qw "$1" /proc/cpuinfo 2>/dev/null && echo ON || echo OFF
}
ISA=(-DGGML_NATIVE=OFF -DGGML_AVX="$(flag avx)" -DGGML_AVX2="$(flag avx2)"
  -DGGML_FMA="$(flag fma)" -DGGML_F16C="$(flag f16c)" -DGGML_BMI2="$(flag bmi2)"
  -DGGML_AVX_VNNI="$(flag avx_vnni)" -DGGML_AVX512="$(flag avx512f)"
  -DGGML_AVX512_VBMI="$(flag avx512vbmi)" -DGGML_AVX512_VNNI="$(flag avx512_vnni)"
  -DGGML_AVX512_BF16="$(flag avx512_bf16)" -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF
  -DGGML_AMX_BF16=OFF)
cmake -S "$SRC" -B "$OUT/llama.cpp-build" "${GEN[@]}" \
  -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON \
  -DBUILD_SHARED_LIBS=OFF "${ISA[@]}"
nice -n 19 cmake --build "$OUT/llama.cpp-build" --target llama-server llama-perplexity -j "$JOBS"
cp "$OUT/llama.cpp-build/bin/llama-server" "$BIN"
cp "$OUT/llama.cpp-build/bin/llama-perplexity" "$PPL"
echo "llama-server: built $BIN and $PPL"
