#!/usr/bin/env bash
# The server-backend checks of tests/test_server_backend.py (calculator and search episodes, stop reasons,
# max_new_tokens / max_length, prefix reuse and cache off, Stop mid-segment, concurrent sessions, CLI, page, API)
# against vLLM instead of llama.cpp's server. Needs a GPU machine with vLLM installed and the model on the hub;
# not part of CI. NOT RUN YET: no GPU was available when it was written, so treat its first run as the test of it.
#
#   bash scripts/check_vllm.sh                            # starts `vllm serve` on 127.0.0.1, checks, stops it
#   VLLM_URL=http://127.0.0.1:8000 bash scripts/check_vllm.sh   # a vLLM already running with the flags below
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${VLLM_MODEL:-HuggingFaceTB/SmolLM2-135M-Instruct}
PORT=${VLLM_PORT:-8000}
if [ -z "${VLLM_URL:-}" ]; then
  VLLM_URL="http://127.0.0.1:$PORT"
  LOG=$(mktemp "${TMPDIR:-/tmp}/vllm.XXXXXX.log")
  # --enable-prompt-tokens-details: without it vLLM reports no cached_tokens and the app shows "not reported"
  vllm serve "$MODEL" --host 127.0.0.1 --port "$PORT" --max-model-len 8192 --enable-prefix-caching \
    --enable-prompt-tokens-details >"$LOG" 2>&1 &
  PID=$!
  trap 'kill "$PID" 2>/dev/null || true' EXIT
  for _ in $(seq 1 300); do  # at most 10 minutes to load
    curl -fsS "$VLLM_URL/health" >/dev/null 2>&1 && break
    kill -0 "$PID" 2>/dev/null || { tail -n 50 "$LOG" >&2; exit 1; }
    sleep 2
  done
  curl -fsS "$VLLM_URL/health" >/dev/null
fi
# MODEL_ID: the app's local tokenizer must be the served model's (the backend checks this on connect).
MODEL_ID="$MODEL" MODEL_SERVER_KIND=vllm MODEL_SERVER_MODEL="$MODEL" TEXTENV_TEST_SERVER_URL="$VLLM_URL" \
  python3 -m pytest -q tests/test_server_backend.py "$@"
