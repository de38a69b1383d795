"""The documentation stays true to the repository: links resolve, generated references are fresh, every alert has
a runbook section that its runbook_url points at, and bench_all's plan matches the canonical result files."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType
from urllib.parse import unquote

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])
RULES_FILE = ROOT / "dashboards" / "minedraft.rules.yaml"
RUNBOOK_PREFIX = "https://github.com/minedraft/minedraft/blob/main/docs/operations.md#"

# [text](target) and ![alt](target); reference-style links are not used in these files.
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_FENCE = re.compile(r"^(```|~~~)")


def _script(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(name, module)  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


def _prose(path: Path) -> str:
    """The file without fenced code blocks (a link-like string in a console example is not a link)."""
    out, fenced = [], False
    for line in path.read_text().splitlines():
        if _FENCE.match(line.strip()):
            fenced = not fenced
            continue
        if not fenced:
            out.append(line)
    return "\n".join(out)


def github_anchor(heading: str) -> str:
    """The id GitHub gives a heading: lower case, punctuation other than - and _ dropped, spaces to dashes."""
    text = re.sub(r"`", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in _prose(path).splitlines():
        match = re.match(r"^#{1,6}\s+(.*)$", line)
        if not match:
            continue
        base = github_anchor(match.group(1))
        count = seen.get(base, 0)
        seen[base] = count + 1
        out.add(base if count == 0 else f"{base}-{count}")
    return out


def test_github_anchor_rules() -> None:
    assert github_anchor("Engine (`minedraft_engine_*`)") == "engine-minedraft_engine_"
    assert github_anchor("MineDraftAcceptanceCollapse") == "minedraftacceptancecollapse"
    assert github_anchor("What a MineDraft becomes") == "what-a-minedraft-becomes"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(doc: Path) -> None:
    broken = []
    for target in _LINK.findall(_prose(doc)):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto: — not checked offline
            continue
        path_part, _, fragment = target.partition("#")
        resolved = (doc.parent / unquote(path_part)).resolve() if path_part else doc
        if not resolved.exists():
            broken.append(f"{target}: {resolved} does not exist")
        elif fragment and resolved.suffix == ".md" and fragment not in anchors(resolved):
            broken.append(f"{target}: no heading #{fragment} in {resolved.relative_to(ROOT)}")
    assert not broken, "\n".join(broken)


def test_crd_reference_is_fresh() -> None:
    gen = _script("gen_kubernetes_reference")
    current = gen.DOC.read_text()
    assert gen.generate(current) == current, "stale: run python scripts/gen_kubernetes_reference.py"


def test_crd_reference_lists_every_spec_field() -> None:
    # The generator must not silently skip a part of the schema (nested objects, array items).
    from minedraft.operator.crd import crd

    def paths(node: dict, prefix: str) -> set[str]:
        out = {prefix}
        for name, child in node.get("properties", {}).items():
            out |= paths(child, f"{prefix}.{name}")
        items = node.get("items")
        if isinstance(items, dict):
            for name, child in items.get("properties", {}).items():
                out |= paths(child, f"{prefix}[].{name}")
        return out

    schema = crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]
    text = (ROOT / "docs" / "kubernetes.md").read_text()
    for root in ("spec", "status"):
        missing = [p for p in paths(schema[root], root) - {root} if f"| `{p}` |" not in text]
        assert not missing, missing


def test_chart_values_reference_lists_every_value() -> None:
    gen = _script("gen_kubernetes_reference")
    values = yaml.safe_load(gen.VALUES.read_text())

    def leaves(node: object, prefix: str) -> set[str]:
        if isinstance(node, dict) and node:
            return set().union(*(leaves(v, f"{prefix}.{k}" if prefix else str(k)) for k, v in node.items()))
        return {prefix}

    rows = {path: default for path, default, _ in gen.values_rows(gen.VALUES.read_text())}
    for path in leaves(values, ""):
        assert path in rows, path


def test_chart_values_parser() -> None:
    gen = _script("gen_kubernetes_reference")
    text = """# File header, not a key's comment.

# The thing.
thing:
  # How many.
  # Two lines of comment.
  count: 3  # trailing remark
  name: "x"
  list: []
other: {}
"""
    assert gen.values_rows(text) == [
        ("thing", "", "The thing."),
        ("thing.count", "`3`", "How many. Two lines of comment."),
        ("thing.name", '`"x"`', ""),
        ("thing.list", "`[]`", ""),
        ("other", "`{}`", ""),
    ]


def test_crd_reference_splice_keeps_the_hand_written_text() -> None:
    gen = _script("gen_kubernetes_reference")
    doc = f"before\n{gen.BEGIN}\nold\n{gen.END}\nafter\n"
    assert gen.splice(doc, "NEW") == "before\nNEW\nafter\n"
    with pytest.raises(ValueError):
        gen.splice("no markers", "NEW")


def _alerts() -> list[dict]:
    groups = yaml.safe_load(RULES_FILE.read_text())["groups"]
    return [rule for group in groups for rule in group["rules"] if "alert" in rule]


def test_every_alert_has_a_runbook_section_its_url_points_at() -> None:
    alerts = _alerts()
    assert alerts
    sections = anchors(ROOT / "docs" / "operations.md")
    for alert in alerts:
        url = alert.get("annotations", {}).get("runbook_url", "")
        assert url.startswith(RUNBOOK_PREFIX), (alert["alert"], url)
        fragment = url[len(RUNBOOK_PREFIX):]
        assert fragment == github_anchor(alert["alert"]), (alert["alert"], url)
        assert fragment in sections, f"docs/operations.md has no section for {alert['alert']}"


def test_promtool_fixtures_expect_the_same_runbook_urls() -> None:
    # The promtool unit tests compare rendered annotations; they must expect the URLs the rules carry.
    expected = {a["alert"]: a["annotations"]["runbook_url"] for a in _alerts()}
    fixtures = (ROOT / "tests" / "unit" / "rules" / "minedraft.rules.test.yaml").read_text()
    for url in re.findall(r"runbook_url:\s*\"?([^\"\s]+)", fixtures):
        assert url in expected.values(), url


def test_readme_stays_short() -> None:
    assert len((ROOT / "README.md").read_text().splitlines()) <= 320


def test_readme_lines_are_wrapped_at_120_but_table_rows_and_recorded_output() -> None:
    # A Markdown table row cannot wrap, and a recorded terminal session (```console) is shown as it printed.
    long, fence = [], None
    for number, line in enumerate((ROOT / "README.md").read_text().splitlines(), 1):
        if line.startswith("```"):
            fence = None if fence is not None else line[3:].strip()
            continue
        if len(line) > 120 and fence != "console" and not line.startswith("|"):
            long.append(f"README.md:{number}: {len(line)} characters")
    assert long == []


def test_bench_all_runs_every_canonical_result_set() -> None:
    bench_all = _script("bench_all")
    outputs = {Path(out) for step in bench_all.STEPS for out in step.outputs}
    results = ROOT / "benchmarks" / "results"
    committed = {p.relative_to(ROOT) for p in results.glob("*.json")}
    committed |= {p.relative_to(ROOT) for p in results.glob("*/*.json")
                  if p.parent.name != "autoscale" or p.name == "summary.json"}
    assert committed <= outputs, committed - outputs
    assert outputs <= committed, outputs - committed
    for step in bench_all.STEPS:
        assert step.estimate_seconds > 0 and step.argv, step.name


def test_results_hold_one_canonical_set_per_regime_or_component() -> None:
    # At most 8 top-level entries (a set's .json/.md/.png, or a folder of one component's views).
    results = ROOT / "benchmarks" / "results"
    entries = {p.name.split(".")[0] for p in results.iterdir()}
    assert len(entries) <= 8, sorted(entries)


def test_bench_all_progress_line() -> None:
    bench_all = _script("bench_all")
    steps = bench_all.STEPS[:2]
    line = bench_all.progress_line(steps, index=1, elapsed_seconds=90.0, step_elapsed_seconds=30.0)
    assert f"[2/{len(steps)}]" in line and steps[1].name in line
    # Remaining: what is left of this step's estimate plus nothing after it (it is the last of the two).
    left = steps[1].estimate_seconds - 30.0
    assert bench_all.format_duration(left) in line


def test_bench_all_repeats_the_recorded_engine_commands() -> None:
    # An engine result set is regenerated by the command that made it (recorded in its JSON).
    import json

    bench_all = _script("bench_all")
    for step in bench_all.STEPS:
        if step.argv[1] != "bench":
            continue
        recorded = json.loads((ROOT / step.outputs[0]).read_text())["config"]["command"]
        assert " ".join(step.argv) == recorded, step.name


def test_bench_all_runs_steps_and_reports_failures(capsys: pytest.CaptureFixture[str]) -> None:
    # The runner itself, on two cheap real commands: one succeeds, one fails (an unknown subcommand, exit 2).
    bench_all = _script("bench_all")
    ok = bench_all.Step("help", "the CLI's help", ("minedraft", "--help"), (), 1.0)
    bad = bench_all.Step("bad", "an unknown subcommand", ("minedraft", "no-such-command"), (), 1.0)
    assert bench_all.run([ok], progress_seconds=0.05) == 0
    assert bench_all.run([ok, bad], progress_seconds=0.05) == 1
    err = capsys.readouterr().err
    assert "== help done" in err and "== bad FAILED (exit 2)" in err and "failed: bad" in err


def test_crd_reference_renders_every_schema_form() -> None:
    # Forms the CRD may grow: int-or-string quantities, rules without a message, rules naming a field.
    gen = _script("gen_kubernetes_reference")
    node = {"type": "object", "required": ["size"], "properties": {
        "size": {"x-kubernetes-int-or-string": True, "description": "A quantity."},
        "mode": {"type": "string", "x-kubernetes-validations": [
            {"rule": "self != 'x'"}, {"rule": "self != 'y'", "messageExpression": "'not y'", "fieldPath": ".mode"}]},
    }}
    rows = "\n".join(gen._rows(node, "spec", True))
    assert "| `spec.size` | integer or string |  | required |" in rows
    assert "rule: `self != 'x'`" in rows and "rule: 'not y' (at `.mode`)" in rows


def test_no_file_cites_the_design_document_outside_the_repository() -> None:
    # The design document the project started from is not in the repository; code and docs point at
    # docs/architecture.md instead, so a reader can follow every reference.
    needle = "design" + ".md"  # spelled apart so this file does not match itself
    suffixes = {".py", ".sh", ".md", ".yaml", ".yml", ".toml", ".tpl", ".txt", ".proto", ".cfg"}
    offenders = []
    for base in ("minedraft", "tests", "scripts", "charts", "docker", "dashboards", "docs", "examples", "proto"):
        for path in (ROOT / base).rglob("*"):
            if not path.is_file() or (path.suffix not in suffixes and "Dockerfile" not in path.name):
                continue
            if needle in path.read_text(errors="replace"):
                offenders.append(str(path.relative_to(ROOT)))
    for name in ("README.md", "Makefile", "pyproject.toml"):
        if needle in (ROOT / name).read_text():
            offenders.append(name)
    assert not offenders, offenders
