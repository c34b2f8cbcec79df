#!/usr/bin/env bash
# The server-backend checks of tests/test_server_backend.py (calculator and search episodes, stop reasons,
# max_new_tokens / max_length, prefix reuse and cache off, Stop mid-segment, concurrent sessions, CLI, page, API)
# against vLLM instead of llama.cpp's server, then what a user sees (`python -m app ask --json`) and the
# server benchmark's figures. Needs a GPU machine with vLLM; not part of CI.
#
#   bash scripts/check_vllm.sh                            # starts `vllm serve` on 127.0.0.1, checks, stops it
#   VLLM_URL=http://127.0.0.1:8000 bash scripts/check_vllm.sh   # a vLLM already running with the flags below
#
# VLLM_MODEL: a hub id or a local folder (e.g. the app's converted cache folder of the bundled GGUF: the same
# weights as in process, dequantized); VLLM: the command that runs vLLM's CLI (default `vllm`); VLLM_ARGS: more
# `vllm serve` flags (e.g. --enforce-eager); VLLM_LOG: the server's log file. Where FlashInfer is not installed,
# set VLLM_USE_FLASHINFER_SAMPLER=0 (vLLM 0.25.1 imports it for its sampler otherwise). Passed on an H200
# (vLLM 0.25.1, 2026-12-04): see docs/model-server.md.
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${VLLM_MODEL:-HuggingFaceTB/SmolLM2-135M-Instruct}
PORT=${VLLM_PORT:-8000}
healthy() { python3 -c "import sys, urllib.request; urllib.request.urlopen(sys.argv[1] + '/health', timeout=5)" \
  "$1" >/dev/null 2>&1; }
if [ -z "${VLLM_URL:-}" ]; then
  VLLM_URL="http://127.0.0.1:$PORT"
  LOG=${VLLM_LOG:-$(mktemp "${TMPDIR:-/tmp}/vllm.XXXXXX.log")}
  # --enable-prompt-tokens-details: without it vLLM reports no cached_tokens and the app shows "not reported"
  # shellcheck disable=SC2086  # VLLM and VLLM_ARGS are word lists
  ${VLLM:-vllm} serve "$MODEL" --host 127.0.0.1 --port "$PORT" --max-model-len 8192 --enable-prefix-caching \
    --enable-prompt-tokens-details ${VLLM_ARGS:-} >"$LOG" 2>&1 &
  PID=$!
  trap 'kill "$PID" 2>/dev/null || true' EXIT
  began=$SECONDS
  until healthy "$VLLM_URL"; do  # at most 10 minutes to load
    kill -0 "$PID" 2>/dev/null && [ $((SECONDS - began)) -lt 600 ] || { tail -n 50 "$LOG" >&2; exit 1; }
    sleep 2
  done
  echo "vLLM answered /health after $((SECONDS - began)) s (log: $LOG)"
fi
# MODEL_ID: the app's local tokenizer must be the served model's (the backend checks this on connect).
export MODEL_ID="$MODEL" MODEL_SERVER_KIND=vllm MODEL_SERVER_MODEL="$MODEL"
status=0
TEXTENV_TEST_SERVER_URL="$VLLM_URL" python3 -m pytest -q -p no:cacheprovider tests/test_server_backend.py "$@" \
  || status=$?
echo "--- python -m app ask --json (what a user of the CLI sees)"
MODEL_SERVER_URL="$VLLM_URL" python3 -m app ask "What is 41 * 23?" "What does kludge mean?" --json || status=$?
echo "--- benchmarks/server_bench.py --url (decode speed, concurrent chats)"
python3 benchmarks/server_bench.py --url "$VLLM_URL" --chats 8 || status=$?
exit "$status"
