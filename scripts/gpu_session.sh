#!/usr/bin/env bash
# The prepared GPU run: one script, at most 9 minutes, torch only (a lent machine has PyTorch and Triton but no vLLM,
# no transformers and no network: every model has random weights).
#
#   bash scripts/gpu_session.sh [--out DIR]     # on the GPU machine, from the repository root
#   bash scripts/gpu_session.sh --dry-run       # every stage on the CPU at tiny shapes (CI; well under a minute)
#
# Stages, in order, each one process bounded from outside by `timeout` (SIGTERM, then SIGKILL 5 s later), each
# writing DIR/STAGE.json as it goes (python -m minedraft.profile.session; docs/gpu.md, "A prepared GPU run"):
#   check 30 s, curves 200 s, async-step 60 s, drafter-job 50 s, keyed 40 s, window 50 s, summary 15 s
# = 445 s, 480 s with every kill grace: 8 minutes at worst. A stage that fails or is killed is recorded and the
# next one runs. Results: DIR/*.json, DIR/summary.json, DIR/summary.md; with $OUT set (the device runner's return
# folder) DIR is copied there. The default DIR is benchmarks/results/gpu-session/<device> (dry-run: a temporary one).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

DRY=()
DIR=""
while [ $# -gt 0 ]; do
    case "$1" in
        --dry-run) DRY=(--dry-run) ;;
        --out) DIR="$2"; shift ;;
        *) echo "usage: $0 [--dry-run] [--out DIR]" >&2; exit 2 ;;
    esac
    shift
done
if [ -z "$DIR" ]; then
    if [ ${#DRY[@]} -gt 0 ]; then
        DIR=$(mktemp -d)
    else
        DEVICE=$(timeout 30 "$PY" -c 'import re, torch; print(re.sub(r"[^a-z0-9]+", "-", torch.cuda.get_device_name(0).lower()).strip("-"))') || DEVICE=unknown
        DIR="benchmarks/results/gpu-session/$DEVICE"
    fi
fi
mkdir -p "$DIR"
[ ${#DRY[@]} -gt 0 ] || nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv 2>/dev/null || true

# The limits live in the Python module (one place); read them without importing torch.
declare -A LIMIT
for pair in $("$PY" -m minedraft.profile.session limits --out "$DIR"); do LIMIT[${pair%%=*}]=${pair#*=}; done

failed=0
for stage in check curves async-step drafter-job keyed window; do
    started=$SECONDS
    timeout --kill-after=5 "${LIMIT[$stage]}" "$PY" -m minedraft.profile.session "$stage" --out "$DIR" "${DRY[@]}"
    status=$?
    echo "stage $stage: exit $status after $((SECONDS - started)) s (limit ${LIMIT[$stage]} s)" >&2
    [ $status -eq 0 ] || failed=1
done
timeout --kill-after=5 "${LIMIT[summary]}" "$PY" -m minedraft.profile.session summary --out "$DIR" || failed=1
echo "results in $DIR" >&2
if [ -n "${OUT:-}" ] && [ -d "${OUT:-}" ]; then cp -r "$DIR" "$OUT/"; fi
exit $failed
