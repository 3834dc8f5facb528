#!/usr/bin/env bash
# Build llama.cpp's llama-server (real continuous batching) once, from the
# llama.cpp source vendored in the llama-cpp-python sdist, into
# ~/.cache/tierlm/llama.cpp/build/bin/llama-server. Later runs do nothing.
# TARGETS="llama-server llama-tokenize" builds llama.cpp's tokenizer too (the
# reference of scripts/tokenizer_reference.py).
set -euo pipefail
VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
CACHE=${TIERLM_BENCH_CACHE:-$HOME/.cache/tierlm}
SRC=$CACHE/llama.cpp
BIN=$SRC/build/bin/llama-server
PY=${PY:-python3}
TARGETS=${TARGETS:-llama-server}
if [ -x "$BIN" ] && [ "$TARGETS" = "llama-server" ] && [ -z "${REBUILD:-}" ]; then echo "$BIN"; exit 0; fi
mkdir -p "$CACHE/src"
if [ ! -f "$SRC/CMakeLists.txt" ]; then
  $PY -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$CACHE/src"
  tar xzf "$CACHE/src/llama_cpp_python-$VERSION.tar.gz" -C "$CACHE/src"
  rm -rf "$SRC" && mv "$CACHE/src/llama_cpp_python-$VERSION/vendor/llama.cpp" "$SRC"
fi
# GGML_NATIVE=ON died with SIGILL in our VM (its CPU reports AMX, which ggml then
# uses); so on x86 with AVX-512 name the instruction sets and leave AMX out.
if [ -z "${ARCH_FLAGS+x}" ]; then
  if grep -qw avx512f /proc/cpuinfo 2>/dev/null; then
    ARCH_FLAGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON
      -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AMX_TILE=OFF"
  else
    ARCH_FLAGS="-DGGML_NATIVE=ON"
  fi
fi
cd "$SRC"
# shellcheck disable=SC2086
cmake -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF $ARCH_FLAGS \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
# shellcheck disable=SC2086
cmake --build build --target $TARGETS -j"$(nproc)"
echo "$BIN"
