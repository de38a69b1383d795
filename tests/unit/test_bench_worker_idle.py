"""The step benchmark's worker-side timeline: when the target's worker is busy, and the idle gaps between steps."""

from __future__ import annotations

from minedraft.bench.steps import WorkerTimeline, idle_gaps


class FakeRunner:
    """vLLM 0.32's runner protocol: execute_model returns None when sample_tokens follows, else the step's output."""

    def __init__(self, clock) -> None:
        self.clock = clock

    def execute_model(self, scheduler_output):
        self.clock.now += 0.010  # the forward
        return None if scheduler_output == "decode" else "empty output"

    def sample_tokens(self, grammar_output):
        self.clock.now += 0.002
        return "sampled"


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_each_step_is_timed_from_execute_to_sampled_tokens_and_the_gaps_between_are_idle():
    clock = Clock()
    runner = FakeRunner(clock)
    timeline = WorkerTimeline(runner, clock)
    runner.execute_model("decode")
    assert runner.sample_tokens(None) == "sampled"
    clock.now += 0.005  # the engine's host work between steps: the worker waits
    assert runner.execute_model("nothing scheduled") == "empty output"  # a step without sampling ends here
    clock.now += 0.001
    runner.execute_model("decode")
    runner.sample_tokens(None)
    steps = timeline.take()
    assert [round(end - start, 6) for start, end in steps] == [0.012, 0.010, 0.012]
    assert timeline.take() == []
    gaps = idle_gaps(steps, None)
    assert [(round(idle, 6), round(busy, 6)) for idle, busy in gaps] == [(0.005, 0.010), (0.001, 0.012)]
    # Across engine steps the previous end carries over.
    assert [round(idle, 6) for idle, _ in idle_gaps(steps[2:], steps[1][1])] == [0.001]


def test_an_idle_gap_splits_into_waiting_for_drafts_and_host_work():
    from minedraft.bench.steps import idle_split

    # The wait for drafts inside the gap: 3 ms of a 5 ms gap waiting, 2 ms host work.
    assert tuple(round(x, 6) for x in idle_split((1.000, 1.005), (1.001, 1.004))) == (0.003, 0.002)
    # Async steps: the wait fell while the previous step computed (before the gap): all host work.
    assert tuple(round(x, 6) for x in idle_split((1.000, 1.001), (0.990, 0.999))) == (0.0, 0.001)
    # A wait running past the gap counts only inside it.
    assert tuple(round(x, 6) for x in idle_split((1.000, 1.002), (0.999, 1.010))) == (0.002, 0.0)


class ProbedRunner:
    """A model runner with the methods the step benchmark times (vLLM 0.32's names)."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def _update_states(self, scheduler_output):
        self.calls.append("states")

    def _prepare_inputs(self, scheduler_output):
        self.calls.append("inputs")

    def _model_forward(self):
        self.calls.append("forward")

    def execute_model(self, scheduler_output):
        self._update_states(scheduler_output)
        self._prepare_inputs(scheduler_output)
        self._model_forward()
        return None

    def sample_tokens(self, grammar_output):
        return "sampled"


class Wrapper:
    """vLLM's WorkerWrapperBase as a collective RPC's function receives it: attributes reach its worker."""

    def __init__(self, runner) -> None:
        self.model_runner = runner


def test_the_worker_probe_is_installed_once_and_hands_back_each_steps_span_and_runner_times():
    """What the benchmark runs in each worker through collective_rpc (in-process at TP = 1, in every rank's process
    at TP > 1): the worker's own timeline, read back per rank."""
    from minedraft.bench.steps import install_worker_probe, take_worker_probe

    runner = ProbedRunner()
    worker = Wrapper(runner)
    assert install_worker_probe(worker) and install_worker_probe(worker)  # a second install keeps the first probe
    for _ in range(3):
        runner.execute_model("decode")
        runner.sample_tokens(None)
    steps, details = take_worker_probe(worker)
    assert len(steps) == 3 and all(start <= end for start, end in steps)
    assert [sorted(d) for d in details] == [["forward", "runner_inputs", "runner_states"]] * 3
    # Wrapped once: each method ran once per step.
    assert runner.calls == ["states", "inputs", "forward"] * 3
    assert take_worker_probe(worker) == ([], [])


class Record:
    def __init__(self, prefill: int = 0, decode: int = 4) -> None:
        self.num_prefill_requests = prefill
        self.num_decode_requests = decode


def test_a_ranks_idle_share_is_the_median_gap_over_gap_plus_step_of_its_decode_steps():
    from minedraft.bench.steps import rank_idle_share

    # Prefill step, then decode steps of 10 ms after gaps of 1, 0 and 3 ms.
    steps = [(0.0, 0.050), (0.051, 0.061), (0.061, 0.071), (0.074, 0.084)]
    records = [Record(prefill=4, decode=0), Record(), Record(), Record()]
    share = rank_idle_share(steps, records)
    assert share is not None and abs(share - 0.001 / 0.011) < 1e-9
    assert rank_idle_share(steps[:3], records) is None  # unpaired: no figure rather than a wrong one


def test_the_handoff_is_the_part_of_a_gap_after_the_step_was_scheduled():
    from minedraft.bench.steps import handoff_part

    # Synchronous: the engine scheduled 2 ms into a 3 ms gap: 1 ms of handoff, the rest host work.
    assert round(handoff_part((1.000, 1.003), 1.002), 6) == 0.001
    # Scheduled ahead, before the gap began: the whole gap is handoff.
    assert round(handoff_part((1.000, 1.0005), 0.990), 6) == 0.0005
    # Scheduled after the worker started (cannot happen; clock noise): none.
    assert handoff_part((1.000, 1.001), 1.002) == 0.0
