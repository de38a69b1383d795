"""One settings object for an engine replica, validated once, passed explicitly everywhere."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field, replace
from enum import StrEnum
from typing import Any

from minedraft.engine.control.cost_model import DEFAULT_LOOKAHEAD_FANOUT


class Mode(StrEnum):
    """How the engine speculates.

    PSD: two sub-batches, drafting one while verifying the other (batch-parallel speculative decoding).
    SD: the same drafter process, draft-then-verify in sequence: the fair control for the overlap.
    AR: the target alone, no drafts.
    VLLM_SD: vLLM's built-in draft-model speculative decoding, the anchor.
    AUTO: psd, sd or ar and the draft length k, chosen as the engine runs from its measured costs (control/auto.py).
    LOOKAHEAD: every step verifies the whole batch while the drafter pre-drafts the next round for each request's
    likely outcomes (accepted length x bonus token, up to `lookahead_fanout` branches); the branch matching the real
    outcome is verified next (psd/lookahead.py).

    This enum is the configured mode (what was asked for, auto included). The engine's code keeps two other notions
    of mode apart by name: the chosen mode (psd, sd or ar: the fixed mode, or auto's latest `Decision`;
    `SpeculationCore.chosen_mode`, `Engine.current_mode`) and the step mode (what one step ran in: the chosen mode, or
    ar while the drafter is down; `PlannedStep.step_mode`, `StepRecord.mode`). Benchmark labels such as "psd-k4" name
    a (mode, k) setting.
    """

    PSD = "psd"
    SD = "sd"
    AR = "ar"
    VLLM_SD = "vllm-sd"
    AUTO = "auto"
    LOOKAHEAD = "lookahead"

    @property
    def uses_drafter(self) -> bool:
        return self in (Mode.PSD, Mode.SD, Mode.AUTO, Mode.LOOKAHEAD)

    @classmethod
    def parse(cls, value: str) -> Mode:
        try:
            return cls(value)
        except ValueError:
            allowed = ", ".join(m.value for m in cls)
            raise SettingsError("mode", f"unknown mode {value!r}; expected one of {allowed}") from None


class SettingsError(ValueError):
    """An invalid setting; `field_name` names the offending field so callers can report it precisely."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(f"{field_name}: {message}")
        self.field_name = field_name

    def __reduce__(self) -> tuple[Any, ...]:
        # Crosses the engine process's pipe intact (a startup refusal reaches `serve` as it is raised in-process).
        from minedraft.engine.requests import rebuild_error

        return rebuild_error, (type(self), self.args, self.__dict__)


MAX_NUM_SPECULATIVE_TOKENS = 16
DTYPES = ("auto", "bfloat16", "float16", "float32")
DRAFTER_BACKENDS = ("auto", "vllm", "torch")
MAX_TENSOR_PARALLEL_SIZE = 8
# Lookahead's default fan-out lives with the mode control (the lowest layer, which prices it): see cost_model.
MAX_LOOKAHEAD_FANOUT = 16
# --draft-length: "fixed" (k drafted and verified per request) or "adaptive" (each request's own length from its
# acceptance, each step's verify tokens capped at the verify curve's knee: psd/verify_budget.py).
DRAFT_LENGTHS = ("fixed", "adaptive")

# vLLM engine arguments that pass-through may not set: the engine sets them itself (a flag of ours exists), or they
# make vLLM call schedule() more than once per update_from_output() (pipeline parallelism and async scheduling keep a
# batch queue), which the PSD scheduler's per-step state cannot survive. Value: why, shown in the error.
OWNED_VLLM_ARGS = {
    "model": "--model",
    "dtype": "--dtype",
    "tensor_parallel_size": "--tensor-parallel-size",
    "gpu_memory_utilization": "--gpu-memory-utilization",
    "max_model_len": "--max-model-len",
    "max_num_seqs": "--max-num-seqs",
    "seed": "--seed",
    "speculative_config": "--mode and --num-speculative-tokens",
    "scheduler_cls": "--mode (the engine installs its own scheduler)",
    # vLLM would take it and nothing would use it: the APIs answer with `minedraft serve --served-model-name`.
    "served_model_name": "--served-model-name of minedraft serve",
}
BREAKS_ONE_SCHEDULE_ONE_UPDATE = {
    "pipeline_parallel_size": 1,
    "async_scheduling": False,
    "data_parallel_size": 1,
}
# drafter.hang_seconds: the drafter reports progress every 0.25 s while it works (protocol.PROGRESS_INTERVAL_SECONDS);
# a threshold near that would take a drafter between two reports for hung.
DEFAULT_HANG_SECONDS = 30.0
MIN_HANG_SECONDS = 1.0
# The longest draft `auto` mode considers unless max_num_speculative_tokens says otherwise.
AUTO_MAX_NUM_SPECULATIVE_TOKENS = 5


@dataclass(frozen=True)
class DrafterSettings:
    """The drafter process: its own device (CPU cores here, a GPU index on GPU machines)."""

    model: str
    cpu_cores: tuple[int, ...] = ()
    gpu_index: int | None = None
    kv_cache_gib: float = 1.0
    # The longest schedule() may block on a draft job before verifying without drafts; once step times are
    # measured the wait is a fraction of a step (planner.WaitPolicy) and this is only its cap. A late job is not a
    # hang (see hang_seconds).
    deadline_seconds: float = 5.0
    # Draft jobs failing in a row (the drafter naming no request to blame) before the drafter is restarted.
    max_missed_deadlines: int = 3
    # A drafter start-up that reaches no new stage (imported, downloading, weights, compiled) for this long is
    # restarted: judged by progress, not by the time since the spawn.
    startup_timeout_seconds: float = 300.0
    restart: bool = True
    # "vllm": the draft model in vLLM (any architecture; GPUs). "torch": a plain-torch Llama/Qwen3 drafter that
    # keeps each request's KV cache between jobs (no per-job admission cost: the faster choice on CPUs).
    # "auto": vllm on GPU machines, torch on CPUs (resolved by minedraft.engine.placement.resolve_for_device).
    backend: str = "auto"
    # Share of the drafter GPU's memory its vLLM may take (None: vLLM's default). GPU machines only.
    gpu_memory_utilization: float | None = None
    # A drafter that reports no progress (no finished step, no reply) this long while a job is outstanding is hung
    # and restarted in the background. A slow drafter keeps reporting progress and is never restarted for being
    # slow: a restart loses every request's drafter-side tokens and KV. Generous: a hang costs only drafts meanwhile.
    hang_seconds: float = DEFAULT_HANG_SECONDS
    # A shared drafter service ("HOST:PORT", `minedraft drafter`) instead of a drafter process of this engine's own;
    # None: the local drafter process. The service holds the draft model; token_file holds the shared token.
    address: str | None = None
    token_file: str | None = None
    # Torch backend: each draft step reads at most this many recent tokens' KV (plus a few attention-sink tokens);
    # 0: the whole context.
    window: int = 0
    # Committed tokens one draft job makes the drafter take in beyond each request's usual few (a newcomer's prompt,
    # whole contexts after a restart); the rest follows in chunks in later jobs while the request decodes without
    # drafts. Bounds how long one long prompt holds up its sub-batch's drafts, and a single prefill's length.
    catch_up_tokens_per_job: int = 2048


@dataclass(frozen=True)
class EngineSettings:
    model: str
    drafter: DrafterSettings
    mode: Mode = Mode.PSD
    # k: drafted tokens per request per verification.
    num_speculative_tokens: int = 3
    # e: extra drafted tokens per request; the scheduler keeps the C best positions of a sub-batch.
    num_extra_draft_tokens: int = 0
    # C per sub-batch = num_speculative_tokens * requests in it, unless set.
    draft_token_budget: int | None = None
    # Upper bound on k + e that can be switched to at run time (vLLM reserves verification slots for it).
    max_num_speculative_tokens: int | None = None
    # Lookahead: the most branches pre-drafted per request per round (the core may use fewer: see
    # DEFAULT_LOOKAHEAD_FANOUT).
    lookahead_fanout: int = DEFAULT_LOOKAHEAD_FANOUT
    # Lookahead: a request whose real outcome no branch matched is verified with the likeliest branch drafted for
    # the same accepted length (lossless like any proposal; free in a step padded to k) instead of without drafts.
    lookahead_backup_drafts: bool = True
    # Lookahead: where it pays by measured times (lookahead.refresh_pays), the missed requests are drafted from
    # their real context and the step waits for that draft instead of verifying them with a backup.
    lookahead_refresh_misses: bool = True
    max_num_seqs: int = 64
    # 0: the model's own context length, capped by what the KV cache holds (vLLM's auto-fit). A loaded engine's
    # settings carry the length vLLM chose.
    max_model_len: int = 0
    kv_cache_gib: float = 2.0
    target_cpu_cores: tuple[int, ...] = ()
    seed: int = 0
    # Target and drafter weights/activations. "auto": the target's own dtype on GPUs (bfloat16 for float32 models);
    # float32 on every CPU (resolved by minedraft.engine.placement.resolve_dtype before vLLM or a drafter sees it).
    dtype: str = "auto"
    # Target GPUs: tensor parallel over this many devices (target_gpus, default the first N visible ones).
    tensor_parallel_size: int = 1
    # Indices into the inherited CUDA_VISIBLE_DEVICES (or into all devices when it is unset); () = 0..TP-1.
    target_gpus: tuple[int, ...] = ()
    # Share of each target GPU's memory vLLM may take (None: vLLM's default).
    gpu_memory_utilization: float | None = None
    # Check sub-batch invariants on every step (tests turn it on; it costs a few microseconds per request).
    check_invariants: bool = False
    # Steps of per-step statistics kept in memory for readers (metrics, auto mode, tests).
    stats_history: int = 4096
    # Any other vLLM engine argument (EngineArgs field name -> value), validated by parse_vllm_args; arguments the
    # engine owns or that break its one-schedule-one-update cycle are refused (FORBIDDEN_VLLM_ARGS).
    extra_vllm_args: dict[str, Any] = field(default_factory=dict)
    # CPU machines: while nothing is drafted (ar, a down drafter) the target also computes on the drafter's cores.
    lend_drafter_cores: bool = True
    # Overrides of auto mode's policy settings (minedraft.engine.control.auto.AutoSettings field names).
    auto: dict[str, Any] = field(default_factory=dict)
    # Fixed modes: pad every verified decoding request's proposal to exactly k (any proposal is lossless), so a
    # decode step has one shape (1 + k query tokens each): the one vLLM captures full CUDA graphs for.
    pad_drafts_to_k: bool = True
    # sd, psd and auto's choices among them: "fixed" drafts and verifies k tokens per request; "adaptive" gives each
    # request its own draft length from its acceptance and caps a step's verify tokens at the verify curve's knee
    # (psd/verify_budget.py; such steps are not padded to k).
    draft_length: str = "fixed"
    # psd/sd/auto: the target's model runner keeps two persistent batches, so requests of the sub-batch not verified
    # in a step stay resident instead of being removed and re-added (a copy of their context) every other step.
    resident_sub_batches: bool = True
    # psd: schedule each step, and prepare its inputs, while the target still computes the previous one (the two
    # verify disjoint sub-batches, so nothing is speculative about it and nothing is rolled back); auto too while it
    # runs psd; at any tensor-parallel size. sd, ar and one-sided psd run synchronous steps whatever this says
    # (docs/architecture.md).
    async_psd_steps: bool = False
    # Seeded requests at temperature > 0 draw each token from randomness keyed by (seed, output position), so their
    # output does not depend on how many drafts were verified when (reproducible in every mode, identical across
    # modes); False leaves them to vLLM's per-request generator (minedraft/engine/vllm_adapter/keyed_sampling.py).
    reproducible_seeds: bool = True
    # Batch-invariant numerics: a request's logits do not depend on what else is in its batch, so greedy output (and
    # seeded output) is token-identical across modes and loads. GPUs: vLLM's batch-invariant mode
    # (VLLM_BATCH_INVARIANT=1: its own matmul, reduction and attention kernels; slower). CPUs: float32 already is
    # (resolve_for_device refuses it with a 16-bit dtype there, whose kernels are not).
    deterministic: bool = False

    def __post_init__(self) -> None:
        validate(self)

    def with_changes(self, **changes: Any) -> EngineSettings:
        return replace(self, **changes)

    @property
    def max_draft_tokens_per_request(self) -> int:
        auto = self.mode is Mode.AUTO and not self.max_num_speculative_tokens
        auto_floor = AUTO_MAX_NUM_SPECULATIVE_TOKENS if auto else 0
        return max(self.num_speculative_tokens + self.num_extra_draft_tokens, self.max_num_speculative_tokens or 0,
                   auto_floor)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["mode"] = self.mode.value
        return data


@dataclass(frozen=True)
class SchedulerSettings:
    """What the speculation core (psd/core.py) and its vLLM host (vllm_adapter/scheduler.py) need of the engine's
    settings: one frozen object built once from EngineSettings (`from_engine`) and passed whole. It crosses vLLM's
    `additional_config` as its `to_config()` dict and is rebuilt whole on the other side (`from_config`)."""

    mode: Mode = Mode.PSD
    num_speculative_tokens: int = 3
    # k + e can be switched up to this at run time (vLLM reserves verification slots for it).
    max_num_speculative_tokens: int = 3
    num_extra_draft_tokens: int = 0
    draft_token_budget: int | None = None
    pad_drafts_to_k: bool = True
    # "fixed" or "adaptive" (EngineSettings.draft_length).
    draft_length: str = "fixed"
    # Lookahead: the most branches pre-drafted per request per round; a miss verified with the likeliest branch of
    # its accepted length (a backup) rather than without drafts.
    lookahead_fanout: int = DEFAULT_LOOKAHEAD_FANOUT
    lookahead_backup_drafts: bool = True
    # (Off here, so the twin, which builds these settings itself, keeps verifying misses at once; the engine's
    # EngineSettings turns it on.)
    lookahead_refresh_misses: bool = False
    catch_up_tokens_per_job: int = 2048
    # The cap on a step's wait for drafts (DrafterSettings.deadline_seconds).
    deadline_seconds: float = 5.0
    max_missed_deadlines: int = 3
    hang_seconds: float = DEFAULT_HANG_SECONDS
    check_invariants: bool = False
    stats_history: int = 4096
    # Overrides of auto's AutoSettings fields.
    auto: dict[str, Any] = field(default_factory=dict)
    async_steps: bool = False
    resident_sub_batches: bool = True
    target_cpu_cores: tuple[int, ...] = ()
    # The drafter's cores the target may compute on while nothing is drafted (one in-process CPU worker only).
    lend_cpu_cores: tuple[int, ...] = ()
    # The local drafter process's settings (None: no drafter of the scheduler's own); with `drafter_prestarted` the
    # engine started it during model loading and attaches it.
    drafter: dict[str, Any] | None = None
    drafter_prestarted: bool = False
    drafter_restart: bool = True
    drafter_startup_timeout_seconds: float = 300.0

    @classmethod
    def from_engine(cls, settings: EngineSettings, *, drafter: dict[str, Any] | None, async_steps: bool,
                    lend_cpu_cores: tuple[int, ...], drafter_prestarted: bool = True) -> SchedulerSettings:
        return cls(
            mode=settings.mode,
            num_speculative_tokens=settings.num_speculative_tokens,
            max_num_speculative_tokens=settings.max_draft_tokens_per_request,
            num_extra_draft_tokens=settings.num_extra_draft_tokens,
            draft_token_budget=settings.draft_token_budget,
            pad_drafts_to_k=settings.pad_drafts_to_k,
            draft_length=settings.draft_length,
            lookahead_fanout=settings.lookahead_fanout,
            lookahead_backup_drafts=settings.lookahead_backup_drafts,
            lookahead_refresh_misses=settings.lookahead_refresh_misses,
            catch_up_tokens_per_job=settings.drafter.catch_up_tokens_per_job,
            deadline_seconds=settings.drafter.deadline_seconds,
            max_missed_deadlines=settings.drafter.max_missed_deadlines,
            hang_seconds=settings.drafter.hang_seconds,
            check_invariants=settings.check_invariants,
            stats_history=settings.stats_history,
            auto=dict(settings.auto),
            async_steps=async_steps,
            resident_sub_batches=settings.resident_sub_batches,
            target_cpu_cores=settings.target_cpu_cores,
            lend_cpu_cores=lend_cpu_cores,
            drafter=drafter,
            drafter_prestarted=drafter_prestarted,
            drafter_restart=settings.drafter.restart,
            drafter_startup_timeout_seconds=settings.drafter.startup_timeout_seconds,
        )

    def to_config(self) -> dict[str, Any]:
        """Plain JSON-able data (vLLM hashes its additional_config as JSON)."""
        data = asdict(self)
        data["mode"] = self.mode.value
        return data

    @classmethod
    def from_config(cls, data: dict[str, Any]) -> SchedulerSettings:
        return replace(cls(**data), mode=Mode(data["mode"]), target_cpu_cores=tuple(data["target_cpu_cores"]),
                       lend_cpu_cores=tuple(data["lend_cpu_cores"]))


def validate(settings: EngineSettings) -> None:
    if not isinstance(settings.mode, Mode):
        raise SettingsError("mode", f"expected a Mode, got {settings.mode!r}")
    if not 1 <= settings.num_speculative_tokens <= MAX_NUM_SPECULATIVE_TOKENS:
        raise SettingsError(
            "num_speculative_tokens",
            f"must be between 1 and {MAX_NUM_SPECULATIVE_TOKENS}, got {settings.num_speculative_tokens}",
        )
    if not 1 <= settings.lookahead_fanout <= MAX_LOOKAHEAD_FANOUT:
        raise SettingsError("lookahead_fanout",
                            f"must be between 1 and {MAX_LOOKAHEAD_FANOUT}, got {settings.lookahead_fanout}")
    if settings.mode is Mode.LOOKAHEAD and settings.num_extra_draft_tokens:
        raise SettingsError("num_extra_draft_tokens", "lookahead drafts exactly k tokens per branch (no extra drafts)")
    if not 0 <= settings.num_extra_draft_tokens <= MAX_NUM_SPECULATIVE_TOKENS - settings.num_speculative_tokens:
        raise SettingsError(
            "num_extra_draft_tokens",
            f"must be between 0 and {MAX_NUM_SPECULATIVE_TOKENS - settings.num_speculative_tokens} "
            f"(k + e <= {MAX_NUM_SPECULATIVE_TOKENS}), got {settings.num_extra_draft_tokens}",
        )
    if settings.max_num_speculative_tokens is not None and not (
        settings.num_speculative_tokens + settings.num_extra_draft_tokens
        <= settings.max_num_speculative_tokens
        <= MAX_NUM_SPECULATIVE_TOKENS
    ):
        raise SettingsError(
            "max_num_speculative_tokens",
            f"must be between k + e and {MAX_NUM_SPECULATIVE_TOKENS}, got {settings.max_num_speculative_tokens}",
        )
    if settings.draft_length not in DRAFT_LENGTHS:
        raise SettingsError("draft_length",
                            f"expected one of {', '.join(DRAFT_LENGTHS)}, got {settings.draft_length!r}")
    if settings.draft_length == "adaptive" and settings.mode in (Mode.AR, Mode.VLLM_SD, Mode.LOOKAHEAD):
        # Refused rather than ignored: a user asking for it in these modes would otherwise believe it ran.
        raise SettingsError("draft_length", f"adaptive draft lengths apply to modes sd, psd and auto (when it runs "
                            f"sd or psd), not {settings.mode}")
    if settings.draft_length == "adaptive" and settings.num_extra_draft_tokens:
        raise SettingsError("num_extra_draft_tokens", "adaptive draft lengths choose each request's own length "
                            "(no extra drafts)")
    if settings.draft_token_budget is not None and settings.draft_token_budget < 1:
        raise SettingsError("draft_token_budget", f"must be positive, got {settings.draft_token_budget}")
    if settings.max_num_seqs < 1:
        raise SettingsError("max_num_seqs", f"must be positive, got {settings.max_num_seqs}")
    if settings.kv_cache_gib <= 0:
        raise SettingsError("kv_cache_gib", f"must be positive, got {settings.kv_cache_gib}")
    if settings.drafter.backend not in DRAFTER_BACKENDS:
        raise SettingsError("drafter.backend", f"expected one of {', '.join(DRAFTER_BACKENDS)}, "
                            f"got {settings.drafter.backend!r}")
    if settings.max_model_len not in (0, -1) and settings.max_model_len < 16:
        raise SettingsError("max_model_len", f"must be at least 16 (or unset: the model's own), "
                            f"got {settings.max_model_len}")
    if settings.dtype not in DTYPES:
        raise SettingsError("dtype", f"expected one of {', '.join(DTYPES)}, got {settings.dtype!r}")
    if not 1 <= settings.tensor_parallel_size <= MAX_TENSOR_PARALLEL_SIZE:
        raise SettingsError("tensor_parallel_size", f"must be between 1 and {MAX_TENSOR_PARALLEL_SIZE}, "
                            f"got {settings.tensor_parallel_size}")
    if settings.target_gpus:
        if len(settings.target_gpus) != settings.tensor_parallel_size:
            raise SettingsError("target_gpus", f"{len(settings.target_gpus)} GPUs given for tensor parallel size "
                                f"{settings.tensor_parallel_size}: give exactly one per tensor-parallel rank")
        if len(set(settings.target_gpus)) != len(settings.target_gpus) or min(settings.target_gpus) < 0:
            raise SettingsError("target_gpus", f"must be distinct non-negative indices, got {settings.target_gpus}")
    for name, value in (("gpu_memory_utilization", settings.gpu_memory_utilization),
                        ("drafter.gpu_memory_utilization", settings.drafter.gpu_memory_utilization)):
        if value is not None and not 0.0 < value <= 1.0:
            raise SettingsError(name, f"must be within (0, 1], got {value}")
    gpu = settings.drafter.gpu_index
    if gpu is not None and settings.mode.uses_drafter:
        if gpu < 0:
            raise SettingsError("drafter.gpu_index", f"must be a non-negative device index, got {gpu}")
        if settings.drafter.backend == "torch":
            raise SettingsError("drafter.backend", "the torch drafter runs on CPUs only; a drafter GPU needs the "
                                "vllm backend (--drafter-backend vllm)")
        # Without target GPUs given, the target takes the first ones that are not the drafter's (plan_devices).
        if gpu in settings.target_gpus:
            raise SettingsError("drafter.gpu_index", f"GPU {gpu} is one of the target's {list(settings.target_gpus)}: "
                                "the drafter needs a device of its own")
    validate_vllm_args(settings.extra_vllm_args)
    _validate_remote_drafter(settings.drafter)
    if settings.drafter.deadline_seconds <= 0:
        raise SettingsError("drafter.deadline_seconds", "must be positive")
    if not settings.drafter.hang_seconds >= MIN_HANG_SECONDS:
        raise SettingsError("drafter.hang_seconds", f"must be at least {MIN_HANG_SECONDS:g} s (the drafter reports "
                            f"progress every 0.25 s while it works), got {settings.drafter.hang_seconds}")
    if settings.drafter.catch_up_tokens_per_job < 1:
        raise SettingsError("drafter.catch_up_tokens_per_job",
                            f"must be at least 1, got {settings.drafter.catch_up_tokens_per_job}")
    if settings.mode is Mode.VLLM_SD and settings.num_extra_draft_tokens:
        raise SettingsError("num_extra_draft_tokens", "extra drafts need the minedraft drafter (psd or sd)")
    if not settings.model:
        raise SettingsError("model", "a target model path or id is required")
    if settings.auto:
        from minedraft.engine.control.auto import AutoSettings

        try:
            auto = AutoSettings(**settings.auto)
        except (TypeError, ValueError) as exc:
            raise SettingsError("auto", str(exc)) from None
        if "k_candidates" in settings.auto and max(auto.k_candidates) > settings.max_draft_tokens_per_request:
            raise SettingsError("auto.k_candidates", f"at most {settings.max_draft_tokens_per_request} (the engine's "
                                f"longest draft, max_num_speculative_tokens), got {auto.k_candidates}")
    if settings.mode is not Mode.AR and not settings.drafter.model:
        raise SettingsError("drafter.model", f"mode {settings.mode.value} needs a draft model")


def parse_address(address: str) -> tuple[str, int]:
    """"HOST:PORT" -> (host, port); ValueError naming what is wrong."""
    host, sep, port_text = address.rpartition(":")
    if not sep or not host:
        raise ValueError(f"expected HOST:PORT, got {address!r}")
    try:
        port = int(port_text)
    except ValueError:
        raise ValueError(f"port must be a number, got {port_text!r}") from None
    if not 1 <= port <= 65535:
        raise ValueError(f"port must be within 1..65535, got {port}")
    return host.strip("[]"), port


def _validate_remote_drafter(drafter: DrafterSettings) -> None:
    if drafter.window < 0:
        raise SettingsError("drafter.window", f"must be 0 (the whole context) or positive, got {drafter.window}")
    if drafter.window and drafter.backend == "vllm" and drafter.address is None:
        raise SettingsError("drafter.window", "the drafter window is the torch backend's (--drafter-backend torch): "
                            "vLLM's sliding window keeps no attention-sink tokens and is not applied to Qwen3 models")
    if drafter.address is None:
        return
    try:
        parse_address(drafter.address)
    except ValueError as exc:
        raise SettingsError("drafter.address", str(exc)) from None
    if not drafter.token_file:
        raise SettingsError("drafter.token_file", "a drafter service needs the shared token (--drafter-token-file): "
                            "engines and service authenticate each other")


def validate_vllm_args(args: dict[str, Any]) -> None:
    """Refuse pass-through arguments the engine owns or that break its one-schedule-one-update cycle."""
    for name, value in args.items():
        if name in OWNED_VLLM_ARGS:
            raise SettingsError(f"vllm_args.{name}", f"set by the engine; use {OWNED_VLLM_ARGS[name]}")
        if name in BREAKS_ONE_SCHEDULE_ONE_UPDATE and value not in (None, BREAKS_ONE_SCHEDULE_ONE_UPDATE[name]):
            allowed = BREAKS_ONE_SCHEDULE_ONE_UPDATE[name]
            raise SettingsError(f"vllm_args.{name}", f"{value!r} is not supported: it makes vLLM schedule several "
                                "batches before the first one's update (a batch queue), which the speculative "
                                f"scheduler's per-step state cannot follow; only {allowed!r}")
        if name == "logprobs_mode" and value not in (None, "raw_logprobs"):
            # The APIs send these as the target's log-probabilities, and reproducible seeds rewrite the processed
            # logits of seeded requests (engine/vllm_adapter/keyed_sampling.py).
            raise SettingsError(f"vllm_args.{name}", f"{value!r} is not supported: the engine returns the target's raw "
                                "log-probabilities ('raw_logprobs')")


def parse_vllm_args(argv: list[str]) -> dict[str, Any]:
    """vLLM engine arguments given as vLLM's own command line (["--enable-prefix-caching", "--max-num-batched-tokens=
    8192"]) -> {EngineArgs field: value}, only those given. vLLM's own parser checks names and values, so a typo is an
    error here, not a silently ignored setting."""
    if not argv:
        return {}
    import argparse

    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    class _Parser(FlexibleArgumentParser):
        def error(self, message: str) -> Any:  # argparse would print usage and exit the process
            raise SettingsError("vllm_args", message)

    parser = _Parser(prog="vllm engine arguments", exit_on_error=False, add_help=False)
    EngineArgs.add_cli_args(parser)
    for action in parser._actions:  # only what was given comes back
        action.default = argparse.SUPPRESS
    try:
        parsed = vars(parser.parse_args(list(argv)))
    except argparse.ArgumentError as exc:
        raise SettingsError("vllm_args", str(exc).splitlines()[0]) from None
    validate_vllm_args(parsed)
    return parsed


def default_core_split() -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Target on the first half of the cores this process may use, drafter on the rest (at least one each)."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        return tuple(cores), tuple(cores)
    half = max(1, len(cores) // 2)
    return tuple(cores[:half]), tuple(cores[half:])
