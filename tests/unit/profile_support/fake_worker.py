"""A stand-in for minedraft.profile.worker that speaks its protocol without torch: `ms` = batch.

It hangs (sleeps) in every measurement whose batch is listed in $FAKE_WORKER_HANG_BATCHES, or before `ready` if
$FAKE_WORKER_HANG_SETUP is set; it dies (exit code 9, like a worker the kernel killed) in those listed in
$FAKE_WORKER_CRASH_BATCHES; it reports an error and ends cleanly (as the real worker does on CUDA) in those listed in
$FAKE_WORKER_ERROR_BATCHES. Before sleeping it starts a grandchild that sleeps too (both pids appended to
$FAKE_WORKER_PID_FILE), so a test can check that the whole process group is killed."""

import json
import os
import subprocess
import sys
import time


def hang() -> None:
    grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
    pid_file = os.environ.get("FAKE_WORKER_PID_FILE")
    if pid_file:
        with open(pid_file, "a") as f:
            f.write(f"{os.getpid()} {grandchild.pid}\n")
    time.sleep(3600)


job = json.loads(sys.stdin.read())
hang_batches = {int(b) for b in os.environ.get("FAKE_WORKER_HANG_BATCHES", "").split(",") if b}
crash_batches = {int(b) for b in os.environ.get("FAKE_WORKER_CRASH_BATCHES", "").split(",") if b}
error_batches = {int(b) for b in os.environ.get("FAKE_WORKER_ERROR_BATCHES", "").split(",") if b}
if os.environ.get("FAKE_WORKER_HANG_SETUP"):
    hang()
print(json.dumps({"event": "ready", "device": "fake device", "torch": "none"}), flush=True)
for item in job["measurements"]:
    m = item["measurement"]
    print(json.dumps({"event": "start", "id": item["id"]}), flush=True)
    if m["batch"] in hang_batches:
        hang()
    if m["batch"] in crash_batches:
        os._exit(9)
    if m["batch"] in error_batches:
        print(json.dumps({"event": "error", "id": item["id"], "message": "OutOfMemoryError: fake"}), flush=True)
        sys.exit(0)
    fields = {"ms": float(m["batch"])}
    if m["kind"] == "concurrent":
        fields.update(target_ms=1.0, drafter_ms=1.0, target_alone_ms=1.0, drafter_alone_ms=1.0)
    print(json.dumps({"event": "result", "id": item["id"], **fields}), flush=True)
