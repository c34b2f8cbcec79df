#!/usr/bin/env bash
# Build a separate virtual env holding TRL 0.20.0 (the last release with
# TextEnvironment) on transformers 4.x, for benchmarks/trl_side.py.
#
#   bash benchmarks/make_trl_venv.sh [DIR]      # default: benchmarks/.trl-venv
#
# Idempotent: when DIR already imports every package at the pinned versions it
# only prints the versions. torch comes from pip's configured find-links (the
# CPU wheel on disk); everything else from the configured package indexes.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
DIR="${1:-$HERE/.trl-venv}"
PY="${PYTHON:-python3}"

TORCH_SPEC="torch==2.13.0"
TRANSFORMERS_SPEC="transformers>=4.46,<5"
TRL_SPEC="trl==0.20.0"
# TRL 0.20 imports datasets and accelerate at import time; gguf is needed to
# load the bundled GGUF model; sentencepiece/protobuf are not needed for it.
EXTRA=(accelerate datasets gguf)

check() {
  "$DIR/bin/python" - <<'EOF'
import sys
import torch, transformers, trl, accelerate, gguf, datasets  # noqa: F401
from trl import TextEnvironment, TextHistory  # noqa: F401
ok = (torch.__version__.split("+")[0] == "2.13.0"
      and transformers.__version__.startswith("4.")
      and trl.__version__ == "0.20.0")
sys.exit(0 if ok else 1)
EOF
}

versions() {
  "$DIR/bin/python" - <<'EOF'
import sys
from importlib.metadata import version
print("python      ", sys.version.split()[0])
for name in ("torch", "transformers", "trl", "accelerate", "datasets", "gguf"):
    print(f"{name:12s}", version(name))
EOF
}

if [ -x "$DIR/bin/python" ] && check 2>/dev/null; then
  echo "TRL venv already built: $DIR"
  versions
  exit 0
fi

echo "Building TRL venv in $DIR"
"$PY" -m venv "$DIR"
"$DIR/bin/python" -m pip install --quiet --upgrade pip
# torch first, alone, so pip picks the local CPU wheel and never a CUDA build.
"$DIR/bin/python" -m pip install --quiet "$TORCH_SPEC"
"$DIR/bin/python" -m pip install --quiet "$TORCH_SPEC" "$TRANSFORMERS_SPEC" "$TRL_SPEC" "${EXTRA[@]}"

if ! check; then
  echo "TRL venv in $DIR does not import cleanly" >&2
  exit 1
fi
versions
