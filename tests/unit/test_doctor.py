"""minedraft doctor's pure parts: the memory arithmetic and the verdict."""

import pytest

from minedraft.doctor import model_size, verdict

# Published configs (Hugging Face Qwen/Qwen3-32B and Qwen/Qwen3-1.7B config.json), the paper's pair.
QWEN3_32B = {"hidden_size": 5120, "num_hidden_layers": 64, "num_attention_heads": 64, "num_key_value_heads": 8,
             "head_dim": 128, "intermediate_size": 25600, "vocab_size": 151936, "tie_word_embeddings": False}
QWEN3_1_7B = {"hidden_size": 2048, "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8,
              "head_dim": 128, "intermediate_size": 6144, "vocab_size": 151936, "tie_word_embeddings": True}


@pytest.mark.parametrize("architecture", ["qwen3", "llama"])
def test_parameter_count_matches_the_built_model(architecture):
    from transformers import AutoModelForCausalLM

    from minedraft.models.tiny import TARGET_SHAPE, tiny_config

    config = tiny_config(architecture, TARGET_SHAPE, vocab_size=2048)
    model = AutoModelForCausalLM.from_config(config)
    assert model_size(config).parameters == sum(p.numel() for p in model.parameters())


def test_the_papers_pair_in_bf16():
    from transformers import Qwen3Config

    target, draft = model_size(Qwen3Config(**QWEN3_32B)), model_size(Qwen3Config(**QWEN3_1_7B))
    assert round(target.parameters / 1e9, 1) == 32.8  # Qwen's model card: 32.8B
    assert round(draft.parameters / 1e9, 1) == 1.7  # the model card: 1.7B (1.4B without embeddings)
    assert round(target.weight_bytes(2) / 2**30, 1) == 61.0  # GiB of bf16 weights, 15.3 per GPU at TP=4
    assert target.kv_bytes_per_token(2) == 256 * 1024  # 64 layers x 8 KV heads x 128 x 2 (K, V) x 2 bytes


def run(mode, k, concurrency, rate):
    return {"mode": mode, "k": k, "concurrency": concurrency, "tokens_per_second": rate}


def test_verdict_names_where_psd_pays_and_with_which_k():
    runs = [run("ar", 0, 4, 100), run("sd", 3, 4, 120), run("psd", 3, 4, 118), run("psd", 2, 4, 110),
            run("ar", 0, 16, 200), run("sd", 3, 16, 210), run("psd", 2, 16, 260), run("psd", 3, 16, 250)]
    result = verdict(runs)
    assert result["psd_pays"]
    at4, at16 = result["per_load"]
    assert (at4["psd_pays"], at4["best"]) == (False, "sd k=3")
    assert (at16["psd_pays"], at16["psd_k"], at16["psd_vs_sd"]) == (True, 2, round(260 / 210, 3))
    assert "16 requests (k=2" in result["summary"]


def test_verdict_says_so_when_psd_never_pays():
    result = verdict([run("ar", 0, 1, 100), run("sd", 3, 1, 90), run("psd", 3, 1, 95)])
    assert not result["psd_pays"]
    assert "does not pay" in result["summary"] and "ar k=0 at 1" in result["summary"]


@pytest.mark.cpu_kind
def test_the_dtype_note_says_why_on_both_kinds_of_cpu_and_on_gpus():
    from minedraft.doctor import dtype_note
    from minedraft.engine.placement import DeviceInfo, detect_device, resolve_dtype

    # The machine as detected (or as MINEDRAFT_CPU_FAST_BF16 forces it: `make test-other-cpu`), then both kinds.
    for device in (detect_device(), DeviceInfo(cpu_fast_bf16=False), DeviceInfo(cpu_fast_bf16=True)):
        if device.has_gpu:
            continue
        effective = resolve_dtype("auto", device, "bfloat16")
        assert effective == "float32"
        note = dtype_note("auto", effective, device)
        assert note.startswith("float32 on CPUs") and ("fast bfloat16" in note) == device.cpu_fast_bf16
    assert dtype_note("bfloat16", "bfloat16", DeviceInfo()) == "as chosen"
    assert "own dtype" in dtype_note("auto", "bfloat16", DeviceInfo(visible_gpus=("0",)))


def rounds(mode, k, concurrency, samples):
    from minedraft.doctor import _median

    return {"mode": mode, "k": k, "concurrency": concurrency, "samples": list(samples),
            "tokens_per_second": _median(list(samples))}


def test_the_issue_case_idle_decides_and_busy_is_undecided_not_opposite():
    from minedraft.doctor import verdict

    # Idle (the issue's second run, at 16 requests): ar ahead in every round, tightly.
    idle = verdict([rounds("ar", 0, 16, (3537, 3512, 3561)), rounds("sd", 3, 16, (2400, 2390, 2420)),
                    rounds("psd", 5, 16, (2525, 2510, 2540))])
    assert idle["decision"] == "no" and idle["per_load"][0]["decision"] == "ar"
    # Busy: one round caught ar and sd under a burst of background load (the single-shot doctor's 4.25x sd);
    # round by round, psd and ar swap places: undecided, never "PSD pays".
    busy = verdict([rounds("ar", 0, 16, (3300, 290, 3400)), rounds("sd", 3, 16, (2300, 600, 2250)),
                    rounds("psd", 5, 16, (2400, 2550, 2380))])
    assert busy["decision"] == "undecided" and not busy["psd_pays"]
    assert "undecided at 16 requests" in busy["summary"]


def test_a_clear_difference_survives_a_moderate_spread_and_a_spread_beyond_it_does_not():
    from minedraft.doctor import verdict

    clear = verdict([rounds("ar", 0, 64, (1000, 1050, 980)), rounds("psd", 3, 64, (1300, 1400, 1290))])
    assert clear["psd_pays"] and clear["per_load"][0]["ratio_median"] == round(1290 / 980, 3)  # round by round
    # Every round favours psd, but by 3-40%: the spread (0.37) exceeds the median difference (0.05).
    noisy = verdict([rounds("ar", 0, 64, (1000, 1000, 1000)), rounds("psd", 3, 64, (1030, 1050, 1400))])
    assert noisy["decision"] == "undecided"


def test_busy_runs_never_reverse_an_idle_verdict_on_synthetic_spreads():
    """Idle: 3 rounds within +-2% of each mode's true rate. Busy: each run slowed by a random factor in [0.3, 1]
    (contention only slows), drawn per run. Over many seeded cases with true psd/ar ratios of 0.6-1.6, whatever idle
    decides, busy says the same or undecided."""
    import random

    from minedraft.doctor import verdict

    rng = random.Random(7)
    reversed_, decided_busy = 0, 0
    for _ in range(400):
        truth_ar, ratio = 1000.0, rng.uniform(0.6, 1.6)

        def measured(rate, noise):
            return [rate * noise() for _ in range(3)]

        def idle_noise():
            return rng.uniform(0.98, 1.02)

        def busy_noise():
            return rng.uniform(0.3, 1.0)

        idle = verdict([rounds("ar", 0, 8, measured(truth_ar, idle_noise)),
                        rounds("psd", 3, 8, measured(truth_ar * ratio, idle_noise))])["decision"]
        busy = verdict([rounds("ar", 0, 8, measured(truth_ar, busy_noise)),
                        rounds("psd", 3, 8, measured(truth_ar * ratio, busy_noise))])["decision"]
        if busy != "undecided":
            decided_busy += 1
            reversed_ += idle != "undecided" and busy != idle
    assert reversed_ == 0
    assert decided_busy > 20  # busy runs are not simply always undecided


def test_measurement_interleaves_modes_round_by_round():
    from minedraft.doctor import measure_interleaved

    order = []

    def measure_one(mode, k, load):
        order.append((mode, k, load))
        return {"mode": mode, "k": k, "concurrency": load, "tokens_per_second": 100.0 + len(order)}

    runs = measure_interleaved(measure_one, [4], [("ar", 0), ("sd", 3), ("psd", 3)], repeats=3)
    assert order == [("ar", 0, 4), ("sd", 3, 4), ("psd", 3, 4), ("sd", 3, 4), ("psd", 3, 4), ("ar", 0, 4),
                     ("psd", 3, 4), ("ar", 0, 4), ("sd", 3, 4)]
    by_mode = {r["mode"]: r for r in runs}
    assert by_mode["ar"]["samples"] == [101.0, 106.0, 108.0] and by_mode["ar"]["tokens_per_second"] == 106.0


def test_a_busy_cpu_is_undecided_even_when_every_round_agrees():
    """The issue's busy run: every round favoured psd (two busy processes get more of a contended CPU than one),
    so no spread showed it; the load average taken after each run does."""
    from minedraft.doctor import contention, verdict

    runs = [rounds("ar", 0, 16, (29.0, 30.0, 28.0)), rounds("psd", 3, 16, (70.0, 75.0, 72.0))]
    for run in runs:
        run["load_average"] = [54.4, 40.1, 38.0]
    reason = contention(runs, cores=2)
    assert reason is not None and "load average up to 54.4 on 2 cores" in reason
    busy = verdict(runs, contended=reason)
    assert busy["decision"] == "undecided" and not busy["psd_pays"]
    assert busy["per_load"][0]["measured_decision"] == "psd" and busy["summary"].startswith("undecided: the machine")
    for run in runs:
        run["load_average"] = [2.1, 3.0, 2.8]  # the engine's own two processes on two cores: quiet
    assert contention(runs, cores=2) is None
    assert verdict(runs)["decision"] == "psd"
    assert contention([rounds("ar", 0, 4, (1.0,))], cores=2) is None  # no load recorded: nothing to say
