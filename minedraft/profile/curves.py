"""The `minedraft-cost-curves/v1` file: building it from measurements, checking it, writing it.

```
{"format": "minedraft-cost-curves/v1", "device": str, "dtype": str, "execution": "CUDA graphs" | "eager (...)",
 "models": {NAME: {"role": "target" | "drafter", "params": int | null, "config": {hidden, layers, heads, kv_heads,
                    head_dim, inter, vocab}, "kv_bytes_per_token": int,
                   "forward_ms": [{"batch", "context", "new_tokens", "ms"}, ...],
                   "draft_loop_ms": [{"batch", "context", "k", "ms"}, ...]}},      # drafters only
 # optional, written by `minedraft profile`:
 "concurrent_ms": [{"target", "drafter", "batch", "context", "k", "ms", "target_ms", "drafter_ms",
                    "target_alone_ms", "drafter_alone_ms"}, ...],
 "timeouts": [{"kind", "model", "drafter", "batch", "context", "tokens", "timeout_s", "during"}, ...],
 "errors": [{"kind", "model", "drafter", "batch", "context", "tokens", "message"}, ...]}
```

A reader that interpolates times reads `forward_ms` and `draft_loop_ms`; a measurement that timed out or failed is
absent from them and listed under `timeouts` / `errors` instead, so no curve ever holds a null.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from minedraft.profile.architecture import Architecture
from minedraft.profile.shapes import Measurement

FORMAT = "minedraft-cost-curves/v1"
ROLES = ("target", "drafter")
CONFIG_KEYS = ("hidden", "layers", "heads", "kv_heads", "head_dim", "inter", "vocab")
CONCURRENT_TIMES = ("ms", "target_ms", "drafter_ms", "target_alone_ms", "drafter_alone_ms")


class CurveFormatError(ValueError):
    """A cost-curve document that breaks the format; the message names the field (a JSON path)."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


def model_entry(role: str, arch: Architecture, dtype: str) -> dict[str, Any]:
    entry: dict[str, Any] = {"role": role, "params": arch.params(), "config": arch.curve_config(),
                             "kv_bytes_per_token": arch.kv_bytes_per_token(dtype), "forward_ms": []}
    if role == "drafter":
        entry["draft_loop_ms"] = []
    return entry


def new_document(device: str, dtype: str, execution: str, measured: str, notes: list[str],
                 models: list[tuple[str, str, Architecture]]) -> dict[str, Any]:
    """models: (name, role, architecture)."""
    return {"format": FORMAT, "device": device, "dtype": dtype, "execution": execution, "measured": measured,
            "notes": notes, "models": {name: model_entry(role, arch, dtype) for name, role, arch in models}}


def add_result(doc: dict[str, Any], m: Measurement, result: dict[str, float]) -> None:
    ms = round(float(result["ms"]), 3)
    if m.kind == "forward":
        doc["models"][m.model]["forward_ms"].append(
            {"batch": m.batch, "context": m.context, "new_tokens": m.tokens, "ms": ms})
    elif m.kind == "prefill":
        doc["models"][m.model].setdefault("prefill_ms", []).append(
            {"tokens": m.tokens, "context": m.context, "ms": ms})
    elif m.kind == "draft_loop":
        doc["models"][m.model]["draft_loop_ms"].append({"batch": m.batch, "context": m.context, "k": m.tokens,
                                                        "ms": ms})
    else:
        doc.setdefault("concurrent_ms", []).append(
            {"target": m.model, "drafter": m.drafter, "batch": m.batch, "context": m.context, "k": m.tokens,
             **{key: round(float(result[key]), 3) for key in CONCURRENT_TIMES}})


def add_timeout(doc: dict[str, Any], m: Measurement, timeout_s: float, during: str) -> None:
    doc.setdefault("timeouts", []).append({**m.to_json(), "timeout_s": timeout_s, "during": during})


def add_error(doc: dict[str, Any], m: Measurement, message: str) -> None:
    doc.setdefault("errors", []).append({**m.to_json(), "message": message[-2000:]})


def _positive_int(value: Any, field: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise CurveFormatError(field, f"must be a positive integer, got {value!r}")
    return value


def _positive_ms(value: Any, field: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
        raise CurveFormatError(field, f"must be a positive number of milliseconds, got {value!r}")
    return float(value)


def _string(doc: dict[str, Any], key: str) -> None:
    if not isinstance(doc.get(key), str) or not doc[key]:
        raise CurveFormatError(key, f"must be a non-empty string, got {doc.get(key)!r}")


def _points(entries: Any, field: str, tokens_key: str) -> None:
    if not isinstance(entries, list):
        raise CurveFormatError(field, "must be a list")
    seen: set[tuple[int, int, int]] = set()
    for i, entry in enumerate(entries):
        where = f"{field}[{i}]"
        if not isinstance(entry, dict):
            raise CurveFormatError(where, "must be an object")
        key = tuple(_positive_int(entry.get(k), f"{where}.{k}") for k in ("batch", "context", tokens_key))
        _positive_ms(entry.get("ms"), f"{where}.ms")
        if key in seen:
            raise CurveFormatError(where, f"a second entry for batch {key[0]}, context {key[1]}, "
                                          f"{tokens_key} {key[2]}")
        seen.add(key)  # type: ignore[arg-type]


def _prefill_points(entries: Any, field: str) -> None:
    """Optional `prefill_ms`: one request's prompt chunk of `tokens` tokens after `context` cached ones."""
    if not isinstance(entries, list):
        raise CurveFormatError(field, "must be a list")
    seen: set[tuple[int, int]] = set()
    for i, entry in enumerate(entries):
        where = f"{field}[{i}]"
        if not isinstance(entry, dict):
            raise CurveFormatError(where, "must be an object")
        tokens = _positive_int(entry.get("tokens"), f"{where}.tokens")
        context = entry.get("context")
        if isinstance(context, bool) or not isinstance(context, int) or context < 0:
            raise CurveFormatError(f"{where}.context", f"must be an integer >= 0, got {context!r}")
        _positive_ms(entry.get("ms"), f"{where}.ms")
        if (tokens, context) in seen:
            raise CurveFormatError(where, f"a second entry for {tokens} tokens at context {context}")
        seen.add((tokens, context))


def validate(doc: Any) -> None:
    """Raise CurveFormatError naming the first field that breaks `minedraft-cost-curves/v1`."""
    if not isinstance(doc, dict):
        raise CurveFormatError("(document)", "must be a JSON object")
    if doc.get("format") != FORMAT:
        raise CurveFormatError("format", f"must be {FORMAT!r}, got {doc.get('format')!r}")
    for key in ("device", "dtype", "execution"):
        _string(doc, key)
    models = doc.get("models")
    if not isinstance(models, dict) or not models:
        raise CurveFormatError("models", "must be a non-empty object of model name -> curves")
    for name, entry in models.items():
        where = f"models.{name}"
        if not isinstance(entry, dict):
            raise CurveFormatError(where, "must be an object")
        if entry.get("role") not in ROLES:
            raise CurveFormatError(f"{where}.role", f"must be one of {', '.join(ROLES)}, got {entry.get('role')!r}")
        if entry.get("params") is not None:
            _positive_int(entry["params"], f"{where}.params")
        config = entry.get("config")
        if not isinstance(config, dict):
            raise CurveFormatError(f"{where}.config", "must be an object")
        for key in CONFIG_KEYS:
            _positive_int(config.get(key), f"{where}.config.{key}")
        _positive_int(entry.get("kv_bytes_per_token"), f"{where}.kv_bytes_per_token")
        _points(entry.get("forward_ms", []), f"{where}.forward_ms", "new_tokens")
        _prefill_points(entry.get("prefill_ms", []), f"{where}.prefill_ms")
        if entry["role"] == "drafter":
            _points(entry.get("draft_loop_ms", []), f"{where}.draft_loop_ms", "k")
        elif "draft_loop_ms" in entry:
            raise CurveFormatError(f"{where}.draft_loop_ms", "only drafters have draft loops")
    if not any(entry["role"] == "target" for entry in models.values()):
        raise CurveFormatError("models", "no model has role 'target'")
    for i, entry in enumerate(doc.get("concurrent_ms", [])):
        where = f"concurrent_ms[{i}]"
        if not isinstance(entry, dict):
            raise CurveFormatError(where, "must be an object")
        for key, role in (("target", "target"), ("drafter", "drafter")):
            if models.get(entry.get(key), {}).get("role") != role:
                raise CurveFormatError(f"{where}.{key}", f"{entry.get(key)!r} is not a {role} in models")
        for key in ("batch", "context", "k"):
            _positive_int(entry.get(key), f"{where}.{key}")
        for key in CONCURRENT_TIMES:
            _positive_ms(entry.get(key), f"{where}.{key}")
    for key in ("timeouts", "errors"):
        if not isinstance(doc.get(key, []), list):
            raise CurveFormatError(key, "must be a list")


def dumps(doc: dict[str, Any]) -> str:
    validate(doc)
    return json.dumps(doc, indent=1) + "\n"


def write(doc: dict[str, Any], path: Path) -> None:
    text = dumps(doc)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def read(path: Path) -> dict[str, Any]:
    doc = json.loads(Path(path).read_text())
    validate(doc)
    return dict(doc)
