#!/usr/bin/env bash
# Builds llama.cpp's own server (`llama-server`) once from the llama-cpp-python source distribution, which
# carries the whole llama.cpp tree, and caches the binary; a second run only prints its path.
# Used by the server-backend tests and benchmarks (scripts/setup.sh --dev calls it). ~6 min on 2 cores.
# Prints the binary's path on stdout (progress goes to stderr).
set -euo pipefail
VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
PY=${PYTHON:-python3}
CACHE=${TEXTENV_CACHE_DIR:-$HOME/.cache/textenv-chat}
DEST="$CACHE/llama-server-$VERSION-noamx"  # (-noamx: built without AMX, below)
BIN="$DEST/llama-server"
if [ -x "$BIN" ]; then
  echo "$BIN"
  exit 0
fi
for tool in cmake ninja g++; do
  command -v "$tool" >/dev/null || { echo "error: $tool is needed to build llama-server" >&2; exit 1; }
done
WORK=$(mktemp -d "${TMPDIR:-/tmp}/llama-server-build.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
echo "building llama-server from llama-cpp-python==$VERSION (once, ~6 min on 2 cores) in $WORK" >&2
$PY -m pip download -q --no-deps --no-binary :all: -d "$WORK" "llama-cpp-python==$VERSION" >&2
tar -xzf "$WORK"/llama_cpp_python-"$VERSION".tar.gz -C "$WORK"
SRC="$WORK/llama_cpp_python-$VERSION/vendor/llama.cpp"
# No AMX: on a Xeon whose cpuinfo lists amx_tile/amx_int8 (one of this project's machine kinds), the native
# build's AMX kernels crashed llama-server at its first matmul (SIGSEGV on `ldtilecfg` in
# ggml_backend_amx_mul_mat, although the kernel granted the tile permission). GCC keeps explicit -mno-* flags
# over -march=native's, so everything else stays native (AVX-512 and VNNI there, AVX2 elsewhere).
NO_AMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
# Static libraries: the cached binary must not depend on .so files left in the deleted build folder.
cmake -S "$SRC" -B "$WORK/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
  -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_CURL=OFF \
  -DLLAMA_OPENSSL=OFF "-DCMAKE_C_FLAGS=$NO_AMX" "-DCMAKE_CXX_FLAGS=$NO_AMX" >&2
cmake --build "$WORK/build" --target llama-server -j2 >&2
mkdir -p "$DEST"
cp "$WORK/build/bin/llama-server" "$DEST/llama-server.tmp$$"
mv "$DEST/llama-server.tmp$$" "$BIN"  # atomic: a half-copied binary is never taken for a finished one
echo "$BIN"
