#!/usr/bin/env bash
# Cost curves of the paper's pair on a lent GPU machine: the one script to run there.
#
#   bash scripts/gpu_profile.sh    # from the repository root; at most 8 minutes (an estimated 4-6 on an H200: not run yet)
#
# The machine has PyTorch (and Triton) but no vLLM, transformers or gRPC, and only the repository's files travel to
# it, so this runs `python -m minedraft.profile` (torch and the standard library only) rather than the `minedraft`
# CLI. It measures the Qwen3-32B target and the Qwen3-1.7B and Qwen3-0.6B drafters at the H200 file's grid (batch
# 1-128 at context 1024, batch 1, 8, 32 at 4096; k 3 and 5), bf16, CUDA graphs, plus the target and each drafter
# on two streams of the one GPU, and writes benchmarks/curves/<device>-qwen3-32b.json (e.g. nvidia-h200-...;
# the copied reference file h200-qwen3-32b.json is never overwritten). With $OUT set (the device runner's
# return folder), the file is copied there too.
#
# Time limits, all enforced from outside the measuring processes: 45 s per measurement and 150 s per worker start
# (a worker that misses one is killed with its process group and the measurement recorded under "timeouts"); the
# whole run stops starting measurements after 360 s (the rest recorded as "budget" timeouts); and `timeout` ends
# everything at 420 s (the profiler kills its worker on SIGTERM), 430 s at worst, after a device check of at most
# 40 s: 7 min 50 s in all. The file is rewritten after every worker process,
# so even the last resort leaves what was measured.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv 2>/dev/null || true
# One short interpreter: versions to stderr, the device's name (lower case, dashes) to stdout.
DEVICE=$(timeout 40 "$PY" -c 'import re, sys, torch
assert torch.cuda.is_available(), "no CUDA device"
name = torch.cuda.get_device_name(0)
print("torch", torch.__version__, "CUDA", torch.version.cuda, name, file=sys.stderr)
print(re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-"))')
OUTFILE="benchmarks/curves/${DEVICE}-qwen3-32b.json"
[ "$OUTFILE" != "benchmarks/curves/h200-qwen3-32b.json" ] || OUTFILE="benchmarks/curves/${DEVICE}-qwen3-32b-profile.json"

status=0
timeout --kill-after=10 420 "$PY" -m minedraft.profile --device cuda --dtype bfloat16 --shapes gpu \
    --target qwen3-32b --drafter qwen3-1.7b --drafter qwen3-0.6b \
    --timeout-s 45 --setup-timeout-s 150 --budget-s 360 --output "$OUTFILE" || status=$?
echo "minedraft.profile exited with $status; file: $OUTFILE" >&2
if [ -n "${OUT:-}" ] && [ -f "$OUTFILE" ]; then cp "$OUTFILE" "$OUT/"; fi
exit "$status"
