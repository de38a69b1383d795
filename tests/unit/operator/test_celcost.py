"""The repository's CEL cost estimator (minedraft.operator.celcost) against the API server's own published estimates
(apiextensions-apiserver's TestCostEstimation: each rule priced on a schema without bounds, then with maxItems /
maxProperties / maxLength set), and the chart's CRD priced against the API server's limits."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from minedraft.operator import celcost
from minedraft.operator import crd as crd_module

Gen = Callable[[int | None], dict[str, Any]]


def _rule(node: dict[str, Any], rule: str) -> dict[str, Any]:
    return {**node, "x-kubernetes-validations": [{"rule": rule}]}


def _bound(node: dict[str, Any], key: str, bound: int | None) -> dict[str, Any]:
    return node if bound is None else {**node, key: bound}


def _primitive(kind: str) -> dict[str, Any]:
    if kind in ("duration", "date", "date-time"):
        return {"type": "string", "format": kind}
    if kind == "int-or-string":
        return {"x-kubernetes-int-or-string": True}
    return {"type": kind}


OBJECT_WITH_REQUIRED = {"type": "object", "required": ["required"],
                        "properties": {"required": {"type": "string"}, "optional": {"type": "string"}}}


def array(kind: str, rule: str) -> Gen:
    return lambda n: _rule(_bound({"type": "array", "items": _primitive(kind)}, "maxItems", n), rule)


def array_of_arrays(kind: str, rule: str) -> Gen:
    return lambda n: _rule(_bound({"type": "array", "items": {"type": "array", "items": {"type": kind}}},
                                  "maxItems", n), rule)


def object_array(rule: str) -> Gen:
    return lambda n: _rule(_bound({"type": "array", "items": OBJECT_WITH_REQUIRED}, "maxItems", n), rule)


def map_array(kind: str, rule: str) -> Gen:
    item = {"type": "object", "additionalProperties": {"type": kind}}
    return lambda n: _rule(_bound({"type": "array", "items": item}, "maxItems", n), rule)


def map_of(item: dict[str, Any], rule: str) -> Gen:
    return lambda n: _rule(_bound({"type": "object", "additionalProperties": item}, "maxProperties", n), rule)


def map_with(kind: str, rule: str) -> Gen:
    return map_of(_primitive(kind), rule)


def string(rule: str) -> Gen:
    return lambda n: _rule(_bound({"type": "string"}, "maxLength", n), rule)


def bytes_(rule: str) -> Gen:
    return lambda n: _rule(_bound({"type": "string", "format": "byte"}, "maxLength", n), rule)


def enum(rule: str, *values: str) -> Gen:
    return lambda n: _rule(_bound({"type": "string", "enum": list(values)}, "maxLength", n), rule)


def nested_spec(rule: str) -> Gen:
    def gen(n: int | None) -> dict[str, Any]:
        value = _bound({"type": "string"}, "maxLength", n)
        return _rule(_bound({"type": "object", "additionalProperties": value}, "maxProperties", n), rule)
    return gen


def nested_root(rule: str, all_bounded: bool) -> Gen:
    def gen(n: int | None) -> dict[str, Any]:
        inner = _bound(OBJECT_WITH_REQUIRED, "maxProperties", n if all_bounded else None)
        item = _bound({"type": "object", "additionalProperties": inner}, "maxProperties", n)
        return _rule(_bound({"type": "array", "items": item}, "maxItems", n if all_bounded else None), rule)
    return gen


EXCEEDS = -1  # the published case only says "over the limit"

# (name, generator, cost without bounds, bound, cost with it): the published cases, less the ones on functions of
# Kubernetes' extended libraries (find, join, isSorted, replace, split, lowerAscii) that no MineDraft rule uses.
PUBLISHED = [
    ("number array with all", array("number", "self.all(x, true)"), 4718591, 10, 32),
    ("string array with all", array("string", "self.all(x, true)"), 3145727, 20, 62),
    ("boolean array with all", array("boolean", "self.all(x, true)"), 1887437, 5, 17),
    ("array of number arrays with all", array_of_arrays("number", "self.all(x, true)"), 3145727, 100, 302),
    ("array of objects with all", object_array("self.all(x, true)"), 555128, 50, 152),
    ("map of numbers with all", map_with("number", "self.all(x, true)"), 1348169, 10, 32),
    ("map of strings with all", map_with("string", "self.all(x, true)"), 1179647, 3, 11),
    ("map of booleans with all", map_with("boolean", "self.all(x, true)"), 943718, 100, 302),
    ("string with contains", string("self.contains('test')"), 314574, 10, 5),
    ("string with startsWith", string("self.startsWith('test')"), 2, 15, 2),
    ("string with endsWith", string("self.endsWith('test')"), 2, 30, 2),
    ("concat string", string('size(self + "hello") > size("hello")'), 314578, 4, 7),
    ("index of array with numbers", array("number", "self[1] == 0.0"), 2, 5000, 2),
    ("index of array with strings", array("string", "self[1] == self[1]"), 314577, 8, 314577),
    ("O(n^2) loop with numbers", array("number", "self.all(x, self.all(y, true))"), EXCEEDS, 10, 352),
    ("O(n^3) loop with numbers", array("number", "self.all(x, self.all(y, self.all(z, true)))"), EXCEEDS, 10, 3552),
    ("regex matches simple", string('self.matches("x")'), 314574, 50, 22),
    ("regex matches empty string", string('"".matches("(((((((((())))))))))[0-9]")'), 7, 10, 7),
    ("regex matches empty regex", string('self.matches("")'), 1, 100, 1),
    ("map of strings with value length", nested_spec("self.all(x, x.contains(self[x]))"), 2752507, 10, 72),
    ("set array maxLength to zero", array("number", "self[3] == 0.0"), 2, 0, 2),
    ("set map maxLength to zero", map_with("number", 'self["x"] == 0.0'), 2, 0, 2),
    ("set string maxLength to zero", string('self == "x"'), 2, 0, 1),
    ("set bytes maxLength to zero", bytes_('self == b"x"'), 2, 0, 1),
    ("set maxLength greater than estimated maxLength", array("number", "self.all(x, x == 0.0)"), 6291454,
     3 * 1024 * 2048, 25165826),
    ("nested types with root rule with all supporting maxLength",
     nested_root('self.all(x, x["y"].required == "z")', True), 7340027, 10, 72),
    ("nested types with root rule with one supporting maxLength",
     nested_root('self.all(x, x["y"].required == "z")', False), 7340027, 10, 7340027),
    ("int-or-string array with all", array("int-or-string", "self.all(x, true)"), 4718591, 10, 32),
    ("index of array with int-or-strings", array("int-or-string", "self[0] == 5"), 3, 10, 3),
    ("index of array with booleans", array("boolean", "self[0] == false"), 2, 25, 2),
    ("index of array of objects", object_array("self[0] == null"), 2, 422, 2),
    ("index of array of array of numbers", array_of_arrays("number", "self[0][0] == -1.0"), 3, 51, 3),
    ("array of number maps with all", map_array("number", "self.all(x, x.y == 25.2)"), 6291452, 12, 74),
    ("index of array of number maps", map_array("number", "self[0].x > 2.0"), 4, 3000, 4),
    ("duration array with all", array("duration", "self.all(x, true)"), 2359295, 5, 17),
    ("index of duration array", array("duration", "self[0].getHours() == 2"), 4, 525, 4),
    ("date array with all", array("date", "self.all(x, true)"), 725936, 15, 47),
    ("index of date array", array("date", "self[2].getDayOfMonth() == 13"), 4, 42, 4),
    ("date-time array with all", array("date-time", "self.all(x, true)"), 428963, 25, 77),
    ("index of date-time array", array("date-time", "self[2].getMinutes() == 45"), 4, 99, 4),
    ("map of int-or-strings with all", map_with("int-or-string", "self.all(x, true)"), 1348169, 15, 47),
    ("map of objects with all", map_of(OBJECT_WITH_REQUIRED, "self.all(x, true)"), 428963, 20, 62),
    ("map of number maps with all", map_of({"type": "object", "additionalProperties": {"type": "number"}},
                                           "self.all(x, true)"), 1179647, 10, 32),
    ("map of number arrays with all", map_of({"type": "array", "items": {"type": "number"}}, "self.all(x, true)"),
     1179647, 25, 77),
    ("map of durations with all", map_with("duration", "self.all(x, true)"), 1048577, 5, 17),
    ("map of dates with all", map_with("date", "self.all(x, true)"), 524288, 10, 32),
    ("map of date-times with all", map_with("date-time", "self.all(x, true)"), 349526, 25, 77),
    ("check cost of size call", map_with("integer", "oldSelf.size() == self.size()"), 5, 10, 5),
    ("check cost of timestamp comparison", map_with("date-time", 'self["a"] == self["b"]'), 8, 7, 8),
    ("check cost of duration comparison", map_with("duration", 'self["c"] == self["d"]'), 8, 42, 8),
    ("enums with maxLength equals to the longest possible value",
     enum("self.contains('A')", "A", "B", "C", "LongValue"), 2, 1000, 401),
]


def _price(schema: dict[str, Any]) -> int:
    [cost] = celcost.rule_costs(schema, resource_root=False)
    return cost.cost


@pytest.mark.parametrize(("name", "gen", "unbounded", "bound", "bounded"), PUBLISHED, ids=[c[0] for c in PUBLISHED])
def test_reproduces_the_api_servers_published_estimates(name: str, gen: Gen, unbounded: int, bound: int,
                                                        bounded: int) -> None:
    if unbounded == EXCEEDS:
        assert _price(gen(None)) > celcost.PER_CRD_COST_LIMIT
    else:
        assert _price(gen(None)) == unbounded
    assert _price(gen(bound)) == bounded


def test_unknown_functions_are_refused_not_priced_low() -> None:
    with pytest.raises(celcost.UnsupportedExpression):
        celcost.rule_cost("self.lowerAscii() == 'x'", {"type": "string"})


CRD_SCHEMA = crd_module.crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def test_every_rule_of_the_crd_is_within_the_api_servers_limits() -> None:
    costs = celcost.rule_costs(CRD_SCHEMA)
    assert len(costs) >= 30  # every rule was priced (none skipped)
    assert celcost.over_limits(costs) == []
    assert all(c.cost <= celcost.PER_RULE_COST_LIMIT for c in costs)
    assert sum(c.total for c in costs) <= celcost.PER_CRD_COST_LIMIT


def _unbounded(schema: dict[str, Any], path: list[str], key: str) -> dict[str, Any]:
    import copy

    out = copy.deepcopy(schema)
    node = out
    for name in path:
        node = node["properties"][name]
    node.pop(key)
    return out


def test_the_old_unbounded_allowed_modes_would_have_been_refused() -> None:
    """Without maxItems on autoscaling.speculation.allowedModes the GPU-fit rule prices at ~18.9M (18 per item, its
    `m in [...]` over psd, sd and lookahead, times the 1,048,575 three-byte strings a request can hold): the API
    server refuses the CRD."""
    old = _unbounded(CRD_SCHEMA, ["spec", "autoscaling", "speculation", "allowedModes"], "maxItems")
    problems = celcost.over_limits(celcost.rule_costs(old))
    assert any("per-rule budget" in p and "allowedModes.exists" in p for p in problems), problems
    [gpu_fit] = [c for c in celcost.rule_costs(old) if "allowedModes.exists" in c.rule]
    assert 18_000_000 < gpu_fit.cost < 19_000_000


def test_lists_maps_and_strings_read_by_rules_are_bounded() -> None:
    """The estimator's view: no rule prices an unbounded list, map or string (each read would count up to 3 MiB)."""
    for cost in celcost.rule_costs(CRD_SCHEMA):
        assert cost.cost < 1_000_000 or cost.rule.startswith("self.metadata.name"), cost
