"""What the API server answers to a MineDraft, offline: the CRD's defaults, its schema and its CEL rules.

The API server validates a custom resource against the CRD's openAPIV3Schema (unknown fields refused with kubectl's
strict field validation) after structural defaulting, then evaluates every x-kubernetes-validations rule. This
module does the same with jsonschema (on the schema converted where OpenAPI 3.0 and JSON Schema differ) and a CEL
library (common-expression-language), so `minedraft operator render` refuses what `kubectl apply` would and the
tests check the CRD's rules with the code the CLI runs. Kubernetes' own CEL extensions (quantity(), url(), ...) are
not available; the rules use none.
"""

from __future__ import annotations

import re
from functools import cache
from typing import Any

from minedraft.operator import crd as crd_module

Schema = dict[str, Any]


@cache
def schema() -> Schema:
    """The MineDraft's openAPIV3Schema (built once: the CRD does not change within a process)."""
    return crd_module.crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]  # type: ignore[no-any-return]


def to_json_schema(node: Any) -> Any:
    """OpenAPI 3.0 -> JSON Schema: boolean exclusiveMinimum, and no unknown fields (kubectl's strict validation)."""
    if isinstance(node, list):
        return [to_json_schema(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {k: to_json_schema(v) for k, v in node.items() if not k.startswith("x-kubernetes-")}
    if out.get("exclusiveMinimum") is True:
        out["exclusiveMinimum"] = out.pop("minimum")
    if node.get("x-kubernetes-list-type") == "set":
        out["uniqueItems"] = True  # the API server refuses duplicates in a set list
    if (node.get("type") == "object" and "properties" in node
            and not node.get("x-kubernetes-preserve-unknown-fields") and "additionalProperties" not in node):
        out["additionalProperties"] = False
    return out


def cel_errors(node: Schema, value: Any, old: Any, path: str = "") -> list[str]:
    """Evaluate every x-kubernetes-validations rule where `value` has the node; the failed rules' messages, each
    prefixed with the field it names (the rule's node plus its fieldPath, as the API server reports it)."""
    import cel

    found: list[str] = []
    for rule in node.get("x-kubernetes-validations", []):
        expression = rule["rule"]
        variables: dict[str, Any] = {"self": value}
        if "oldSelf" in expression:
            if rule.get("optionalOldSelf"):
                # CEL's optional type: oldSelf has no value on create. The library takes no optionals from Python,
                # so the value is spelled as a CEL expression.
                replacement = "optional.none()" if old is None else "optional.of(oldSelfValue)"
                expression = re.sub(r"\boldSelf\b", replacement, expression)
                variables["oldSelfValue"] = old
            elif old is None:
                continue  # transition rules run on update only
            else:
                variables["oldSelf"] = old
        where = f"{path}{rule.get('fieldPath', '')}".lstrip(".") or "<root>"
        try:
            passed = cel.evaluate(expression, variables) is True
        except Exception as exc:  # the library's own error types; the API server answers a rule it cannot run too
            found.append(f"{where}: {rule['message']} (the rule could not be evaluated: {exc})")
            continue
        if not passed:
            found.append(f"{where}: {rule['message']}")
    if isinstance(value, dict):
        for name, sub in node.get("properties", {}).items():
            if name in value:
                old_sub = old.get(name) if isinstance(old, dict) else None
                found += cel_errors(sub, value[name], old_sub, f"{path}.{name}" if path else name)
    if isinstance(value, list) and "items" in node:
        for index, item in enumerate(value):
            found += cel_errors(node["items"], item, None, f"{path}[{index}]")
    return found


def admit(obj: dict[str, Any], old: dict[str, Any] | None = None) -> list[str]:
    """What the API server would say about creating (old=None) or updating to `obj`: [] when admitted, else one
    `field: message` line per problem (schema problems first; CEL rules run only on a schema-valid object, as the
    API server's do)."""
    import jsonschema

    root = schema()
    obj = crd_module.apply_defaults(root, obj)
    validator = jsonschema.Draft7Validator(_json_schema())
    problems = [_schema_message(e)
                for e in sorted(validator.iter_errors(obj), key=lambda e: list(map(str, e.absolute_path)))]
    problems += _metadata_problems(obj)
    if problems:
        return problems
    return cel_errors(root, obj, crd_module.apply_defaults(root, old) if old is not None else None)


def _schema_message(error: Any) -> str:
    """`path: message`, with a missing required property named as its own path (`spec.target: required`), as the
    API server's "Required value" names it."""
    path = ".".join(map(str, error.absolute_path))
    if error.validator == "required":
        missing = re.match(r"^'([^']+)' is a required property$", error.message)
        if missing:
            return f"{path + '.' if path else ''}{missing.group(1)}: required"
    return f"{path or '<root>'}: {error.message}"


def _metadata_problems(obj: Any) -> list[str]:
    """The API server's own check of metadata.name (a create names the object, or has it generated), before any
    rule reads it."""
    meta = obj.get("metadata") if isinstance(obj, dict) else None
    if not isinstance(meta, dict):
        return []  # the schema reported it
    name = meta.get("name")
    if name is None and not meta.get("generateName"):
        return ["metadata.name: required"]
    if name is not None and not isinstance(name, str):
        return [f"metadata.name: must be a string (got {type(name).__name__})"]
    return []


@cache
def _json_schema() -> Schema:
    return to_json_schema(schema())  # type: ignore[no-any-return]
