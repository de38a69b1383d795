"""A fake engine for the engine process's protocol tests: imported by the spawned engine process, so it lives in a
module of its own (a test module would be collected twice)."""

from __future__ import annotations

import os
import time
from typing import Any

from minedraft.engine.requests import OutputDelta, RequestError, SamplingSettings
from minedraft.engine.settings import DrafterSettings, EngineSettings, SettingsError

# A request with this many max_tokens is refused at admission, as vLLM refuses some requests only when added.
REFUSED_MAX_TOKENS = 13


def fake_settings() -> EngineSettings:
    return EngineSettings(model="fake-target", drafter=DrafterSettings(model="fake-draft"))


class FakeEngine:
    """Engine's surface the loop uses: one token per request per step (token i for the request's i-th step)."""

    vocab_size = 100
    max_model_len = 64
    startup_seconds = 0.25

    def __init__(self, settings: EngineSettings) -> None:
        self.settings = settings
        self.requests: dict[str, list[int]] = {}  # request id -> [tokens made, max_tokens]
        self.aborted: list[str] = []
        self.steps = 0
        self.step_sizes: list[int] = []

    def wait_for_drafter(self) -> bool:
        return True

    def add_request(self, request_id: str, prompt_token_ids: list[int], sampling: SamplingSettings,
                    detokenize: bool = True) -> None:
        if sampling.max_tokens == REFUSED_MAX_TOKENS:
            raise RequestError("max_tokens", "refused by the fake engine")
        self.requests[request_id] = [0, sampling.max_tokens]

    def abort(self, request_ids: list[str]) -> None:
        for request_id in request_ids:  # every abort received, the request still running or not
            self.requests.pop(request_id, None)
            self.aborted.append(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def step(self) -> list[OutputDelta]:
        self.steps += 1
        time.sleep(0.005)  # a step takes time: streams stay open long enough to be aborted or killed mid-way
        deltas = []
        for request_id, state in list(self.requests.items()):
            state[0] += 1
            finished = state[0] >= state[1]
            deltas.append(OutputDelta(request_id, [state[0]], f"t{state[0]}", "length" if finished else None,
                                      num_output_tokens=state[0]))
            if finished:
                del self.requests[request_id]
        self.step_sizes.append(len(deltas))
        return deltas

    def shutdown(self) -> None:
        pass


class ParrotEngine(FakeEngine):
    """Answers each request with its own prompt's token ids, two per step (as a speculative step accepts several),
    then "length"; no text: what an engine sends when asked not to detokenise."""

    vocab_size = 200_000
    max_model_len = 4096

    def __init__(self, settings: EngineSettings) -> None:
        super().__init__(settings)
        self.prompts: dict[str, list[int]] = {}
        self.detokenize: dict[str, bool] = {}

    def add_request(self, request_id: str, prompt_token_ids: list[int], sampling: SamplingSettings,
                    detokenize: bool = True) -> None:
        self.requests[request_id] = [0, len(prompt_token_ids)]
        self.prompts[request_id] = list(prompt_token_ids)
        self.detokenize[request_id] = detokenize

    def step(self) -> list[OutputDelta]:
        self.steps += 1
        deltas = []
        for request_id, state in list(self.requests.items()):
            tokens = self.prompts[request_id][state[0]:state[0] + 2]
            state[0] += len(tokens)
            finished = state[0] >= state[1]
            deltas.append(OutputDelta(request_id, tokens, "", "length" if finished else None,
                                      num_output_tokens=state[0]))
            if finished:
                del self.requests[request_id]
        return deltas


def detokenize_flags(engine: Any) -> dict[str, bool]:
    return dict(engine.detokenize)


def refusing_engine(settings: EngineSettings) -> Any:
    """A factory whose engine refuses its settings at startup (as Engine's checks or vLLM's do)."""
    raise SettingsError("max_model_len", "the fake engine refuses these settings")


def pid(engine: Any) -> int:
    return os.getpid()


def aborted(engine: Any) -> list[str]:
    return list(engine.aborted)


def in_flight(engine: Any) -> list[str]:
    return sorted(engine.requests)


def slow_pid(engine: Any) -> int:
    time.sleep(0.5)
    return os.getpid()


def steps(engine: Any) -> int:
    return int(engine.steps)
