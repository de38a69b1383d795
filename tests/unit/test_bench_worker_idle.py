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
