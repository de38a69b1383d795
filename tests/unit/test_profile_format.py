"""minedraft profile's pure parts: model presets and configs, shape grids, the cost-curve format."""

import copy
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from minedraft.doctor import model_size
from minedraft.profile import curves
from minedraft.profile.architecture import PRESETS, Architecture, ArchitectureError, from_hf_config, resolve
from minedraft.profile.shapes import SHAPE_PRESETS, Measurement, ShapeGrid, cache_tokens, plan

ROOT = Path(__file__).resolve().parents[2]
H200 = ROOT / "benchmarks" / "curves" / "h200-qwen3-32b.json"
PAIR = ROOT / "minedraft" / "models" / "data" / "pair-v1"


# -- presets and configs -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "billions"), [("qwen3-32b", 32.8), ("qwen3-1.7b", 1.72), ("qwen3-0.6b", 0.596)])
def test_presets_have_the_model_cards_parameter_counts(name, billions):
    # Model cards: 32.8B, 1.7B, 0.6B (the two small ones tie their embeddings).
    assert PRESETS[name].params() / 1e9 == pytest.approx(billions, rel=0.01)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_parameter_counts_agree_with_doctors_arithmetic(name):
    a = PRESETS[name]
    config = SimpleNamespace(hidden_size=a.hidden, num_hidden_layers=a.layers, num_attention_heads=a.heads,
                             num_key_value_heads=a.kv_heads, head_dim=a.head_dim, intermediate_size=a.inter,
                             vocab_size=a.vocab, model_type=a.model_type, tie_word_embeddings=a.tied_embeddings)
    assert a.params() == model_size(config).parameters


def test_kv_bytes_and_config_match_the_h200_file():
    reference = json.loads(H200.read_text())["models"]
    for name in ("qwen3-32b", "qwen3-1.7b", "qwen3-0.6b"):
        assert PRESETS[name].curve_config() == reference[name]["config"]
        assert PRESETS[name].kv_bytes_per_token("bfloat16") == reference[name]["kv_bytes_per_token"]


def test_the_local_pair_is_read_from_its_config_files():
    name, target = resolve("pair-v1-target")
    assert name == "pair-v1-target"
    config = json.loads((PAIR / "target" / "config.json").read_text())
    assert (target.hidden, target.layers, target.vocab) == (config["hidden_size"], config["num_hidden_layers"],
                                                            config["vocab_size"])
    assert target.model_type == "llama" and target.tied_embeddings
    # A path (the directory or its config.json) is named after the directory; NAME=PATH names it.
    assert resolve(str(PAIR / "draft"))[0] == "draft"
    assert resolve(str(PAIR / "draft" / "config.json"))[1] == resolve("pair-v1-draft")[1]
    assert resolve(f"small={PAIR / 'draft'}")[0] == "small"


def test_configs_that_cannot_be_profiled_name_the_field(tmp_path):
    good = json.loads((PAIR / "target" / "config.json").read_text())
    with pytest.raises(ArchitectureError, match=r"model_type.*'mixtral'"):
        from_hf_config({**good, "model_type": "mixtral"})
    with pytest.raises(ArchitectureError, match="hidden_size"):
        from_hf_config({k: v for k, v in good.items() if k != "hidden_size"})
    with pytest.raises(ArchitectureError, match="kv_heads"):
        from_hf_config({**good, "num_key_value_heads": 3, "num_attention_heads": 4})
    with pytest.raises(ArchitectureError, match=r"^drafter: 'nope'"):
        resolve("nope", "drafter")
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ArchitectureError, match=r"target: .*not JSON"):
        resolve(str(tmp_path), "target")


def test_qwen3_configs_nested_in_text_config():
    arch = from_hf_config({"text_config": {"model_type": "qwen3", "hidden_size": 64, "num_hidden_layers": 2,
                                           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
                                           "intermediate_size": 128, "vocab_size": 100}})
    assert arch.qk_norm and arch.head_dim == 32 and not arch.tied_embeddings


# -- shapes --------------------------------------------------------------------------------------------------------


def test_the_gpu_grid_is_the_h200_files_grid():
    reference = json.loads(H200.read_text())["models"]
    grid = SHAPE_PRESETS["gpu"]
    measured = plan(grid, "qwen3-32b", ["qwen3-1.7b"], concurrent=False)
    forwards = {(m.batch, m.context, m.tokens) for m in measured if m.kind == "forward" and m.model == "qwen3-32b"}
    loops = {(m.batch, m.context, m.tokens) for m in measured if m.kind == "draft_loop"}
    assert forwards == {(e["batch"], e["context"], e["new_tokens"]) for e in reference["qwen3-32b"]["forward_ms"]}
    assert loops == {(e["batch"], e["context"], e["k"]) for e in reference["qwen3-1.7b"]["draft_loop_ms"]}
    assert grid.new_tokens() == (1, 4, 6)


def test_plan_groups_and_concurrent_pairs():
    grid = SHAPE_PRESETS["tiny"]
    measured = plan(grid, "t", ["d1", "d2"], concurrent=True)
    kinds = [(m.kind, m.model, m.drafter) for m in measured]
    assert kinds[0] == ("forward", "t", "")
    assert ("concurrent", "t", "d2") in kinds
    assert sum(1 for m in measured if m.kind == "concurrent") == 2 * len(grid.concurrent_points)
    assert not any(m.kind == "concurrent" for m in plan(grid, "t", ["d1"], concurrent=False))
    assert not any(m.kind == "draft_loop" and m.model == "t" for m in measured)


def test_grid_overrides_and_bad_grids():
    grid = SHAPE_PRESETS["cpu-small"].with_overrides(batches=[1, 4], contexts=[64], ks=[2, 5])
    assert grid.points == ((1, 64), (4, 64))
    assert grid.ks == (2, 5) and grid.new_tokens() == (1, 3, 6)
    with pytest.raises(ValueError, match="batch and context"):
        ShapeGrid(points=((0, 10),), ks=(3,))
    with pytest.raises(ValueError, match="draft lengths"):
        ShapeGrid(points=((1, 10),), ks=())


def test_cache_holds_every_position_a_measurement_writes():
    assert cache_tokens(100, 4, "forward") == 104  # positions 100..103
    assert cache_tokens(100, 3, "draft_loop") == 106  # 4 tokens at 100..103, then 104 and 105


def test_measurement_round_trip_and_label():
    m = Measurement("concurrent", "t", 8, 1024, 3, drafter="d")
    assert Measurement.from_json(json.loads(json.dumps(m.to_json()))) == m
    assert "beside d" in m.label()
    with pytest.raises(ValueError, match="kind"):
        Measurement("decode", "t", 1, 1, 1)
    assert Measurement("prefill", "t", 1, 0, 512).label() == "prefill t batch=1 context=0 tokens=512"


# -- the format -----------------------------------------------------------------------------------------------------


def test_the_h200_file_is_valid():
    curves.validate(json.loads(H200.read_text()))


def _doc():
    arch = Architecture(hidden=8, layers=1, heads=2, kv_heads=1, head_dim=4, inter=16, vocab=32)
    doc = curves.new_document("dev", "float32", "eager (cpu)", "today", [], [("t", "target", arch),
                                                                          ("d", "drafter", arch)])
    curves.add_result(doc, Measurement("forward", "t", 1, 16, 1), {"ms": 1.23456})
    curves.add_result(doc, Measurement("draft_loop", "d", 1, 16, 3), {"ms": 2.0})
    curves.add_result(doc, Measurement("concurrent", "t", 1, 16, 3, drafter="d"),
                      {"ms": 3.0, "target_ms": 2.5, "drafter_ms": 2.0, "target_alone_ms": 2.0,
                       "drafter_alone_ms": 1.5})
    curves.add_result(doc, Measurement("prefill", "t", 1, 0, 64), {"ms": 4.0})
    curves.add_timeout(doc, Measurement("forward", "t", 2, 16, 1), 60.0, "measurement")
    return doc


def test_written_documents_validate_and_read_back(tmp_path):
    doc = _doc()
    assert doc["models"]["t"]["forward_ms"] == [{"batch": 1, "context": 16, "new_tokens": 1, "ms": 1.235}]
    assert "draft_loop_ms" not in doc["models"]["t"]
    assert doc["timeouts"][0]["batch"] == 2 and doc["timeouts"][0]["during"] == "measurement"
    path = tmp_path / "sub" / "curves.json"
    curves.write(doc, path)
    assert curves.read(path) == doc


@pytest.mark.parametrize(("break_it", "field"), [
    (lambda d: d.update(format="minedraft-cost-curves/v0"), "format"),
    (lambda d: d.pop("device"), "device"),
    (lambda d: d["models"]["t"].update(role="verifier"), "models.t.role"),
    (lambda d: d["models"]["t"]["config"].pop("vocab"), "models.t.config.vocab"),
    (lambda d: d["models"]["t"]["forward_ms"][0].update(ms=-1.0), r"models.t.forward_ms\[0\].ms"),
    (lambda d: d["models"]["t"]["forward_ms"][0].update(ms=None), r"models.t.forward_ms\[0\].ms"),
    (lambda d: d["models"]["t"]["forward_ms"].append(dict(d["models"]["t"]["forward_ms"][0])),
     r"models.t.forward_ms\[1\]"),
    (lambda d: d["models"]["d"]["draft_loop_ms"][0].pop("k"), r"models.d.draft_loop_ms\[0\].k"),
    (lambda d: d["models"]["t"].update(draft_loop_ms=[]), "models.t.draft_loop_ms"),
    (lambda d: d["models"]["t"].update(role="drafter"), "models"),
    (lambda d: d["concurrent_ms"][0].update(drafter="t"), r"concurrent_ms\[0\].drafter"),
    (lambda d: d["concurrent_ms"][0].pop("target_alone_ms"), r"concurrent_ms\[0\].target_alone_ms"),
    (lambda d: d["models"]["t"]["prefill_ms"][0].update(tokens=0), r"models.t.prefill_ms\[0\].tokens"),
    (lambda d: d["models"]["t"]["prefill_ms"][0].update(context=-1), r"models.t.prefill_ms\[0\].context"),
])
def test_broken_documents_name_the_field(break_it, field):
    doc = copy.deepcopy(_doc())
    break_it(doc)
    with pytest.raises(curves.CurveFormatError, match=f"^{field}: "):
        curves.validate(doc)


@pytest.mark.parametrize(("argv", "message"), [
    (["--target", "nope"], "target: 'nope' is neither a preset"),
    (["--drafter", "pair-v1-target"], "drafter: two models are named 'pair-v1-target'"),
    (["--repeats", "0"], "repeats: must be at least 1"),
    (["--device", "tpu"], "device: expected auto, cpu, cuda or cuda:N"),
])
def test_bad_command_lines_are_refused_naming_the_field(argv, message, capsys):
    from minedraft.profile.cli import main

    assert main(["--device", "cpu", *argv]) == 2
    assert message in capsys.readouterr().err


def test_a_curve_file_plots(tmp_path):
    from minedraft.profile.plot import main

    path = tmp_path / "c.json"
    curves.write(_doc(), path)
    assert main([str(path)]) == 0
    assert (tmp_path / "c.png").read_bytes().startswith(b"\x89PNG")


def test_the_profiler_plans_prefill_shapes_and_the_twin_prices_prefill_from_them():
    from minedraft.twin.capacity import prefill_ms
    from minedraft.twin.curves import parse_curves

    measured = plan(SHAPE_PRESETS["tiny"], "t", ["d"], concurrent=False)
    prefills = {(m.model, m.tokens, m.context) for m in measured if m.kind == "prefill"}
    assert prefills == {("t", 8, 0), ("t", 16, 0), ("d", 8, 0), ("d", 16, 0)}
    assert cache_tokens(0, 512, "prefill") == 512
    assert (1024, 4096) in SHAPE_PRESETS["gpu"].prefill_points
    doc = _doc()
    assert doc["models"]["t"]["prefill_ms"] == [{"tokens": 64, "context": 0, "ms": 4.0}]
    curves.validate(doc)
    price = prefill_ms(parse_curves(doc).models["t"], 32)
    assert price.source == "measured" and price.ms == pytest.approx(2.0)  # proportional below the measured point
    with pytest.raises(ValueError, match="prefill"):
        ShapeGrid(points=((1, 10),), ks=(3,), prefill_points=((0, 0),))
