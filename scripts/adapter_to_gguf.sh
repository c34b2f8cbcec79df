#!/usr/bin/env bash
# Converts a peft LoRA folder (default: assets/adapter, scripts/train.py's) into the GGUF adapter llama.cpp's
# server applies with `--lora` (ADAPTER_FOLDER/adapter.gguf, float16), with llama.cpp's own convert_lora_to_gguf.py
# from the same llama-cpp-python source distribution scripts/build_llama_server.sh builds the server from.
# The base model's config comes from the app's converted cache folder (the app or a test loads it once first).
set -euo pipefail
ADAPTER=$(realpath "${1:-assets/adapter}")
VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
PY=${PYTHON:-python3}
cd "$(dirname "$0")/.."
BASE=$($PY -c "from app.model.loading import BUNDLED_GGUF, bundled_model_dir, converted_dir
folder = converted_dir(str(bundled_model_dir()), BUNDLED_GGUF)
assert (folder / 'config.json').exists(), f'{folder}: no config.json; load the model once (python3 -m app)'
print(folder)")
WORK=$(mktemp -d "${TMPDIR:-/tmp}/adapter-to-gguf.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
$PY -m pip download -q --no-deps --no-binary :all: -d "$WORK" "llama-cpp-python==$VERSION" >&2
SRC="llama_cpp_python-$VERSION/vendor/llama.cpp"
tar -xzf "$WORK/llama_cpp_python-$VERSION.tar.gz" -C "$WORK" "$SRC/convert_lora_to_gguf.py" \
  "$SRC/convert_hf_to_gguf.py" "$SRC/conversion" "$SRC/gguf-py"
PYTHONPATH="$WORK/$SRC/gguf-py" $PY "$WORK/$SRC/convert_lora_to_gguf.py" "$ADAPTER" --base "$BASE" \
  --outtype f16 --outfile "$ADAPTER/adapter.gguf" >&2
echo "$ADAPTER/adapter.gguf"
