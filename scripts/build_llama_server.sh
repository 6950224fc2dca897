#!/usr/bin/env bash
# Builds llama.cpp's C++ `llama-server` (the serving peer in BENCHMARKS.md) from the llama.cpp sources that the
# llama-cpp-python sdist vendors, so the peer is the same llama.cpp version as the offline one. ~15 min on 2 cores.
#   bash scripts/build_llama_server.sh [DIR]     -> DIR/build/bin/llama-server (DIR defaults to /tmp/llama-server)
set -euo pipefail
DIR=${1:-/tmp/llama-server}
VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
mkdir -p "$DIR"
cd "$DIR"
if [ ! -d src ]; then
  pip download --quiet --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d sdist
  mkdir src && tar -xzf sdist/llama_cpp_python-*.tar.gz -C src --strip-components=1
fi
# Not GGML_NATIVE (its default): on some Xeon VMs it enables AMX and dies with "Illegal instruction".
flags=(-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON)
if grep -q avx512f /proc/cpuinfo; then flags+=(-DGGML_AVX512=ON); fi
if grep -q avx512_vnni /proc/cpuinfo; then flags+=(-DGGML_AVX512_VNNI=ON); fi
cmake -S src/vendor/llama.cpp -B build -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF "${flags[@]}" > /dev/null
cmake --build build --target llama-server -j "$(nproc)" > build.log
echo "$DIR/build/bin/llama-server"
