#!/usr/bin/env bash
# Each component in an environment of its own: `pip install .[gateway]` and `pip install .[operator]` into fresh
# virtual environments (no system site-packages), their commands started there, what must not come along checked,
# and each environment's size printed. The real-install counterpart of tests/unit/test_extras.py (which resolves the
# same extras against this environment's metadata without installing); reaches the package index, so not in the suite.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON="${PYTHON:-python3.11}"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/minedraft-slim.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT
declare -A COMMANDS=([gateway]="gateway --help" [operator]="operator --help")
declare -A ABSENT=([gateway]="torch vllm kopf kubernetes matplotlib scipy grpc_tools"
                   [operator]="torch vllm matplotlib scipy grpc_tools")
for extra in gateway operator; do
  env="$WORK/$extra"
  "$PYTHON" -m venv "$env"
  start=$SECONDS
  "$env/bin/python" -m pip install --quiet --disable-pip-version-check ".[$extra]" >"$WORK/$extra.log" 2>&1 \
    || { tail -20 "$WORK/$extra.log" >&2; exit 1; }
  # shellcheck disable=SC2086  # the command's words
  "$env/bin/minedraft" ${COMMANDS[$extra]} >/dev/null
  "$env/bin/python" - ${ABSENT[$extra]} <<'PY'
import importlib.util, sys
present = [m for m in sys.argv[1:] if importlib.util.find_spec(m)]
assert not present, f"installed though the extra does not need them: {present}"
PY
  echo "$extra: pip install .[$extra] in $((SECONDS - start)) s; \`minedraft ${COMMANDS[$extra]}\` starts;" \
    "no ${ABSENT[$extra]// /, }; $("$env/bin/python" -m pip list --disable-pip-version-check 2>/dev/null \
    | tail -n +3 | wc -l) distributions, $(du -sm "$env" | cut -f1) MiB"
done
