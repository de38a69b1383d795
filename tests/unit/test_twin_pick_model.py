"""Which model of a curve file a twin command means (twin.curves.pick_model): a public function both `twin plan` and
the autoscaler's replica-model builder use, so neither imports another module's private helper."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from minedraft.twin import autoscale_model
from minedraft.twin.curves import CurveError, load_curves, pick_model

ROOT = Path(__file__).resolve().parents[2]
H200 = load_curves(ROOT / "benchmarks" / "curves" / "h200-qwen3-32b.json")  # one target, two drafters


def test_the_named_model_else_the_only_one_else_an_error_naming_the_role() -> None:
    assert pick_model(H200, "drafter", "qwen3-0.6b") == "qwen3-0.6b"
    assert pick_model(H200, "target", None) == "qwen3-32b"
    with pytest.raises(CurveError) as several:
        pick_model(H200, "drafter", None)
    assert "2 drafter models" in str(several.value) and "name one" in str(several.value)


def test_the_autoscale_model_builder_imports_no_private_name_of_another_module() -> None:
    tree = ast.parse(Path(autoscale_model.__file__).read_text())
    private = [f"{node.module}.{alias.name}" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
               for alias in node.names if alias.name.startswith("_") and node.module != "__future__"]
    assert private == []
