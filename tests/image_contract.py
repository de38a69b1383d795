"""What an image promises and what a pod asks of it, compared without a Docker engine.

`read_image(path)` parses a Dockerfile (dockerfile-parse, the final stage) into what a container started from it
gets: ENTRYPOINT, CMD, ENV, USER, EXPOSE, and the RUN/COPY steps. `container_problems(container, pod_spec, image)`
returns one message per disagreement between a rendered container and that image (empty: they agree):

- the command line, as the kubelet builds it (command replaces ENTRYPOINT, args replace CMD, CMD is dropped when
  only command is given), starts with the `minedraft` console script the image installs, and the real `minedraft`
  argument parser accepts the rest (plus the subcommand's own settings validation, where it has one);
- every containerPort is a port that command line binds, on all interfaces, every port it binds is declared, and
  every probe targets a bound port;
- any UID on a read-only root filesystem: the image's USER is numeric and non-root (the kubelet checks runAsNonRoot
  against it when the pod fixes no UID), the Dockerfile creates no user and changes no ownership, HOME is set, and
  every variable naming a place to write (HOME, TMPDIR, the XDG and cache directories), from the image or the pod,
  points into a writable volume the pod mounts (TMPDIR unset: /tmp must be one).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import io
import json
import re
import shlex
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dockerfile_parse import DockerfileParser

# The console script pyproject.toml's [project.scripts] installs (a test checks it is still there).
CONSOLE_SCRIPT = "minedraft"
# Variables naming a place a process writes: each must point into a writable volume.
WRITABLE_VARS = re.compile(r"^(HOME|TMPDIR|TMP|TEMP|XDG_(CACHE|CONFIG|DATA|STATE)_HOME|XDG_RUNTIME_DIR|HF_HOME|"
                           r"TORCH_HOME|TRITON_HOME|[A-Z0-9_]+_CACHE(_DIR|_ROOT|_PATH|_HOME)?|[A-Z0-9_]+_CONFIG_ROOT)$")
NUMERIC_NON_ROOT_USER = re.compile(r"^[1-9][0-9]*(:[0-9]+)?$")
OWNERSHIP_COMMANDS = re.compile(r"\b(useradd|adduser|groupadd|addgroup|usermod|chown|chmod|chgrp)\b")
ALL_INTERFACES = {"0.0.0.0", "::", ""}
# Volumes a container can never write, whatever its mount says.
READ_ONLY_SOURCES = {"secret", "configMap", "projected", "downwardAPI"}


@dataclass(frozen=True)
class Image:
    """The final stage of a Dockerfile, as a container started from it sees it."""

    path: Path
    base: str
    entrypoint: list[str] | None
    cmd: list[str] | None
    env: dict[str, str]
    user: str | None
    exposed: frozenset[int]
    runs: list[str] = field(default_factory=list)
    copies: list[str] = field(default_factory=list)

    def installs_package(self) -> bool:
        """A RUN pip-installs the repository's own package (`.` or `.[extra]`), which brings the console script."""
        return any(pip_installs(run) & {".", *(f".[{e}]" for e in _extras(run))} for run in self.runs)


def pip_installs(run: str) -> set[str]:
    """What a RUN's `pip install` (or `python -m pip install`) commands install, options left out."""
    words = shlex.split(run.replace("\\\n", " "))
    out: set[str] = set()
    for i, word in enumerate(words[:-1]):
        if (word == "pip" and words[i + 1] == "install") or (word == "-m" and words[i + 1] == "pip"):
            j = i + 2 if word == "pip" else i + 3
            while j < len(words) and words[j] not in ("&&", ";", "||"):
                if not words[j].startswith("-"):
                    out.add(words[j])
                j += 1
    return out


def _extras(run: str) -> list[str]:
    return re.findall(r"\.\[([\w,-]+)\]", run)


def _exec_form(value: str, instruction: str, path: Path) -> list[str]:
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError:
        raise AssertionError(f"{path.name}: {instruction} must use the exec (JSON) form, got {value!r}") from None
    assert isinstance(parsed, list) and all(isinstance(w, str) for w in parsed), (path.name, instruction, value)
    return parsed


def read_image(path: Path) -> Image:
    parser = DockerfileParser(path=str(path), env_replace=True)
    steps = parser.structure
    last_from = max(i for i, s in enumerate(steps) if s["instruction"] == "FROM")
    final = steps[last_from:]
    entrypoint = cmd = None
    user = None
    exposed: set[int] = set()
    runs: list[str] = []
    copies: list[str] = []
    for step in final:
        instruction, value = step["instruction"], step["value"]
        if instruction == "ENTRYPOINT":
            entrypoint = _exec_form(value, instruction, path)
        elif instruction == "CMD":
            cmd = _exec_form(value, instruction, path)
        elif instruction == "USER":
            user = value.strip()
        elif instruction == "EXPOSE":
            exposed |= {int(p.split("/")[0]) for p in value.split()}
        elif instruction == "RUN":
            runs.append(value)
        elif instruction in ("COPY", "ADD"):
            copies.append(value)
    return Image(path=path, base=parser.baseimage, entrypoint=entrypoint, cmd=cmd, env=dict(parser.envs),
                 user=user, exposed=frozenset(exposed), runs=runs, copies=copies)


def argv(container: Mapping[str, Any], image: Image) -> list[str]:
    """The process's command line, as the kubelet builds it from the container and the image."""
    command, args = container.get("command"), container.get("args")
    if command is None:
        return [*(image.entrypoint or []), *(args if args is not None else image.cmd or [])]
    return [*command, *(args or [])]


@dataclass(frozen=True)
class Parsed:
    """A `minedraft` command line as its own parser reads it: the subcommand and what it binds."""

    subcommand: str
    args: argparse.Namespace | None  # None: --help (prints and exits; binds nothing)
    host: str = ""
    ports: frozenset[int] = frozenset()


def _subcommand_path(args: argparse.Namespace) -> str:
    names = [str(getattr(args, d)) for d in ("command", "operator_command", "models_command", "bench_command")
             if getattr(args, d, None)]
    return " ".join(names)


def bound(args: argparse.Namespace) -> tuple[str, frozenset[int]]:
    """The host and ports a parsed command binds: every `--port`/`--*-port` option set to a port (0: not served).
    Subcommands without --host bind all interfaces (the operator: kopf's health endpoint and prometheus_client)."""
    ports = frozenset(int(v) for k, v in vars(args).items()
                      if (k == "port" or k.endswith("_port")) and isinstance(v, int) and not isinstance(v, bool)
                      and v > 0)
    return str(getattr(args, "host", "0.0.0.0")), ports


def _validators() -> dict[str, Callable[[argparse.Namespace], Any]]:
    """Each subcommand's own settings validation after argparse (what its command function runs first)."""
    from minedraft.engine_options import settings_from_args as engine_settings
    from minedraft.gateway.cli import config_from_args
    from minedraft.operator.cli import settings_from_args as operator_settings

    def gateway(args: argparse.Namespace) -> Any:
        # Token and TLS files are the pod's mounted Secrets, not here: their paths are checked against the mounts
        # instead (file_args_outside_mounts); everything else goes through the gateway's own validation.
        return config_from_args(argparse.Namespace(**{**vars(args), "token_file": None, "tls_cert": None,
                                                      "tls_key": None, "engine_token_file": None}))

    return {"serve": engine_settings, "gateway": gateway, "operator": operator_settings,
            "operator run": operator_settings}


@functools.cache
def _parser() -> argparse.ArgumentParser:
    """The real `minedraft` parser, built once: parsing leaves it as it was, and building it (every subcommand's
    arguments) took 60 ms a pod, most of a fuzzed MineDraft's check."""
    from minedraft.cli import build_parser

    return build_parser()


def parse(words: list[str]) -> Parsed | str:
    """`minedraft WORDS...` through the real parser and validation: what it binds, or why it is refused."""
    parser = _parser()
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            args = parser.parse_args(words)
    except SystemExit as exc:
        if exc.code == 0 and ("--help" in words or "-h" in words):
            return Parsed(subcommand=" ".join(w for w in words if not w.startswith("-")), args=None)
        return f"`minedraft {shlex.join(words)}` is refused by its parser: {err.getvalue().strip()}"
    subcommand = _subcommand_path(args)
    validate = _validators().get(subcommand)
    if validate is not None:
        try:
            validate(args)
        except Exception as exc:  # each validator raises its own error type, all naming the field
            return f"`minedraft {shlex.join(words)}` is refused by its settings: {exc}"
    host, ports = bound(args)
    return Parsed(subcommand=subcommand, args=args, host=host, ports=ports)


def _writable_mounts(container: Mapping[str, Any], pod_spec: Mapping[str, Any]) -> list[str]:
    volumes = {v["name"]: v for v in pod_spec.get("volumes") or []}
    out = []
    for mount in container.get("volumeMounts") or []:
        volume = volumes.get(mount["name"], {})
        if mount.get("readOnly") or READ_ONLY_SOURCES & set(volume):
            continue
        if (volume.get("persistentVolumeClaim") or {}).get("readOnly"):
            continue
        out.append(mount["mountPath"].rstrip("/") or "/")
    return out


def _under(path: str, mounts: list[str]) -> bool:
    return any(path == m or path.startswith(m + "/") or m == "/" for m in mounts)


def effective_env(container: Mapping[str, Any], image: Image) -> dict[str, str | None]:
    """The image's ENV overridden by the container's env (None: from valueFrom, unknown here)."""
    env: dict[str, str | None] = dict(image.env)
    for var in container.get("env") or []:
        env[var["name"]] = var.get("value")
    return env


def file_args_outside_mounts(parsed: Parsed, container: Mapping[str, Any]) -> list[str]:
    """Files the command reads from mounted Secrets (--token-file, --engine-token-file, --tls-cert, --tls-key) must be
    under a mount."""
    if parsed.args is None:
        return []
    mounts = [m["mountPath"].rstrip("/") for m in container.get("volumeMounts") or []]
    # A repeatable flag (serve's --token-file, the gateway's --engine-token-file) binds a list.
    return [f"--{k.replace('_', '-')} {path} is not under any volume the pod mounts"
            for k, v in vars(parsed.args).items()
            if k in ("token_file", "engine_token_file", "tls_cert", "tls_key")
            for path in ([v] if isinstance(v, str) else v if isinstance(v, list) else [])
            if not _under(path, mounts)]


def container_problems(container: Mapping[str, Any], pod_spec: Mapping[str, Any], image: Image) -> list[str]:
    name = f"{container['name']} ({image.path.name})"
    problems: list[str] = []
    words = argv(container, image)
    if not words or words[0] != CONSOLE_SCRIPT or not image.installs_package():
        problems.append(f"{name}: runs {words[:1]}, which the image does not install (its RUN pip-installs the "
                        f"package, whose console script is {CONSOLE_SCRIPT})")
        return problems
    parsed = parse(words[1:])
    if isinstance(parsed, str):
        return [f"{name}: {parsed}"]
    problems += [f"{name}: {p}" for p in file_args_outside_mounts(parsed, container)]

    # Ports.
    declared = {p["containerPort"] for p in container.get("ports") or []}
    named = {p["name"]: p["containerPort"] for p in container.get("ports") or [] if "name" in p}
    if parsed.ports and parsed.host not in ALL_INTERFACES:
        problems.append(f"{name}: binds {parsed.host}, which the kubelet's probes and Services cannot reach")
    for port in sorted(declared - parsed.ports):
        problems.append(f"{name}: containerPort {port} is not bound by `minedraft {parsed.subcommand}` "
                        f"(it binds {sorted(parsed.ports)})")
    for port in sorted(parsed.ports - declared):
        problems.append(f"{name}: binds port {port}, which the pod does not declare")
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        probe = container.get(kind) or {}
        for handler in ("grpc", "httpGet", "tcpSocket"):
            if handler in probe:
                port = probe[handler]["port"]
                port = named.get(port, port) if isinstance(port, str) else port
                if port not in parsed.ports:
                    problems.append(f"{name}: {kind} targets port {port}, which nothing binds")

    # Any UID: a numeric non-root USER unless the pod fixes one; no users or ownership made at build time.
    security = {**(pod_spec.get("securityContext") or {}), **(container.get("securityContext") or {})}
    if "runAsUser" not in security and not NUMERIC_NON_ROOT_USER.match(image.user or ""):
        problems.append(f"{name}: the image's USER {image.user!r} is not a numeric non-root UID: with runAsNonRoot "
                        "and no runAsUser the kubelet refuses to start it")
    for run in image.runs:
        if OWNERSHIP_COMMANDS.search(run):
            problems.append(f"{name}: the Dockerfile assumes a user (`{run.strip()[:80]}`): under an arbitrary UID "
                            "nothing owns what it made")
    problems += [f"{name}: the Dockerfile copies with fixed ownership (`{c}`)" for c in image.copies
                 if "--chown" in c or "--chmod" in c]

    # Read-only root: every place to write is on a writable volume.
    mounts = _writable_mounts(container, pod_spec)
    env = effective_env(container, image)
    if not env.get("HOME"):
        problems.append(f"{name}: HOME is not set (an arbitrary UID has no passwd entry, hence no home directory)")
    if "TMPDIR" not in env and not _under("/tmp", mounts):
        problems.append(f"{name}: TMPDIR is unset and /tmp is not a writable volume")
    for var, value in sorted(env.items()):
        if WRITABLE_VARS.match(var) and value is not None and not _under(value, mounts):
            problems.append(f"{name}: {var}={value} is not on a writable volume (mounted: {sorted(mounts)})")
    return problems


def image_of(reference: str, images: Mapping[str, Image], registry: str) -> Image | None:
    """The Dockerfile an image reference was built from: REGISTRY/NAME:TAG <- docker/NAME.Dockerfile."""
    repository = reference.rsplit(":", 1)[0]
    prefix = registry.rstrip("/") + "/"
    if not repository.startswith(prefix):
        return None
    return images.get(repository[len(prefix):])


def pod_problems(pod_spec: Mapping[str, Any], images: Mapping[str, Image], registry: str) -> list[str]:
    """Every container (and init container) of a pod against the image it names."""
    problems = []
    for container in [*(pod_spec.get("initContainers") or []), *pod_spec["containers"]]:
        image = image_of(container["image"], images, registry)
        if image is None:
            problems.append(f"{container['name']}: image {container['image']} is none of the images `make images` "
                            f"builds in {registry} ({', '.join(sorted(images))})")
            continue
        problems += container_problems(container, pod_spec, image)
    return problems
