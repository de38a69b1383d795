#!/usr/bin/env bash
# The test suite under load: a fresh clone of this checkout's HEAD, then the suite N times in a row while a CPU-bound
# background load of one busy process per core runs; a summary of every run at the end (and in summary.md).
#
#   scripts/stress_suite.sh                      # 3 runs of the whole suite, load = one process per core
#   scripts/stress_suite.sh -n 1 -- tests/component/test_tensor_parallel.py     # a selection, once
#   scripts/stress_suite.sh --venv /path/to/.venv -n 3                          # reuse a set-up environment
#
# Options: -n RUNS (3), -l LOAD_PROCESSES (one per core), -o OUT_DIR (a new temporary folder), --venv PATH (reuse a
# virtual environment set up by scripts/setup.sh instead of setting up the clone's own; the clone's code is put first
# on the path), --keep (keep the clone). Everything after `--` goes to pytest (default: the whole suite).
# Exit status 0 only if every run passed. Each run's log is OUT_DIR/run-N.log, its JUnit XML OUT_DIR/run-N.xml.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO="$PWD"

RUNS=3
LOAD="$(nproc)"
OUT=""
VENV_REUSE=""
KEEP=0
PYTEST_ARGS=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    -n) RUNS="$2"; shift 2 ;;
    -l) LOAD="$2"; shift 2 ;;
    -o) OUT="$2"; shift 2 ;;
    --venv) VENV_REUSE="$(cd "$2" && pwd)"; shift 2 ;;
    --keep) KEEP=1; shift ;;
    --) shift; PYTEST_ARGS=("$@"); break ;;
    -h|--help) sed -n '2,14p' "$0"; exit 0 ;;
    *) echo "stress_suite: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
done
[[ "$RUNS" =~ ^[1-9][0-9]*$ ]] || { echo "stress_suite: -n must be a positive integer, got $RUNS" >&2; exit 2; }
[[ "$LOAD" =~ ^[0-9]+$ ]] || { echo "stress_suite: -l must be a non-negative integer, got $LOAD" >&2; exit 2; }
OUT="${OUT:-$(mktemp -d /tmp/minedraft-stress.XXXXXX)}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
CLONE="$OUT/clone"

LOAD_PIDS=()
stop_load() {
  for pid in "${LOAD_PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
  for pid in "${LOAD_PIDS[@]}"; do wait "$pid" 2>/dev/null || true; done
  LOAD_PIDS=()
}
cleanup() {
  stop_load
  [[ "$KEEP" == 1 ]] || rm -rf "$CLONE"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

commit="$(git -C "$REPO" rev-parse HEAD)"
[[ -z "$(git -C "$REPO" status --porcelain --untracked-files=no)" ]] ||
  echo "stress_suite: note: uncommitted changes in $REPO are not in the clone (HEAD $commit is)" >&2
echo "stress_suite: cloning $REPO at ${commit:0:12} into $CLONE" >&2
git clone --quiet --no-local "$REPO" "$CLONE"
git -C "$CLONE" checkout --quiet "$commit"

if [[ -n "$VENV_REUSE" ]]; then
  ln -s "$VENV_REUSE" "$CLONE/.venv"
  # The reused environment's editable install points at another checkout: the clone's code goes first.
  export PYTHONPATH="$CLONE"
else
  echo "stress_suite: setting up the clone (scripts/setup.sh; log in $OUT/setup.log)" >&2
  (cd "$CLONE" && bash scripts/setup.sh) >"$OUT/setup.log" 2>&1 ||
    { echo "stress_suite: setup failed, see $OUT/setup.log" >&2; exit 1; }
fi

echo "stress_suite: background load: $LOAD busy process(es) on $(nproc) core(s)" >&2
for _ in $(seq 1 "$LOAD"); do
  # A plain busy loop: CPU-bound, no memory, no I/O; ended by PID when the runs are over.
  bash -c 'while :; do :; done' &
  LOAD_PIDS+=("$!")
done

summary="$OUT/summary.md"
{
  echo "# Test suite under load"
  echo
  echo "Commit ${commit:0:12}, $(nproc) cores, background load $LOAD busy process(es), $(date -u +%Y-%m-%dT%H:%MZ)."
  if [[ ${#PYTEST_ARGS[@]} -gt 0 ]]; then echo "pytest $(printf '%q ' "${PYTEST_ARGS[@]}")"; else echo "pytest (whole suite)"; fi
  echo
  echo "| run | result | passed | failed | errors | minutes | failures |"
  echo "|---|---|---|---|---|---|---|"
} >"$summary"

failed_runs=0
for run in $(seq 1 "$RUNS"); do
  log="$OUT/run-$run.log"
  echo "stress_suite: run $run/$RUNS (log $log)" >&2
  started=$(date +%s)
  set +e
  (cd "$CLONE" && .venv/bin/python -m pytest -p no:cacheprovider --junitxml="$OUT/run-$run.xml" -q \
     "${PYTEST_ARGS[@]}") >"$log" 2>&1
  rc=$?
  set -e
  minutes=$(awk -v s="$(( $(date +%s) - started ))" 'BEGIN { printf "%.1f", s / 60 }')
  read -r passed failed errors failures < <("$CLONE/.venv/bin/python" - "$OUT/run-$run.xml" <<'PY'
import sys
import xml.etree.ElementTree as ET

try:
    root = ET.parse(sys.argv[1]).getroot()
except (OSError, ET.ParseError):
    print("? ? ? (no-junit-report)")
    sys.exit()
cases = list(root.iter("testcase"))
bad = [c for c in cases if c.find("failure") is not None or c.find("error") is not None]
failed = sum(1 for c in cases if c.find("failure") is not None)
errors = sum(1 for c in cases if c.find("error") is not None)
skipped = sum(1 for c in cases if c.find("skipped") is not None)
names = ",".join(f"{c.get('classname', '')}::{c.get('name', '')}" for c in bad) or "-"
print(len(cases) - len(bad) - skipped, failed, errors, names)
PY
)
  result=$([[ $rc == 0 ]] && echo pass || echo "FAIL (rc $rc)")
  [[ $rc == 0 ]] || failed_runs=$((failed_runs + 1))
  echo "| $run | $result | $passed | $failed | $errors | $minutes | ${failures//,/, } |" >>"$summary"
  echo "stress_suite: run $run: $result, $passed passed, $failed failed, $errors errors, $minutes min" >&2
done
stop_load

cat "$summary"
echo "stress_suite: $((RUNS - failed_runs))/$RUNS runs passed; logs and summary in $OUT" >&2
[[ $failed_runs == 0 ]]
