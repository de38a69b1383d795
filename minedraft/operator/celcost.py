"""The API server's static cost estimate of a CRD's CEL rules, offline: what `kubectl apply` of the CRD would refuse.

Kubernetes prices every x-kubernetes-validations rule when the CRD is created or updated, before any object exists:
cel-go's static cost estimator walks the checked expression, and the API server supplies the sizes of the values a
rule reads from the schema (maxItems, maxProperties, maxLength, an enum's longest value; for anything unbounded, as
many of the smallest serialized value as fit in a 3 MiB request). A rule estimated above 10,000,000
(StaticEstimatedCostLimit, the same as the per-call runtime limit) is refused, and so is a CRD whose rules together,
each multiplied by how many times it can run in one object (the maxItems/maxProperties of the lists and maps above
it), exceed 100,000,000 (StaticEstimatedCRDCostLimit).

No Python library estimates CEL cost (the `cel` evaluator has no parser API), so this module parses the CEL subset
the MineDraft rules use and prices it with cel-go's rules (checker/cost.go): identifiers and field selections cost
1, constants 0, list literals 10 plus their elements, O(1) functions 1 plus their arguments, comprehensions
(all/exists/exists_one/filter/map) their range's size times the loop body's cost, string equality, prefix, contains
and regex matches in proportion to the sizes involved. Sizes come from the schema as the API server declares them
(apiextensions-apiserver's SchemaDeclType: a string's maxLength counts 4 bytes per character). tests/unit/operator/
test_celcost.py reproduces the API server's own published estimates.

One deliberate difference: where the API server sizes a variable iterating over a literal list by the rule's own
node (an object: size 0), this estimator takes the longer of that and the literal's longest element, so it never
prices lower than the API server.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

MAX_REQUEST_SIZE_BYTES = 3 * 1024 * 1024
PER_RULE_COST_LIMIT = 10_000_000  # StaticEstimatedCostLimit (= PerCallLimit)
PER_CRD_COST_LIMIT = 100_000_000  # StaticEstimatedCRDCostLimit
MAX_U64 = 2**64 - 1

# cel-go common/cost.go
STRING_TRAVERSAL_COST_FACTOR = 0.1
REGEX_STRING_LENGTH_COST_FACTOR = 0.25
SELECT_AND_IDENT_COST = 1
LIST_CREATE_BASE_COST = 10
MAP_CREATE_BASE_COST = 30

# apiserver/pkg/cel: serialized sizes of the formatted string types (min, max), in bytes with quotes.
_FORMAT_SIZES = {"duration": (3, 32), "date": (12, 12), "date-time": (21, 32)}

Schema = Mapping[str, Any]


# -- sizes and costs (cel-go's SizeEstimate/CostEstimate: saturating unsigned ranges) ------------------------------


def _add(x: int, y: int) -> int:
    return min(MAX_U64, x + y)


def _mul(x: int, y: int) -> int:
    return min(MAX_U64, x * y)


def _factor(x: int, factor: float) -> int:
    value = math.ceil(float(x) * factor)
    return MAX_U64 if value >= 2.0**64 else int(value)


@dataclass(frozen=True, slots=True)
class Range:
    """A [lo, hi] estimate: a size (characters, items, entries) or a cost."""

    lo: int
    hi: int

    def add(self, other: Range) -> Range:
        return Range(_add(self.lo, other.lo), _add(self.hi, other.hi))

    def mul(self, other: Range) -> Range:
        return Range(_mul(self.lo, other.lo), _mul(self.hi, other.hi))

    def by_factor(self, factor: float) -> Range:
        return Range(_factor(self.lo, factor), _factor(self.hi, factor))

    def union(self, other: Range) -> Range:
        return Range(min(self.lo, other.lo), max(self.hi, other.hi))


ZERO = Range(0, 0)
ONE = Range(1, 1)
UNKNOWN = Range(0, MAX_U64)


# -- the schema as CEL sees it (SchemaDeclType) --------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class DeclType:
    """A schema node's CEL type with the API server's size bounds: max_elements (a string's bytes, a list's items, a
    map's entries; 0 for scalars and objects) and min_size (its smallest JSON serialization, for unbounded lists)."""

    kind: str  # object, map, list, string, bytes, int, double, bool, duration, timestamp, dyn, null, optional
    max_elements: int = 0
    min_size: int = 1
    fields: tuple[tuple[str, DeclType], ...] = ()
    elem: DeclType | None = None
    key: DeclType | None = None

    def field(self, name: str) -> DeclType | None:
        for key, value in self.fields:
            if key == name:
                return value
        return None


STRING_KEY = DeclType("string", 0, 2)  # map keys: apiserver's plain StringType, no size bound of its own
DYN = DeclType("dyn")
BOOL = DeclType("bool", min_size=4)
INT = DeclType("int")


def _max_list_items(min_size: int) -> int:
    return (MAX_REQUEST_SIZE_BYTES - 2) // (min_size + 1)  # "[" and "]", a comma per item


def _max_map_entries(min_size: int) -> int:
    return (MAX_REQUEST_SIZE_BYTES - 2) // (min_size + 6)  # a 2-byte key with quotes, colon and comma


def _min_size_json(schema: Schema) -> int:
    if schema.get("x-kubernetes-int-or-string"):
        return 1
    kind = schema.get("type")
    if kind == "boolean":
        return 4
    if kind in ("number", "integer"):
        return 1
    if kind == "string":
        return _FORMAT_SIZES.get(schema.get("format", ""), (2, 0))[0]
    if kind == "array":
        return 2
    if kind == "object":
        size = 2
        for name in schema.get("required", []):
            prop = schema.get("properties", {}).get(name)
            if prop is not None and "default" not in prop:
                size += len(name) + _min_size_json(prop) + 4
        return size
    return 1


def decl_type(schema: Schema, resource_root: bool = False) -> DeclType:
    """The API server's SchemaDeclType for a structural schema node."""
    if schema.get("x-kubernetes-int-or-string"):
        return DeclType("dyn", MAX_REQUEST_SIZE_BYTES - 2, 1)
    kind = schema.get("type")
    min_size = _min_size_json(schema)
    if kind == "array":
        item = decl_type(schema.get("items", {}))
        bound = schema.get("maxItems")
        return DeclType("list", max(0, bound) if bound is not None else _max_list_items(item.min_size), 2, elem=item)
    if kind == "object":
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            value = decl_type(extra)
            bound = schema.get("maxProperties")
            max_entries = max(0, bound) if bound is not None else _max_map_entries(value.min_size)
            return DeclType("map", max_entries, 2, elem=value, key=STRING_KEY)
        properties = dict(schema.get("properties", {}))
        if resource_root:
            # apiVersion, kind and metadata.name/generateName are readable at a resource's root, unbounded.
            meta = {"type": "object", "properties": {"name": {"type": "string"}, "generateName": {"type": "string"}}}
            properties.update({"apiVersion": {"type": "string"}, "kind": {"type": "string"}, "metadata": meta})
        if not properties and schema.get("x-kubernetes-preserve-unknown-fields"):
            return DeclType("dyn", 0, min_size)
        return DeclType("object", 0, min_size,
                        fields=tuple((name, decl_type(sub)) for name, sub in properties.items()))
    if kind == "string":
        fmt = schema.get("format", "")
        if fmt in _FORMAT_SIZES:
            lo, hi = _FORMAT_SIZES[fmt]
            return DeclType("duration" if fmt == "duration" else "timestamp", hi, lo)
        if "maxLength" in schema:
            bound = max(0, schema["maxLength"])
            # maxLength counts characters; the API server reasons in bytes, up to 4 per character (not for bytes).
            return DeclType("bytes" if fmt == "byte" else "string", bound if fmt == "byte" else bound * 4, 2)
        if schema.get("enum") and fmt != "byte":
            return DeclType("string", max(len(str(v)) for v in schema["enum"]), 2)
        return DeclType("bytes" if fmt == "byte" else "string", MAX_REQUEST_SIZE_BYTES - 2, 2)
    if kind == "boolean":
        return BOOL
    if kind == "number":
        return DeclType("double")
    if kind == "integer":
        return INT
    return DYN


def _optional(inner: DeclType) -> DeclType:
    return DeclType("optional", elem=inner)


# -- parsing (the CEL grammar, with cel-go's macros expanded as its parser does) -----------------------------------


class Node:
    """An expression node (identity-hashed: the estimator keys sizes and paths by node)."""

    __slots__ = ()


@dataclass(eq=False, slots=True)
class Literal(Node):
    value: Any
    kind: str  # string, bytes, int, uint, double, bool, null


@dataclass(eq=False, slots=True)
class Ident(Node):
    name: str


@dataclass(eq=False, slots=True)
class Select(Node):
    operand: Node
    name: str
    test_only: bool = False


@dataclass(eq=False, slots=True)
class Call(Node):
    function: str
    args: list[Node]
    target: Node | None = None


@dataclass(eq=False, slots=True)
class ListLit(Node):
    elements: list[Node]


@dataclass(eq=False, slots=True)
class MapLit(Node):
    entries: list[tuple[Node, Node]]


@dataclass(eq=False, slots=True)
class Comprehension(Node):
    iter_var: str
    iter_range: Node
    accu_var: str
    accu_init: Node
    loop_condition: Node
    loop_step: Node
    result: Node
    macro: str


class CelSyntaxError(ValueError):
    pass


_TOKEN = re.compile(r"""
    (?P<ws>\s+)
  | (?P<string>[rRbB]{0,2}(?:'''(?:.|\n)*?'''|\"\"\"(?:.|\n)*?\"\"\"|'(?:\\.|[^'\\\n])*'|"(?:\\.|[^"\\\n])*"))
  | (?P<number>(?:0x[0-9a-fA-F]+u?|\d+\.\d*(?:[eE][+-]?\d+)?|\.\d+(?:[eE][+-]?\d+)?|\d+[eE][+-]?\d+|\d+u?))
  | (?P<ident>[A-Za-z_][A-Za-z0-9_]*)
  | (?P<op>\|\||&&|==|!=|<=|>=|[-+*/%!<>?:.,()\[\]{}])
""", re.VERBOSE)

_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\", "'": "'", '"': '"', "a": "\a", "b": "\b", "f": "\f",
            "v": "\v", "?": "?", "`": "`"}


def _tokens(text: str) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    pos = 0
    while pos < len(text):
        match = _TOKEN.match(text, pos)
        if match is None:
            raise CelSyntaxError(f"unexpected character {text[pos]!r} at {pos} in {text!r}")
        pos = match.end()
        kind = match.lastgroup or ""
        if kind != "ws":
            out.append((kind, match.group()))
    out.append(("end", ""))
    return out


def _string_literal(token: str) -> Literal:
    prefix = re.match(r"[rRbB]*", token).group()  # type: ignore[union-attr]
    body = token[len(prefix):]
    quote = body[:3] if body[:3] in ("'''", '"""') else body[0]
    body = body[len(quote):-len(quote)]
    if "r" not in prefix.lower():
        out, i = [], 0
        while i < len(body):
            if body[i] == "\\" and i + 1 < len(body):
                nxt = body[i + 1]
                if nxt in _ESCAPES:
                    out.append(_ESCAPES[nxt])
                    i += 2
                    continue
                if nxt in "xX":
                    out.append(chr(int(body[i + 2:i + 4], 16)))
                    i += 4
                    continue
                if nxt == "u":
                    out.append(chr(int(body[i + 2:i + 6], 16)))
                    i += 6
                    continue
            out.append(body[i])
            i += 1
        body = "".join(out)
    if "b" in prefix.lower():
        return Literal(body.encode(), "bytes")
    return Literal(body, "string")


_MACROS = {"all": 2, "exists": 2, "exists_one": 2, "filter": 2, "map": 2}
ACCUMULATOR = "__result__"


def _macro(name: str, target: Node, args: list[Node]) -> Node:
    if not isinstance(args[0], Ident):
        raise CelSyntaxError(f"{name}: the first argument must be a variable name")
    var = args[0].name
    acc = Ident(ACCUMULATOR)
    if name == "all":
        return Comprehension(var, target, ACCUMULATOR, Literal(True, "bool"), Call("@not_strictly_false", [acc]),
                             Call("_&&_", [Ident(ACCUMULATOR), args[1]]), Ident(ACCUMULATOR), name)
    if name == "exists":
        return Comprehension(var, target, ACCUMULATOR, Literal(False, "bool"),
                             Call("@not_strictly_false", [Call("!_", [acc])]),
                             Call("_||_", [Ident(ACCUMULATOR), args[1]]), Ident(ACCUMULATOR), name)
    if name == "exists_one":
        step = Call("_?_:_", [args[1], Call("_+_", [Ident(ACCUMULATOR), Literal(1, "int")]), Ident(ACCUMULATOR)])
        return Comprehension(var, target, ACCUMULATOR, Literal(0, "int"), Literal(True, "bool"), step,
                             Call("_==_", [acc, Literal(1, "int")]), name)
    if name == "filter":
        step = Call("_?_:_", [args[1], Call("_+_", [Ident(ACCUMULATOR), ListLit([Ident(var)])]), Ident(ACCUMULATOR)])
        return Comprehension(var, target, ACCUMULATOR, ListLit([]), Literal(True, "bool"), step, acc, name)
    # map(x, t) and map(x, p, t)
    append = Call("_+_", [Ident(ACCUMULATOR), ListLit([args[-1]])])
    step = append if len(args) == 2 else Call("_?_:_", [args[1], append, Ident(ACCUMULATOR)])
    return Comprehension(var, target, ACCUMULATOR, ListLit([]), Literal(True, "bool"), step, acc, name)


class _Parser:
    def __init__(self, text: str) -> None:
        self.tokens = _tokens(text)
        self.pos = 0
        self.text = text

    def peek(self) -> tuple[str, str]:
        return self.tokens[self.pos]

    def take(self, value: str | None = None) -> tuple[str, str]:
        token = self.tokens[self.pos]
        if value is not None and token[1] != value:
            raise CelSyntaxError(f"expected {value!r}, found {token[1]!r} in {self.text!r}")
        self.pos += 1
        return token

    def at(self, *values: str) -> bool:
        kind, value = self.peek()
        return kind in ("op", "ident") and value in values

    def parse(self) -> Node:
        node = self.expr()
        if self.peek()[0] != "end":
            raise CelSyntaxError(f"unexpected {self.peek()[1]!r} in {self.text!r}")
        return node

    def expr(self) -> Node:
        cond = self.binary(0)
        if self.at("?"):
            self.take("?")
            yes = self.binary(0)
            self.take(":")
            return Call("_?_:_", [cond, yes, self.expr()])
        return cond

    _LEVELS: tuple[tuple[str, ...], ...] = (("||",), ("&&",), ("<", "<=", ">", ">=", "==", "!=", "in"),
                                              ("+", "-"), ("*", "/", "%"))

    def binary(self, level: int) -> Node:
        if level == len(self._LEVELS):
            return self.unary()
        left = self.binary(level + 1)
        while self.at(*self._LEVELS[level]):
            op = self.take()[1]
            right = self.binary(level + 1)
            left = Call("@in" if op == "in" else f"_{op}_", [left, right])
        return left

    def unary(self) -> Node:
        if self.at("!"):
            self.take()
            return Call("!_", [self.unary()])
        if self.at("-"):
            self.take()
            operand = self.unary()
            if isinstance(operand, Literal) and operand.kind in ("int", "double"):
                return Literal(-operand.value, operand.kind)  # the parser folds a negated number
            return Call("-_", [operand])
        return self.member()

    def args(self, close: str) -> list[Node]:
        out: list[Node] = []
        while not self.at(close):
            out.append(self.expr())
            if not self.at(close):
                self.take(",")
        self.take(close)
        return out

    def member(self) -> Node:
        node = self.primary()
        while True:
            if self.at("."):
                self.take()
                name = self.take()[1]
                if self.at("("):
                    self.take()
                    args = self.args(")")
                    if name in _MACROS and len(args) in (2, 3) and (name == "map" or len(args) == 2):
                        node = _macro(name, node, args)
                    else:
                        node = Call(name, args, node)
                else:
                    node = Select(node, name)
            elif self.at("["):
                self.take()
                index = self.expr()
                self.take("]")
                node = Call("_[_]", [node, index])
            else:
                return node

    def primary(self) -> Node:
        kind, value = self.take()
        if kind == "string":
            return _string_literal(value)
        if kind == "number":
            if value.endswith("u"):
                return Literal(int(value[:-1], 0), "uint")
            if value.lower().startswith("0x"):
                return Literal(int(value, 16), "int")
            if any(c in value for c in ".eE"):
                return Literal(float(value), "double")
            return Literal(int(value), "int")
        if kind == "ident":
            if value in ("true", "false"):
                return Literal(value == "true", "bool")
            if value == "null":
                return Literal(None, "null")
            if self.at("("):
                self.take()
                args = self.args(")")
                if value == "has":
                    if len(args) != 1 or not isinstance(args[0], Select):
                        raise CelSyntaxError("has() takes one field selection")
                    return Select(args[0].operand, args[0].name, test_only=True)
                return Call(value, args)
            return Ident(value)
        if value == "(":
            node = self.expr()
            self.take(")")
            return node
        if value == "[":
            return ListLit(self.args("]"))
        if value == "{":
            entries: list[tuple[Node, Node]] = []
            while not self.at("}"):
                key = self.expr()
                self.take(":")
                entries.append((key, self.expr()))
                if not self.at("}"):
                    self.take(",")
            self.take("}")
            return MapLit(entries)
        raise CelSyntaxError(f"unexpected {value!r} in {self.text!r}")


def parse(text: str) -> Node:
    """Parse a CEL expression (the subset Kubernetes validation rules use) into an AST with macros expanded."""
    return _Parser(text).parse()


# -- the estimator (cel-go checker/cost.go, with the API server's sizeEstimator) -----------------------------------


class UnsupportedExpression(ValueError):
    """A function or form this estimator does not price (refused rather than priced low)."""


_SCALARS = ("bool", "int", "uint", "double", "duration", "timestamp")
_SIZE_COMPARISONS = ("_<_", "_<=_", "_>_", "_>=_")
_O1_FUNCTIONS = {"size", "!_", "-_", "@not_strictly_false", "hasValue", "value", "orValue", "_*_", "_/_", "_%_",
                 "_-_", "int", "uint", "double", "bool", "getHours", "getMinutes", "getSeconds", "getDayOfMonth",
                 "getMonth", "getFullYear", "getDayOfWeek", "getDayOfYear", "getMilliseconds"}
_LITERAL_TYPES = {"string": DeclType("string"), "bytes": DeclType("bytes"), "int": INT, "uint": DeclType("uint"),
                  "double": DeclType("double"), "bool": BOOL, "null": DeclType("null")}


@dataclass(slots=True)
class _Local:
    path: list[str]
    size: Range | None
    entry: Range | None
    type: DeclType


@dataclass(slots=True)
class _Coster:
    root: DeclType
    variables: dict[str, DeclType]
    paths: dict[Node, list[str]] = field(default_factory=dict)
    sizes: dict[Node, Range] = field(default_factory=dict)
    entries: dict[Node, Range] = field(default_factory=dict)
    types: dict[Node, DeclType] = field(default_factory=dict)
    locals: dict[str, list[_Local]] = field(default_factory=dict)

    # paths, types, sizes

    def local(self, name: str) -> _Local | None:
        stack = self.locals.get(name)
        return stack[-1] if stack else None

    def path(self, e: Node) -> list[str]:
        if isinstance(e, Ident) and (var := self.local(e.name)) is not None:
            return list(var.path)
        return list(self.paths.get(e, []))

    def type(self, e: Node) -> DeclType:
        return self.types.get(e, DYN)

    def estimate_size(self, path: list[str]) -> Range | None:
        """The API server's sizeEstimator: the declared bound at a path from the rule's node."""
        if not path:
            return None
        node = self.root
        for name in path[1:]:
            nxt = node.elem if name in ("@items", "@values") else node.key if name == "@keys" else node.field(name)
            if nxt is None:
                return None
            node = nxt
        return Range(0, node.max_elements)

    def size(self, e: Node) -> Range | None:
        if e in self.sizes:
            return self.sizes[e]
        if isinstance(e, Literal):
            if e.kind in ("string", "bytes"):
                return Range(len(e.value), len(e.value))
            return ONE
        if isinstance(e, ListLit):
            return Range(len(e.elements), len(e.elements))
        if isinstance(e, MapLit):
            return Range(len(e.entries), len(e.entries))
        path = self.path(e)
        estimate = self.estimate_size(path)
        var = self.local(e.name) if isinstance(e, Ident) else None
        if estimate is not None:
            if path and path[0] not in self.variables and var is not None and var.size is not None:
                estimate = estimate.union(var.size)  # an iteration over a literal: never below its elements
            self.sizes[e] = estimate
            return estimate
        kind = self.type(e)
        if kind.kind in _SCALARS or (kind.kind == "optional" and kind.elem is not None and kind.elem.kind in _SCALARS):
            return ONE
        if var is not None and var.size is not None:
            return var.size
        return None

    def size_or_unknown(self, e: Node) -> Range:
        found = self.size(e)
        return UNKNOWN if found is None else found

    def entry_size(self, e: Node) -> Range | None:
        if e in self.entries:
            return self.entries[e]
        if isinstance(e, Ident) and (var := self.local(e.name)) is not None:
            return var.entry
        return None

    # costs

    def cost(self, e: Node) -> Range:
        if isinstance(e, Literal):
            self.types[e] = _LITERAL_TYPES[e.kind]
            return ZERO
        if isinstance(e, Ident):
            return self.cost_ident(e)
        if isinstance(e, Select):
            return self.cost_select(e)
        if isinstance(e, Call):
            return self.cost_call(e)
        if isinstance(e, ListLit):
            total = Range(0, 0)
            item = Range(MAX_U64, 0) if e.elements else ZERO
            elem_type = DYN
            for element in e.elements:
                total = total.add(self.cost(element))
                item = item.union(self.size_or_unknown(element))
                elem_type = self.type(element)
            self.entries[e] = item
            self.types[e] = DeclType("list", len(e.elements), 2, elem=elem_type)
            return total.add(Range(LIST_CREATE_BASE_COST, LIST_CREATE_BASE_COST))
        if isinstance(e, MapLit):
            total = Range(0, 0)
            for key, value in e.entries:
                total = total.add(self.cost(key)).add(self.cost(value))
            self.types[e] = DeclType("map", len(e.entries), 2, elem=DYN, key=DYN)
            return total.add(Range(MAP_CREATE_BASE_COST, MAP_CREATE_BASE_COST))
        if isinstance(e, Comprehension):
            return self.cost_comprehension(e)
        raise UnsupportedExpression(f"cannot price {e!r}")

    def cost_ident(self, e: Ident) -> Range:
        var = self.local(e.name)
        if var is not None:
            self.paths[e] = list(var.path)
            self.types[e] = var.type
        elif e.name in self.variables:
            self.paths[e] = [e.name]
            self.types[e] = self.variables[e.name]
        else:
            raise UnsupportedExpression(f"undeclared reference to {e.name!r}")
        return Range(SELECT_AND_IDENT_COST, SELECT_AND_IDENT_COST)

    def cost_select(self, e: Select) -> Range:
        operand_cost = self.cost(e.operand)
        operand_type = self.type(e.operand)
        if e.test_only:
            self.types[e] = BOOL
            return ONE.add(operand_cost)  # cel-go's default: a presence test costs 1
        total = operand_cost
        if operand_type.kind in ("map", "object"):
            total = total.add(ONE)
        if operand_type.kind == "object":
            found = operand_type.field(e.name)
            if found is None:
                raise UnsupportedExpression(f"no field {e.name!r}")
            self.types[e] = found
        elif operand_type.kind == "map" and operand_type.elem is not None:
            self.types[e] = operand_type.elem
        elif operand_type.kind == "optional" and operand_type.elem is not None:
            inner = operand_type.elem.field(e.name) if operand_type.elem.kind == "object" else None
            self.types[e] = _optional(inner if inner is not None else DYN)
        else:
            self.types[e] = DYN
        self.paths[e] = [*self.path(e.operand), e.name]
        return total

    def cost_call(self, e: Call) -> Range:
        if e.function == "dyn":
            arg_cost = self.cost(e.args[0])
            self.types[e] = DYN
            if (size := self.size(e.args[0])) is not None:
                self.sizes[e] = size
            return ONE.add(arg_cost)
        arg_costs = [self.cost(a) for a in e.args]
        total = ZERO
        if e.target is not None:
            total = total.add(self.cost(e.target))
        fn_cost, result_size = self.function_cost(e, arg_costs)
        if e.function == "_[_]":
            container = self.type(e.args[0])
            if container.kind == "list":
                result_size = self.entry_size(e.args[0])
                self.paths[e] = [*self.path(e.args[0]), "@items"]
            elif container.kind == "map":
                result_size = self.entry_size(e.args[0])
                self.paths[e] = [*self.path(e.args[0]), "@values"]
        if result_size is not None:
            self.sizes[e] = result_size
        return total.add(fn_cost)

    def function_cost(self, e: Call, arg_costs: list[Range]) -> tuple[Range, Range | None]:
        args, fn = e.args, e.function
        arg_sum = ZERO
        for c in arg_costs:
            arg_sum = arg_sum.add(c)
        first = self.type(args[0]) if args else DYN
        if fn in ("_&&_", "_||_"):
            self.types[e] = BOOL
            return Range(arg_costs[0].lo, _add(arg_costs[0].hi, arg_costs[1].hi)), None
        if fn == "_?_:_":
            self.types[e] = self.type(args[1])
            size = self.size_or_unknown(args[1]).union(self.size_or_unknown(args[2]))
            return arg_costs[0].add(arg_costs[1].union(arg_costs[2])), size
        if fn in ("_==_", "_!=_") or (fn in _SIZE_COMPARISONS and first.kind in ("string", "bytes")):
            self.types[e] = BOOL
            smallest = min(self.size_or_unknown(args[0]).hi, self.size_or_unknown(args[1]).hi)
            return Range(1 if smallest > 0 else 0, smallest).by_factor(STRING_TRAVERSAL_COST_FACTOR).add(arg_sum), None
        if fn in _SIZE_COMPARISONS:
            self.types[e] = BOOL
            return ONE.add(arg_sum), None
        if fn == "_+_":
            self.types[e] = first
            if first.kind in ("string", "bytes", "list"):
                size = self.size_or_unknown(args[0]).add(self.size_or_unknown(args[1]))
                left, right = self.entry_size(args[0]), self.entry_size(args[1])
                if left is not None and right is not None:
                    self.entries[e] = left.union(right)
                if first.kind == "list":
                    self.types[e] = first if first.elem is not None and first.elem.kind != "dyn" else self.type(args[1])
                    return ONE.add(arg_sum), size
                return size.by_factor(STRING_TRAVERSAL_COST_FACTOR).add(arg_sum), size
            return ONE.add(arg_sum), None
        if fn == "@in":
            self.types[e] = BOOL
            if self.type(args[1]).kind == "list":
                return self.size_or_unknown(args[1]).by_factor(1).add(arg_sum), None
            return ONE.add(arg_sum), None
        if fn == "_[_]":
            container = self.type(args[0])
            self.types[e] = (container.elem if container.kind in ("list", "map") and container.elem is not None
                             else DYN)
            return ONE.add(arg_sum), None
        target = e.target
        if fn in ("startsWith", "endsWith") and target is not None and len(args) == 1:
            self.types[e] = BOOL
            return self.size_or_unknown(args[0]).by_factor(STRING_TRAVERSAL_COST_FACTOR).add(arg_sum), None
        if fn == "matches" and target is not None and len(args) == 1:
            self.types[e] = BOOL
            text = self.size_or_unknown(target).add(ONE).by_factor(STRING_TRAVERSAL_COST_FACTOR)
            regex = self.size_or_unknown(args[0]).by_factor(REGEX_STRING_LENGTH_COST_FACTOR)
            return text.mul(regex).add(arg_sum), None
        if fn == "contains" and target is not None and len(args) == 1:
            self.types[e] = BOOL
            text = self.size_or_unknown(target).by_factor(STRING_TRAVERSAL_COST_FACTOR)
            sub = self.size_or_unknown(args[0]).by_factor(STRING_TRAVERSAL_COST_FACTOR)
            return text.mul(sub).add(arg_sum), None
        if fn in _O1_FUNCTIONS:
            receiver = self.type(target) if target is not None else first
            if fn in ("value", "orValue") and receiver.kind == "optional" and receiver.elem is not None:
                self.types[e] = receiver.elem
            elif fn in ("size", "int", "uint") or fn.startswith("get"):
                self.types[e] = INT
            elif fn in ("!_", "@not_strictly_false", "hasValue", "bool"):
                self.types[e] = BOOL
            elif fn == "double":
                self.types[e] = DeclType("double")
            else:
                self.types[e] = receiver
            return ONE.add(arg_sum), None
        raise UnsupportedExpression(f"function {fn!r} is not priced by this estimator")

    def cost_comprehension(self, e: Comprehension) -> Range:
        total = self.cost(e.iter_range).add(self.cost(e.accu_init))
        self.locals.setdefault(e.accu_var, []).append(
            _Local(self.path(e.accu_init), self.size(e.accu_init), self.entry_size(e.accu_init),
                   self.type(e.accu_init)))
        range_type = self.type(e.iter_range)
        entry = self.entry_size(e.iter_range)
        if range_type.kind == "map":
            var = _Local([*self.path(e.iter_range), "@keys"], None, None, range_type.key or DYN)
        else:
            var = _Local([*self.path(e.iter_range), "@items"], entry, None, range_type.elem or DYN)
        self.locals.setdefault(e.iter_var, []).append(var)
        loop = self.cost(e.loop_condition)
        step = self.cost(e.loop_step)
        self.locals[e.iter_var].pop()
        total = total.add(self.cost(e.result))
        self.locals[e.accu_var].pop()
        count = self.size_or_unknown(e.iter_range)
        total = total.add(count.mul(step.add(loop)))
        if e.macro in ("all", "exists", "exists_one"):
            self.types[e] = BOOL
            self.sizes[e] = ONE
        else:
            self.types[e] = DeclType("list", 0, 2, elem=(range_type.elem if e.macro == "filter" else DYN) or DYN)
            self.sizes[e] = count
            step_entry = self.entry_size(e.loop_step)
            if step_entry is not None:
                self.entries[e] = step_entry
        return total


def rule_cost(rule: str, node_schema: Schema, resource_root: bool = False, optional_old_self: bool = False) -> int:
    """The API server's estimated cost (its MaxCost) of one rule on a schema node."""
    root = decl_type(node_schema, resource_root)
    old = _optional(root) if optional_old_self else root
    return _Coster(root, {"self": root, "oldSelf": old}).cost(parse(rule)).hi


def max_cardinality(min_size: int) -> int:
    """How often a value of this minimum serialized size can occur in one request (for rules under unbounded
    lists and maps)."""
    return MAX_REQUEST_SIZE_BYTES // (min_size + 1)


@dataclass(frozen=True, slots=True)
class RuleCost:
    path: str  # the schema path of the rule's node, e.g. .spec.engine.env[]
    rule: str
    cost: int  # the rule's own estimate (against PER_RULE_COST_LIMIT)
    cardinality: int  # how many times it can run in one object
    total: int  # cost * cardinality (what counts against PER_CRD_COST_LIMIT)


def rule_costs(schema: Schema, resource_root: bool = True) -> list[RuleCost]:
    """Every rule of a structural schema (a CRD version's openAPIV3Schema) with its estimated cost."""
    return list(_walk(schema, "", 1, resource_root))


def _walk(schema: Schema, path: str, cardinality: int | None, resource_root: bool) -> Iterator[RuleCost]:
    rules = schema.get("x-kubernetes-validations", [])
    if rules:
        times = cardinality if cardinality is not None else max_cardinality(decl_type(schema).min_size)
        for rule in rules:
            cost = rule_cost(rule["rule"], schema, resource_root, bool(rule.get("optionalOldSelf")))
            yield RuleCost(path or "<root>", rule["rule"], cost, times, _mul(cost, times))
    for name, sub in schema.get("properties", {}).items():
        yield from _walk(sub, f"{path}.{name}", cardinality, False)
    if isinstance(schema.get("items"), dict):
        items: int | None = schema.get("maxItems")
        child = None if cardinality is None or items is None else cardinality * items
        yield from _walk(schema["items"], f"{path}[]", child, False)
    if isinstance(schema.get("additionalProperties"), dict):
        entries: int | None = schema.get("maxProperties")
        child = None if cardinality is None or entries is None else cardinality * entries
        yield from _walk(schema["additionalProperties"], f"{path}{{}}", child, False)


def over_limits(costs: list[RuleCost]) -> list[str]:
    """What the API server would answer: one line per rule over a limit, and one for the CRD's total."""
    problems = [f"{c.path}: estimated rule cost {c.cost} exceeds the per-rule budget {PER_RULE_COST_LIMIT}: "
                f"{c.rule}" for c in costs if c.cost > PER_RULE_COST_LIMIT]
    problems += [f"{c.path}: rule cost {c.cost} x {c.cardinality} evaluations exceeds the CRD budget "
                 f"{PER_CRD_COST_LIMIT}: {c.rule}" for c in costs if c.total > PER_CRD_COST_LIMIT]
    total = sum(c.total for c in costs)
    if total > PER_CRD_COST_LIMIT:
        problems.append(f"<root>: estimated rule cost total {total} exceeds the CRD budget {PER_CRD_COST_LIMIT}")
    return problems
