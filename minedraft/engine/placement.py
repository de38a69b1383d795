"""Where the engine computes: which GPUs the target and the drafter see, and which CPU cores the target uses.

GPUs: plan_devices maps the target and the drafter onto the devices this process inherited. resolve_for_device turns
"auto" choices (dtype, drafter backend) into concrete ones for the machine.

CPU cores: the target computes on its own cores, plus the drafter's while nothing is being drafted.

On a CPU machine the drafter's cores sit idle whenever the engine runs without drafts (auto mode chose ar, or the
drafter is down). The target then widens onto them (more threads, the step thread's affinity widened so the extra
OpenMP worker may run there) and narrows back before drafting resumes, so drafting never competes with it. On GPU
machines the drafter has a device of its own and nothing is lent.

Both the affinity and OpenMP's thread count belong to the calling thread, so the engine's step thread makes these
calls, between steps.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from minedraft.engine.psd.planner import should_widen as should_widen  # (the policy is the core's; re-exported)
from minedraft.engine.settings import EngineSettings, SettingsError

log = logging.getLogger(__name__)


class ComputePlacement:
    def __init__(self, target_cores: tuple[int, ...], lend_cores: tuple[int, ...]) -> None:
        self.target_cores = tuple(target_cores)
        self.wide_cores = tuple(dict.fromkeys([*target_cores, *lend_cores]))
        self.wide: bool | None = None
        self.num_threads = 0

    @property
    def can_widen(self) -> bool:
        return bool(self.target_cores) and len(self.wide_cores) > len(self.target_cores)

    def apply(self, wide: bool) -> None:
        """Idempotent; cheap enough (two syscalls) to call once per step when the mode changes."""
        if not self.target_cores or wide == self.wide:
            return
        import torch

        cores = self.wide_cores if wide and self.can_widen else self.target_cores
        try:
            os.sched_setaffinity(0, cores)
        except OSError as exc:  # a core outside this process's allowed set: keep computing where we are
            log.warning("cannot bind the step thread to cores %s: %s", cores, exc)
            return
        # vLLM's CPU worker replaces torch.set_num_threads with a no-op once it has bound its threads; the
        # underlying call still works and is what we mean.
        torch._C.set_num_threads(len(cores))
        self.wide = wide
        # Read back on this thread: OpenMP keeps the thread count per thread, and this is the one that computes.
        self.num_threads = torch.get_num_threads()


# -- devices -------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DeviceInfo:
    """What this machine offers the engine, detected once (detect_device) or given in tests."""

    # The device identifiers this process may use: the inherited CUDA_VISIBLE_DEVICES entries (indices or UUIDs), or
    # "0".."N-1" when it is unset. Empty on a CPU machine.
    visible_gpus: tuple[str, ...] = ()
    # The CPU computes bfloat16 at full speed (AVX-512 BF16 or AMX); without it bf16 runs several times slower.
    # Reported (doctor), never a reason to leave float32 on its own: see resolve_dtype.
    cpu_fast_bf16: bool = False

    @property
    def has_gpu(self) -> bool:
        return bool(self.visible_gpus)


@dataclass(frozen=True)
class DevicePlan:
    """CUDA_VISIBLE_DEVICES for the target process (its workers inherit it) and for the drafter; None: CPU."""

    target_visible_devices: str | None = None
    drafter_visible_devices: str | None = None
    # Indices into DeviceInfo.visible_gpus, for messages and reports.
    target_indices: tuple[int, ...] = ()
    drafter_index: int | None = None


# "1"/"0" overrides what /proc/cpuinfo says about fast bf16, so the suite can run as if on the other kind of CPU
# (AVX2-only vs AVX-512 BF16/AMX) wherever it runs.
CPU_FAST_BF16_ENV = "MINEDRAFT_CPU_FAST_BF16"


def _cpu_has_fast_bf16(environ: Mapping[str, str]) -> bool:
    forced = environ.get(CPU_FAST_BF16_ENV, "").strip()
    if forced in ("0", "1"):
        return forced == "1"
    if forced:
        raise SettingsError(CPU_FAST_BF16_ENV, f"expected 0 or 1, got {forced!r}")
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


# Where an engine records the device list this process inherited before narrowing CUDA_VISIBLE_DEVICES to the
# target's, so a later engine in the same process (tests, doctor) still indexes into what the pod was given.
INHERITED_DEVICES_ENV = "MINEDRAFT_INHERITED_CUDA_VISIBLE_DEVICES"


def narrow_visible_devices(environ: dict[str, str] | Any, target_visible_devices: str) -> None:
    """Let this process (and the workers it spawns) see only the target's GPUs, remembering the inherited list."""
    if INHERITED_DEVICES_ENV not in environ:
        environ[INHERITED_DEVICES_ENV] = environ.get("CUDA_VISIBLE_DEVICES", "")
    environ["CUDA_VISIBLE_DEVICES"] = target_visible_devices


def detect_device(environ: Mapping[str, str] | None = None) -> DeviceInfo:
    """Visible GPUs without initialising CUDA in this process (NVML count), so CUDA_VISIBLE_DEVICES can still be
    narrowed for the target afterwards."""
    env = os.environ if environ is None else environ
    inherited = env.get(INHERITED_DEVICES_ENV, env.get("CUDA_VISIBLE_DEVICES"))
    if INHERITED_DEVICES_ENV in env and inherited:
        # Narrowed by an earlier engine in this process: the recorded list is what this process was given.
        return DeviceInfo(visible_gpus=tuple(d.strip() for d in inherited.split(",") if d.strip()),
                          cpu_fast_bf16=_cpu_has_fast_bf16(env))
    count = 0
    try:
        import torch

        # device_count() asks NVML and leaves CUDA uninitialised (is_available() would call cuInit, after which this
        # process's CUDA_VISIBLE_DEVICES can no longer be narrowed for the target); it reads CUDA_VISIBLE_DEVICES.
        count = torch.cuda.device_count()
    except Exception:  # a broken driver reads as no GPU: the CPU path then says so clearly
        log.warning("could not count GPUs", exc_info=True)
    if inherited is not None and inherited.strip() != "":
        visible = tuple(d.strip() for d in inherited.split(",") if d.strip())[:count] if count else ()
    else:
        visible = tuple(str(i) for i in range(count))
    return DeviceInfo(visible_gpus=visible, cpu_fast_bf16=_cpu_has_fast_bf16(env))


def plan_devices(settings: EngineSettings, device: DeviceInfo) -> DevicePlan:
    """Which of the visible GPUs the target and the drafter each see. Pure.

    Indices (settings.target_gpus, drafter.gpu_index) index the inherited device list, so a pod given GPUs "4,5,6,7,8"
    with target GPUs 0-3 and drafter GPU 4 runs the target on 4-7 and the drafter on 8; nothing is overwritten with
    a physical number the pod was not given.
    """
    tp = settings.tensor_parallel_size
    drafter_gpu = settings.drafter.gpu_index
    drafter_on_gpu = settings.mode.uses_drafter and settings.drafter.backend != "torch"
    if not device.has_gpu:
        if settings.target_gpus:
            raise SettingsError("target_gpus", "no GPU is visible to this process (CUDA_VISIBLE_DEVICES or driver)")
        if drafter_gpu is not None and settings.mode.uses_drafter:
            raise SettingsError("drafter.gpu_index", "no GPU is visible to this process (CUDA_VISIBLE_DEVICES or "
                                "driver); leave the drafter GPU unset to draft on the CPU")
        return DevicePlan()
    visible = device.visible_gpus
    described = f"{len(visible)} visible ({','.join(visible)})"
    target = settings.target_gpus or tuple(i for i in range(len(visible)) if i != drafter_gpu)[:tp]
    if len(target) < tp or max(target) >= len(visible):
        raise SettingsError("target_gpus", f"tensor parallel size {tp} needs GPUs {list(target) or 'none'} of "
                            f"{described}")
    drafter_index: int | None = None
    if drafter_on_gpu:
        if drafter_gpu is None:
            free = [i for i in range(len(visible)) if i not in target]
            if not free:
                raise SettingsError("drafter.gpu_index", f"no GPU left for the drafter: {described}, the target uses "
                                    f"{list(target)}; give the pod one more GPU (the drafter needs its own)")
            drafter_index = free[0]
        else:
            drafter_index = drafter_gpu
        if drafter_index in target:
            raise SettingsError("drafter.gpu_index", f"GPU {drafter_index} is one of the target's {list(target)}: "
                                "the drafter needs a device of its own")
        if drafter_index >= len(visible):
            raise SettingsError("drafter.gpu_index", f"GPU {drafter_index} does not exist: {described}")
    return DevicePlan(
        target_visible_devices=",".join(visible[i] for i in target),
        drafter_visible_devices=None if drafter_index is None else visible[drafter_index],
        target_indices=tuple(target),
        drafter_index=drafter_index,
    )


def cpu_thread_binding(target_cores: tuple[int, ...], tensor_parallel_size: int, all_cores: tuple[int, ...]) -> str:
    """vLLM's VLLM_CPU_OMP_THREADS_BIND for CPU tensor parallelism: one "|"-separated core list per rank. The
    target's cores are split among the ranks; with fewer target cores than ranks, all this process's cores are. Pure."""
    cores = target_cores if len(target_cores) >= tensor_parallel_size else all_cores
    if len(cores) < tensor_parallel_size:
        raise SettingsError("tensor_parallel_size", f"{tensor_parallel_size} CPU ranks need at least as many cores; "
                            f"this process may use {list(all_cores)}")
    per_rank = len(cores) // tensor_parallel_size
    return "|".join(",".join(str(c) for c in cores[r * per_rank:(r + 1) * per_rank])
                    for r in range(tensor_parallel_size))


def resolve_dtype(requested: str, device: DeviceInfo, model_dtype: str | None) -> str:
    """The concrete dtype both the target and the drafter load in. Pure.

    An explicit choice stands. "auto" on any CPU is float32, with or without fast bf16: in bf16 the verifier's
    (k+1)-token passes and plain decoding round differently, greedy choices then depend on batch composition, and
    temperature-0 output is no longer token-identical to the target alone (vLLM's own "auto" would load a float32
    model in bf16 on every x86 CPU). "auto" on GPUs is the target's own dtype from its config, with float32 models
    served in bfloat16 as vLLM's "auto" does there (its GPU kernels assume a 16-bit dtype).
    """
    if requested != "auto":
        return requested
    if not device.has_gpu:
        return "float32"
    own = (model_dtype or "").replace("torch.", "")
    return own if own in ("bfloat16", "float16") else "bfloat16"


def model_config_dtype(model: str) -> str | None:
    """The dtype a model's config declares ("bfloat16", ...), or None when it declares none or cannot be read."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(model)
    except (OSError, ValueError):
        return None  # the pair check that follows reports an unreadable config by name
    text = getattr(config, "text_config", None) or config
    own = getattr(text, "dtype", None) or getattr(text, "torch_dtype", None) or getattr(config, "torch_dtype", None)
    return str(own).replace("torch.", "") if own is not None else None


def resolve_for_device(settings: EngineSettings, device: DeviceInfo, model_dtype: str | None = None
                       ) -> EngineSettings:
    """Turn the "auto" choices into concrete ones for this machine. Pure.

    One default drafter backend everywhere: vLLM on GPUs (its kernels and batching), the plain-torch drafter on CPUs
    (no per-job admission cost). dtype: resolve_dtype, with model_dtype the target's config dtype (only read on
    GPUs; see resolved_settings). Nothing downstream (vLLM, the drafter process) ever sees "auto".
    """
    backend = settings.drafter.backend
    if backend == "auto":
        backend = "vllm" if device.has_gpu else "torch"
    dtype = resolve_dtype(settings.dtype, device, model_dtype)
    if settings.deterministic and not device.has_gpu and dtype != "float32":
        raise SettingsError("deterministic", f"on a CPU only float32 is batch-invariant (vLLM's batch-invariant "
                            f"kernels are GPU-only); --dtype {dtype} makes a request's logits depend on its batch: use "
                            f"--dtype float32 (or auto) with --deterministic")
    return settings.with_changes(dtype=dtype, drafter=replace(settings.drafter, backend=backend))


def resolved_settings(settings: EngineSettings, device: DeviceInfo) -> EngineSettings:
    """resolve_for_device, reading the target's config dtype when the choice depends on it (auto on a GPU)."""
    model_dtype = model_config_dtype(settings.model) if settings.dtype == "auto" and device.has_gpu else None
    return resolve_for_device(settings, device, model_dtype)


# -- the model pair --------------------------------------------------------------------------------------------------

def check_model_pair(target: str, draft: str, drafter_backend: str) -> dict[str, Any]:
    """Before anything loads: the draft's token ids must mean the target's tokens, and the torch drafter must
    implement the draft's architecture. Reads only configs and tokenizers (seconds, not a model load)."""
    from transformers import AutoConfig, AutoTokenizer

    try:
        target_config = AutoConfig.from_pretrained(target)
        draft_config = AutoConfig.from_pretrained(draft)
    except (OSError, ValueError) as exc:
        raise SettingsError("model", f"cannot read the model configs: {exc}") from None
    target_vocab = _vocab_size(target_config)
    draft_vocab = _vocab_size(draft_config)
    draft_type = str(getattr(draft_config, "model_type", ""))
    if drafter_backend == "torch":
        from minedraft.engine.drafter.torch_backend import ARCHITECTURES

        if draft_type not in ARCHITECTURES:
            raise SettingsError("drafter.backend", f"the torch drafter implements {', '.join(ARCHITECTURES)}, not "
                                f"{draft_type!r} ({draft}); use --drafter-backend vllm")
    # A draft id at or past the target's vocabulary is a device-side assert on a GPU.
    if draft_vocab > target_vocab:
        raise SettingsError("drafter.model", f"the draft's vocabulary ({draft_vocab}) is larger than the target's "
                            f"({target_vocab}): its token ids would not be the target's")
    try:
        target_tokens = AutoTokenizer.from_pretrained(target).get_vocab()
        draft_tokens = AutoTokenizer.from_pretrained(draft).get_vocab()
    except (OSError, ValueError) as exc:
        raise SettingsError("drafter.model", f"cannot read the tokenizers to compare vocabularies: {exc}") from None
    if target_tokens != draft_tokens:
        differing = sum(1 for t, i in draft_tokens.items() if target_tokens.get(t) != i)
        raise SettingsError("drafter.model", f"the draft's tokenizer differs from the target's ({differing} of "
                            f"{len(draft_tokens)} tokens map to other ids): the draft must share the target's "
                            "vocabulary")
    return {"target_vocab_size": target_vocab, "draft_vocab_size": draft_vocab, "tokenizer_size": len(target_tokens),
            "target_model_type": str(getattr(target_config, "model_type", "")), "draft_model_type": draft_type}


def _vocab_size(config: Any) -> int:
    text = getattr(config, "text_config", None) or config
    return int(getattr(text, "vocab_size", 0) or 0)
