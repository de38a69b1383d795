"""Write the generated references in docs/kubernetes.md: the MineDraft fields and the chart's values.

The MineDraft field reference comes from the CRD schema (minedraft.operator.crd), the chart values table from
charts/minedraft/values.yaml and the comment above each key. Each sits between two marker comments in
docs/kubernetes.md; everything outside them is hand-written. `python scripts/gen_kubernetes_reference.py` rewrites
them; `--check` exits 1 when the committed text is stale (tests/unit/test_docs.py runs the same comparison), so a
schema or values change cannot leave the docs behind.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "kubernetes.md"
VALUES = ROOT / "charts" / "minedraft" / "values.yaml"
BEGIN = "<!-- BEGIN GENERATED: crd-reference (scripts/gen_kubernetes_reference.py; do not edit by hand) -->"
END = "<!-- END GENERATED: crd-reference -->"
VALUES_BEGIN = "<!-- BEGIN GENERATED: chart-values (scripts/gen_kubernetes_reference.py; do not edit by hand) -->"
VALUES_END = "<!-- END GENERATED: chart-values -->"

# Validation keywords shown in the "validation" column, in this order, with how to print them.
_BOUNDS = (("minimum", ">= {}"), ("maximum", "<= {}"), ("minLength", "length >= {}"), ("maxLength", "length <= {}"),
           ("minItems", "items >= {}"), ("maxItems", "items <= {}"), ("pattern", "matches `{}`"))


def _cell(text: str) -> str:
    # A Markdown table cell: no raw pipes or newlines.
    return text.replace("|", "\\|").replace("\n", " ")


def _type(node: dict[str, Any]) -> str:
    if node.get("x-kubernetes-int-or-string"):
        return "integer or string"
    if "type" not in node and "anyOf" in node:
        return " or ".join(sorted({_type(option) for option in node["anyOf"]}))
    kind = str(node.get("type", "object"))
    if kind == "array":
        return f"[]{_type(node.get('items', {}))}"
    if kind == "object" and "additionalProperties" in node:
        return f"map[string]{_type(node['additionalProperties'])}"
    if node.get("format") in ("int32", "int64"):
        return f"{kind} ({node['format']})"
    return kind


def _default(node: dict[str, Any]) -> str:
    if "default" not in node:
        return ""
    value = node["default"]
    if value == {} and node.get("type") == "object":
        return "`{}` (filled)"
    return f"`{json.dumps(value)}`"


def _validation(node: dict[str, Any], required: bool) -> str:
    parts = ["required"] if required else []
    if "enum" in node:
        parts.append("one of " + ", ".join(f"`{v}`" for v in node["enum"]))
    for key, fmt in _BOUNDS:
        if key in node:
            bound = node[key]
            if key == "minimum" and node.get("exclusiveMinimum"):
                fmt = "> {}"
            parts.append(fmt.format(bound))
    if node.get("x-kubernetes-list-type") == "set":
        parts.append("no duplicates")
    if node.get("x-kubernetes-preserve-unknown-fields"):
        parts.append("passed through as given")
    for rule in node.get("x-kubernetes-validations", []):
        parts.append(f"rule: {_rule_text(rule)}")
    items = node.get("items", {})
    if isinstance(items, dict) and "enum" in items:
        parts.append("each one of " + ", ".join(f"`{v}`" for v in items["enum"]))
    return "; ".join(parts)


def _rule_text(rule: dict[str, Any]) -> str:
    # What the API server answers when the rule fails; the CEL expression itself when it has no message.
    text = str(rule.get("message") or rule.get("messageExpression") or f"`{rule['rule']}`")
    if rule.get("fieldPath"):
        text += f" (at `{rule['fieldPath']}`)"
    return text


def _rows(node: dict[str, Any], path: str, required: bool) -> list[str]:
    rows = [f"| `{path}` | {_type(node)} | {_cell(_default(node))} | {_cell(_validation(node, required))} "
            f"| {_cell(str(node.get('description', '')))} |"]
    props: dict[str, Any] = node.get("properties", {})
    must = set(node.get("required", []))
    for name, child in props.items():
        rows.extend(_rows(child, f"{path}.{name}", name in must))
    items = node.get("items")
    if isinstance(items, dict) and "properties" in items:
        item_must = set(items.get("required", []))
        for name, child in items["properties"].items():
            rows.extend(_rows(child, f"{path}[].{name}", name in item_must))
    return rows


def render() -> str:
    """The generated block, markers included."""
    from minedraft.operator.crd import crd

    obj = crd()
    spec = obj["spec"]
    version = spec["versions"][0]
    schema = version["schema"]["openAPIV3Schema"]["properties"]
    header = "| field | type | default | validation | meaning |\n|---|---|---|---|---|"
    out = [BEGIN, "",
           f"`{spec['group']}/{version['name']}`, kind `{spec['names']['kind']}`, plural `{spec['names']['plural']}`, "
           f"short name{'s' if len(spec['names'].get('shortNames', [])) > 1 else ''} "
           + ", ".join(f"`{n}`" for n in spec["names"].get("shortNames", []))
           + f", scope {spec['scope']}. Subresources: "
           + ", ".join(f"`/{n}`" for n in version.get("subresources", {})) + ".",
           "",
           "### spec", "", header]
    out.extend(_rows(schema["spec"], "spec", True)[1:])
    whole = schema["spec"].get("x-kubernetes-validations", [])
    if whole:
        out.extend(["", "Rules across fields (CEL, checked by the API server):", ""])
        out.extend(f"- {_rule_text(rule)}" + (" (on create only)" if rule.get("optionalOldSelf") else "")
                   for rule in whole)
    out.extend(["", "### status (written by the operator)", "", header])
    out.extend(_rows(schema["status"], "status", False)[1:])
    out.extend(["", "### Printer columns (`kubectl get md`)", "", "| column | from | shown |", "|---|---|---|"])
    for col in version.get("additionalPrinterColumns", []):
        shown = "with `-o wide`" if col.get("priority", 0) else "always"
        out.append(f"| {col['name']} | `{col['jsonPath']}` | {shown} |")
    if "scale" in version.get("subresources", {}):
        scale = version["subresources"]["scale"]
        out.extend(["", f"`/scale`: replicas at `{scale['specReplicasPath']}`, status at "
                        f"`{scale['statusReplicasPath']}`, selector at `{scale['labelSelectorPath']}`."])
    out.extend(["", END])
    return "\n".join(out)


def values_rows(text: str) -> list[tuple[str, str, str]]:
    """(dotted key, default, description) for every key of a values.yaml, the description from the comment lines
    right above the key. Parsed line by line: PyYAML drops comments, and the chart keeps one key per line."""
    import yaml

    rows: list[tuple[str, str, str]] = []
    stack: list[tuple[int, str]] = []  # (indent, key) of the enclosing mappings
    comment: list[str] = []
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("#"):
            comment.append(stripped.lstrip("#").strip())
            continue
        if not stripped or ":" not in stripped or stripped.startswith("-"):
            comment = []
            continue
        indent = len(line) - len(line.lstrip(" "))
        key, _, rest = stripped.partition(":")
        while stack and stack[-1][0] >= indent:
            stack.pop()
        path = ".".join([k for _, k in stack] + [key.strip().strip('"')])
        rest = rest.split(" #")[0].strip()
        if rest:
            value = yaml.safe_load(rest)
            default = f"`{json.dumps(value)}`"
        else:
            stack.append((indent, key.strip().strip('"')))
            default = ""
        rows.append((path, default, " ".join(comment)))
        comment = []
    return rows


def render_values() -> str:
    """The chart values block, markers included."""
    out = [VALUES_BEGIN, "", "| value | default | meaning |", "|---|---|---|"]
    for path, default, description in values_rows(VALUES.read_text()):
        out.append(f"| `{path}` | {_cell(default)} | {_cell(description)} |")
    out.extend(["", VALUES_END])
    return "\n".join(out)


def splice(doc: str, block: str, begin: str = BEGIN, end_marker: str = END) -> str:
    """doc with the text between the markers replaced by block."""
    start, end = doc.find(begin), doc.find(end_marker)
    if start < 0 or end < start:
        raise ValueError(f"{DOC.relative_to(ROOT)} lacks the markers {begin!r} ... {end_marker!r}")
    return doc[:start] + block + doc[end + len(end_marker):]


def generate(doc: str) -> str:
    """doc with both generated blocks brought up to date."""
    return splice(splice(doc, render()), render_values(), VALUES_BEGIN, VALUES_END)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/kubernetes.md is stale")
    args = parser.parse_args(argv)
    current = DOC.read_text()
    wanted = generate(current)
    if args.check:
        if wanted != current:
            print(f"{DOC.relative_to(ROOT)} is stale: run python scripts/gen_kubernetes_reference.py", file=sys.stderr)
            return 1
        return 0
    if wanted != current:
        DOC.write_text(wanted)
        print(f"wrote {DOC.relative_to(ROOT)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
