#!/usr/bin/env bash
# `make run`: an engine server and a gateway on localhost, then one completion streamed through the gateway with
# `minedraft client generate` (gRPC) and one chat completion through its OpenAI HTTP API (curl, SSE). Both servers
# are stopped (SIGTERM: graceful drain) when this script exits; MINEDRAFT_KEEP_SERVING=1 keeps them up until Ctrl-C
# (for an OpenAI SDK client against http://127.0.0.1:$GATEWAY_HTTP_PORT/v1).
# Extra arguments go to `minedraft serve` (engine flags such as --mode sd or -k 5).
set -euo pipefail
cd "$(dirname "$0")/.."

BIN="${VENV:-.venv}/bin"
export GRPC_VERBOSITY="${GRPC_VERBOSITY:-ERROR}"  # C-core info lines (GOAWAY on drain) are noise here
# vLLM 0.32's AOT compile cache never loads on CPUs (every start recompiles); its older compile cache does.
export VLLM_USE_AOT_COMPILE="${VLLM_USE_AOT_COMPILE:-0}"
ENGINE_PORT="${MINEDRAFT_ENGINE_PORT:-50061}"
GATEWAY_PORT="${MINEDRAFT_GATEWAY_PORT:-50060}"
# The OpenAI-compatible HTTP API of each (0: off).
ENGINE_HTTP_PORT="${MINEDRAFT_ENGINE_HTTP_PORT:-8061}"
GATEWAY_HTTP_PORT="${MINEDRAFT_GATEWAY_HTTP_PORT:-8060}"
PROMPT="${MINEDRAFT_PROMPT:-def parse_args(argv):
}"
MAX_TOKENS="${MINEDRAFT_MAX_TOKENS:-96}"

# Everything the servers and tools log (vLLM's start-up, torch's and pip's warnings, NUMA notices) goes to one file
# named on the terminal; the terminal keeps what the README shows.
LOG="${MINEDRAFT_RUN_LOG:-$(mktemp "${TMPDIR:-/tmp}/minedraft-run.XXXXXX.log")}"
: >"$LOG"

pids=()
cleanup() {
  for pid in "${pids[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  for pid in "${pids[@]}"; do
    # The engine drains and shuts vLLM down; give it time, then make sure.
    for _ in $(seq 1 60); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
    kill -KILL "$pid" 2>/dev/null || true
  done
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# Metrics ports off unless asked for (MINEDRAFT_ENGINE_METRICS_PORT, MINEDRAFT_GATEWAY_METRICS_PORT): a busy port
# must not stop the quick start.
# The local pair is served under a short name (clients name the model by it; its path is this machine's business),
# unless another model is asked for.
NAME_ARGS=(--served-model-name minedraft-pair)
case " $* " in *" --model"*) NAME_ARGS=() ;; esac
"$BIN/minedraft" --log-level WARNING serve --grpc-port "$ENGINE_PORT" --http-port "$ENGINE_HTTP_PORT" \
  --metrics-port "${MINEDRAFT_ENGINE_METRICS_PORT:-0}" --grace-seconds 5 "${NAME_ARGS[@]}" "$@" >>"$LOG" 2>&1 &
pids+=($!)
"$BIN/minedraft" --log-level WARNING gateway --port "$GATEWAY_PORT" --http-port "$GATEWAY_HTTP_PORT" \
  --engines "127.0.0.1:$ENGINE_PORT" --metrics-port "${MINEDRAFT_GATEWAY_METRICS_PORT:-0}" --grace-seconds 5 \
  >>"$LOG" 2>&1 &
pids+=($!)

echo "run: engine server on :$ENGINE_PORT (HTTP :$ENGINE_HTTP_PORT), gateway on :$GATEWAY_PORT" \
  "(HTTP :$GATEWAY_HTTP_PORT); logs in $LOG" >&2
failed() {
  [[ -t 2 ]] && printf '\n' >&2
  echo "run: $1; the last lines of $LOG:" >&2
  tail -n 25 "$LOG" >&2
  exit 1
}
# The gateway reports SERVING once an engine behind it is ready. Meanwhile one progress line (rewritten in place on a
# terminal; a line a minute otherwise, so CI logs stay short).
ready=
started=$SECONDS
reported=0
for _ in $(seq 1 300); do
  for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null || failed "a server exited"; done
  if "$BIN/minedraft" client health --target "127.0.0.1:$GATEWAY_PORT" --wait-seconds 2 >/dev/null 2>>"$LOG"; then
    ready=1; break
  fi
  waited=$((SECONDS - started))
  if [[ -t 2 ]]; then
    printf '\rrun: waiting for the engine to load ... %ds' "$waited" >&2
  elif (( waited - reported >= 60 )); then
    reported=$waited
    echo "run: waiting for the engine to load ... ${waited}s" >&2
  fi
done
[[ -n "$ready" ]] || failed "the engine did not become ready"
loaded="run: the engine loaded in $((SECONDS - started))s"
if [[ -t 2 ]]; then printf '\r%s%20s\n' "$loaded" "" >&2; else echo "$loaded" >&2; fi
echo "run: streaming through the gateway:" >&2
printf '%s' "$PROMPT"
"$BIN/minedraft" client generate --target "127.0.0.1:$GATEWAY_PORT" --prompt "$PROMPT" --max-tokens "$MAX_TOKENS"

if [[ "$GATEWAY_HTTP_PORT" != 0 ]]; then
  MODEL=$(curl -sf "http://127.0.0.1:$GATEWAY_HTTP_PORT/v1/models" | "$BIN/python" -c \
    'import json, sys; print(json.load(sys.stdin)["data"][0]["id"])')
  BODY=$("$BIN/python" -c 'import json, sys; print(json.dumps({"model": sys.argv[1], "stream": True,
    "messages": [{"role": "user", "content": sys.argv[2]}], "max_tokens": 16}))' "$MODEL" "$PROMPT")
  echo >&2
  echo "run: a chat completion through the gateway's OpenAI API (SSE as it arrives):" >&2
  curl -sN "http://127.0.0.1:$GATEWAY_HTTP_PORT/v1/chat/completions" -H 'Content-Type: application/json' -d "$BODY"
fi
if [[ -n "${MINEDRAFT_KEEP_SERVING:-}" ]]; then
  echo "run: serving until Ctrl-C (OpenAI API: http://127.0.0.1:$GATEWAY_HTTP_PORT/v1)" >&2
  wait
fi
