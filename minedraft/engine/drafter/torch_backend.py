"""A plain-torch greedy drafter for Llama and Qwen3 draft models, with a KV cache kept per request.

Why next to the vLLM drafter: on CPUs a vLLM draft job pays a fixed ~15 ms (request admission, scheduling, a
re-prefill of the partial prefix-cache block) whatever the draft length, which dwarfs a one-layer draft model's
compute. Here each request keeps its KV cache between jobs; a job only feeds the tokens committed since the last
one (usually the bonus token) and then k single-token steps, batched across the sub-batch.

Correctness does not depend on this code matching vLLM numerically: drafts are proposals, and the verifier keeps
the output lossless whatever is proposed.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

# Catch-ups longer than this (new prompts) run one request at a time, so one long prompt does not pad the batch.
LONG_CATCH_UP = 16


@dataclass
class _Layer:
    input_norm: torch.Tensor
    qkv: torch.Tensor
    o: torch.Tensor
    post_norm: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor
    # Qwen3: RMSNorm over each head's queries and keys before RoPE (None for Llama).
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    # q_norm per query head and k_norm per key head stacked [heads + kv heads, head_dim]: both normed at once.
    qk_norm: torch.Tensor | None = None


@dataclass
class _Slot:
    index: int
    # Tokens whose keys and values sit in this slot's cache, positions 0..len-1.
    tokens: list[int] = field(default_factory=list)
    last_used: float = 0.0


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    variance = x.pow(2).mean(-1, keepdim=True)
    return x * torch.rsqrt(variance + eps) * weight


def _weight_or_none(module: Any, name: str) -> torch.Tensor | None:
    norm = getattr(module, name, None)
    return None if norm is None else norm.weight.detach().clone()


def _consecutive(slot_ids: torch.Tensor) -> slice | None:
    """The slice of cache rows `slot_ids` names when they are consecutive and ascending (a view then does what an
    index_select copy would), else None."""
    ids = slot_ids.tolist()
    if ids == list(range(ids[0], ids[0] + len(ids))):
        return slice(ids[0], ids[0] + len(ids))
    return None


def _signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """sin with its first half negated. RoPE in transformers' layout is x * cos + rotate_half(x) * sin, where
    rotate_half(x) = cat(-x2, x1) for x's halves x1, x2; that equals x * cos + x.roll(half, -1) * signed sin: one roll
    in place of two slices, a negation and a concatenation."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo] holds, a[:hi] == b[:hi] does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


# Architectures implemented here (model_type in the Hugging Face config).
ARCHITECTURES = ("llama", "qwen3")
# RoPE variants whose frequencies do not depend on the sequence length (computed once, as transformers computes them;
# "dynamic" and "longrope" change with the context and are left to the vLLM backend).
ROPE_TYPES = ("default", "linear", "yarn", "llama3")


def apply_config_overrides(config: Any, overrides: dict[str, Any] | None) -> Any:
    """A model config with vLLM-style `hf_overrides` applied (the same dict a user passes to vLLM's `--hf-overrides`
    to stretch a model's context): keys set on the config; `rope_scaling` (the older name) is read as
    `rope_parameters`, keeping the model's own `rope_theta` unless the override names one."""
    for key, value in (overrides or {}).items():
        if key in ("rope_scaling", "rope_parameters") and isinstance(value, dict):
            base = dict(getattr(config, "rope_parameters", None) or {})
            config.rope_parameters = {"rope_theta": base.get("rope_theta", getattr(config, "rope_theta", 10000.0)),
                                      **value}
        else:
            setattr(config, key, value)
    if hasattr(config, "standardize_rope_params"):
        config.standardize_rope_params()
    return config


def rope_tables(config: Any, head_dim: int, max_len: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin per position [max_len, head_dim], scaled as transformers' own rotary embedding scales them (the
    inverse frequencies and the attention factor YaRN applies to both), so a drafter given a stretched context
    reads positions exactly as its reference model does."""
    rope = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"rope_parameters.rope_type: the torch drafter implements {', '.join(ROPE_TYPES)}, not "
                         f"{rope_type!r}; use the vllm drafter backend")
    attention_factor = 1.0
    if rope_type == "default":
        theta = float(rope.get("rope_theta", getattr(config, "rope_theta", 10000.0)))
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    else:
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        inv_freq, attention_factor = ROPE_INIT_FUNCTIONS[rope_type](config, None)
        inv_freq = inv_freq.float()
    freqs = torch.outer(torch.arange(max_len, dtype=torch.float32), inv_freq)
    angles = torch.cat((freqs, freqs), dim=-1)
    return (angles.cos() * attention_factor).to(dtype), (angles.sin() * attention_factor).to(dtype)


class TorchLlamaDrafter:
    """Llama, and Qwen3 (Llama plus a per-head RMSNorm on queries and keys)."""

    def __init__(self, model_dir: str, max_slots: int, max_model_len: int, dtype: torch.dtype = torch.float32,
                 config_overrides: dict[str, Any] | None = None):
        from transformers import AutoConfig, AutoModelForCausalLM

        config = apply_config_overrides(AutoConfig.from_pretrained(model_dir), config_overrides)
        model_type = getattr(config, "model_type", "")
        if model_type not in ARCHITECTURES:
            raise ValueError(f"the torch drafter implements {', '.join(ARCHITECTURES)}, not {model_type!r}; use the "
                             "vllm drafter backend")
        if getattr(config, "attention_bias", False) or getattr(config, "use_sliding_window", False):
            raise ValueError("the torch drafter implements attention without biases or sliding windows; use the vllm "
                             "drafter backend")
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.eps = config.rms_norm_eps
        self.max_model_len = max_model_len
        self.vocab_size = config.vocab_size
        with torch.no_grad():
            self.embed = model.model.embed_tokens.weight.detach().clone()
            self.final_norm = model.model.norm.weight.detach().clone()
            self.lm_head = model.lm_head.weight.detach().clone()
            self.layers = [
                _Layer(
                    input_norm=layer.input_layernorm.weight.detach().clone(),
                    qkv=torch.cat([layer.self_attn.q_proj.weight, layer.self_attn.k_proj.weight,
                                   layer.self_attn.v_proj.weight]).detach().clone(),
                    o=layer.self_attn.o_proj.weight.detach().clone(),
                    post_norm=layer.post_attention_layernorm.weight.detach().clone(),
                    gate_up=torch.cat([layer.mlp.gate_proj.weight, layer.mlp.up_proj.weight]).detach().clone(),
                    down=layer.mlp.down_proj.weight.detach().clone(),
                    q_norm=_weight_or_none(layer.self_attn, "q_norm"),
                    k_norm=_weight_or_none(layer.self_attn, "k_norm"),
                )
                for layer in model.model.layers
            ]
        for item in self.layers:
            if item.q_norm is not None and item.k_norm is not None:
                item.qk_norm = torch.cat([item.q_norm.expand(self.num_heads, -1),
                                          item.k_norm.expand(self.num_kv_heads, -1)]).contiguous()
        self.cos, sin = rope_tables(config, self.head_dim, max_model_len, dtype)
        self.sin_signed = _signed_sin(sin)
        self._allocate_cache(max_slots, max_model_len, dtype)
        self.slots: dict[str, _Slot] = {}
        self.free = list(range(max_slots))
        # Seconds the last draft() spent up to its first drafted token (catch-up included).
        self.last_first_token_seconds = 0.0
        del model

    def _allocate_cache(self, max_slots: int, max_model_len: int, dtype: torch.dtype) -> None:
        """Every position of every slot (torch_window.WindowedTorchDrafter keeps a bounded window instead)."""
        shape = (max_slots, self.num_kv_heads, max_model_len, self.head_dim)
        self.k_cache = [torch.zeros(shape, dtype=dtype) for _ in self.layers]
        self.v_cache = [torch.zeros(shape, dtype=dtype) for _ in self.layers]

    # -- slots ---------------------------------------------------------------------------------------------------

    def _slot_for(self, request_id: str) -> _Slot:
        slot = self.slots.get(request_id)
        if slot is None:
            if not self.free:
                oldest = min(self.slots, key=lambda rid: self.slots[rid].last_used)
                self.free.append(self.slots.pop(oldest).index)
            slot = _Slot(self.free.pop())
            self.slots[request_id] = slot
        slot.last_used = time.monotonic()
        return slot

    def forget(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            slot = self.slots.pop(request_id, None)
            if slot is not None:
                self.free.append(slot.index)

    # -- model ---------------------------------------------------------------------------------------------------

    def _forward(self, tokens: torch.Tensor, positions: torch.Tensor, slot_ids: torch.Tensor,
                 valid: torch.Tensor, cache_index: torch.Tensor | None = None,
                 mask: torch.Tensor | None = None) -> torch.Tensor:
        """tokens/positions/valid: [B, N]; returns final hidden states [B, N, D]. Each token's keys and values go to
        its slot's cache at its position, or at `cache_index` [B, N] with `mask` [B, 1, N, K] saying which of the
        first K cache entries each query sees (draft_tree: a request's branches share its committed entries)."""
        batch, num = tokens.shape
        x = self.embed[tokens]
        cos, sin = self._rope_at(positions)
        if mask is None:
            key_len = int(positions.max()) + 1
            key_positions = torch.arange(key_len)
            mask = (key_positions.view(1, 1, 1, -1) <= positions.view(batch, 1, num, 1)) & valid.view(batch, 1, num, 1)
        else:
            key_len = mask.shape[-1]
        # Most forwards (every draft step) have no padding: plain reshapes then, not boolean indexing (a nonzero()
        # and a gather per tensor, which on a one-layer drafter are a visible share of a forward).
        all_valid = bool(valid.all())
        where = positions if cache_index is None else cache_index
        if all_valid:
            write_slots, write_positions = slot_ids.repeat_interleave(num), where.reshape(-1)
        else:
            write_slots, write_positions = slot_ids.view(batch, 1).expand(batch, num)[valid], where[valid]
        rows = _consecutive(slot_ids)
        q_size = self.num_heads * self.head_dim
        for layer, k_cache, v_cache in zip(self.layers, self.k_cache, self.v_cache, strict=True):
            q, k, v = self._attention_inputs(layer, x, cos, sin)
            new_k, new_v = k.transpose(1, 2), v.transpose(1, 2)
            if all_valid:
                new_k, new_v = new_k.flatten(0, 1), new_v.flatten(0, 1)
            else:
                new_k, new_v = new_k[valid], new_v[valid]
            k_cache[write_slots, :, write_positions] = new_k
            v_cache[write_slots, :, write_positions] = new_v
            if rows is not None:  # the slots side by side (one request, always): a view, no copy
                keys, values = k_cache[rows, :, :key_len], v_cache[rows, :, :key_len]
            else:
                # (index_select copies whole rows: several times faster on CPUs than advanced indexing with slices.)
                keys = k_cache[:, :, :key_len].index_select(0, slot_ids)
                values = v_cache[:, :, :key_len].index_select(0, slot_ids)
            attn = F.scaled_dot_product_attention(
                q, keys, values, attn_mask=mask, enable_gqa=self.num_kv_heads != self.num_heads
            )
            x = x + attn.transpose(1, 2).reshape(batch, num, q_size) @ layer.o.T
            h = _rms_norm(x, layer.post_norm, self.eps)
            gate, up = (h @ layer.gate_up.T).chunk(2, dim=-1)
            x = x + (F.silu(gate) * up) @ layer.down.T
        return _rms_norm(x, self.final_norm, self.eps)

    def _rope_at(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin at `positions` [B, N], shaped [B, N, 1, head_dim] to broadcast over heads."""
        return self.cos[positions].unsqueeze(2), self.sin_signed[positions].unsqueeze(2)

    def _attention_inputs(self, layer: _Layer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries, keys and values [B, heads, N, head_dim] of the residual stream x [B, N, D]: queries' and keys'
        heads normed (Qwen3) and rotated together, a handful of operations per layer whatever the head count."""
        batch, num = x.shape[0], x.shape[1]
        heads = self.num_heads + self.num_kv_heads
        qkv = (_rms_norm(x, layer.input_norm, self.eps) @ layer.qkv.T).view(
            batch, num, heads + self.num_kv_heads, self.head_dim)
        qk, v = qkv[:, :, :heads], qkv[:, :, heads:]
        if layer.qk_norm is not None:
            qk = _rms_norm(qk, layer.qk_norm, self.eps)
        qk = torch.addcmul(qk * cos, qk.roll(self.head_dim // 2, -1), sin)
        return (qk[:, :, :self.num_heads].transpose(1, 2), qk[:, :, self.num_heads:].transpose(1, 2),
                v.transpose(1, 2))

    def _next(self, hidden: torch.Tensor, want_logprobs: bool, top_f: int = 0
              ) -> tuple[list[int], list[float] | None, list[list[int]] | None]:
        """Greedy tokens per row, their log-probabilities if wanted, and the top-`top_f` ids (best first) if asked."""
        logits = hidden @ self.lm_head.T
        tokens = logits.argmax(dim=-1)
        logprobs = None
        if want_logprobs:
            logprobs = torch.log_softmax(logits, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1).tolist()
        top = logits.topk(min(top_f, logits.shape[-1]), dim=-1).indices.tolist() if top_f else None
        return tokens.tolist(), logprobs, top

    def _catch_up(self, group: list[tuple[_Slot, list[int], int]]) -> torch.Tensor:
        """Feed each request's new committed tokens; returns the last position's hidden state per request."""
        num = max(len(new) for _, new, _ in group)
        batch = len(group)
        tokens = torch.zeros(batch, num, dtype=torch.long)
        positions = torch.zeros(batch, num, dtype=torch.long)
        valid = torch.zeros(batch, num, dtype=torch.bool)
        for i, (_, new, start) in enumerate(group):
            tokens[i, : len(new)] = torch.tensor(new)
            positions[i, : len(new)] = torch.arange(start, start + len(new))
            positions[i, len(new):] = start + len(new) - 1
            valid[i, : len(new)] = True
        slot_ids = torch.tensor([slot.index for slot, _, _ in group])
        hidden = self._forward(tokens, positions, slot_ids, valid)
        last = torch.tensor([len(new) - 1 for _, new, _ in group])
        return hidden[torch.arange(batch), last]

    def draft(self, items: list[tuple[str, list[int], int]], want_logprobs: bool,
              on_step: Callable[[], None] | None = None) -> list[tuple[list[int], list[float] | None]]:
        """items: (request id, committed context, tokens to draft). Returns drafts in the same order. `on_step` is
        called after every forward pass (the drafter's progress reports)."""
        return [(tokens, logprobs) for tokens, logprobs, _ in self.draft_with_candidates(items, want_logprobs, on_step)]

    @property
    def num_free_slots(self) -> int:
        return len(self.free)

    def cached_prefix(self, request_id: str, context: list[int]) -> int:
        """How many of `context`'s first tokens the request's slot holds (0: no slot)."""
        slot = self.slots.get(request_id)
        return _common_prefix(slot.tokens, context) if slot is not None else 0

    def fork(self, request_id: str, branch_key: str, num_tokens: int) -> None:
        """A scratch slot `branch_key` holding the first `num_tokens` cached positions of `request_id`'s slot (its
        committed tokens): a lookahead branch drafts there, past them, and the request's own slot is never written.
        Forget the key when the branch is drafted. (A request without a slot forks an empty one.)"""
        slot = self._slot_for(branch_key)
        source = self.slots.get(request_id)
        if source is None or source is slot:
            slot.tokens = []
            return
        num_tokens = min(num_tokens, len(source.tokens))
        self._copy_slot(source.index, slot.index, num_tokens)
        slot.tokens = source.tokens[:num_tokens]

    def adopt(self, branch_key: str, request_id: str, num_tokens: int) -> None:
        """The request's slot takes the first `num_tokens` cached positions of a branch's scratch slot (the committed
        tokens the branch's row took in: the same for every branch of the request)."""
        source = self.slots[branch_key]
        slot = self._slot_for(request_id)
        num_tokens = min(num_tokens, len(source.tokens))
        self._copy_slot(source.index, slot.index, num_tokens)
        slot.tokens = source.tokens[:num_tokens]

    def _copy_slot(self, source: int, target: int, num_tokens: int) -> None:
        for k_cache, v_cache in zip(self.k_cache, self.v_cache, strict=True):
            k_cache[target, :, :num_tokens] = k_cache[source, :, :num_tokens]
            v_cache[target, :, :num_tokens] = v_cache[source, :, :num_tokens]

    @torch.no_grad()
    def draft_with_candidates(self, items: list[tuple[str, list[int], int]], want_logprobs: bool,
                              on_step: Callable[[], None] | None = None, top_f: int = 0
                              ) -> list[tuple[list[int], list[float] | None, list[list[int]]]]:
        """draft(), and with `top_f` the top-F token ids at each drafted position and the one after (one more
        forward: the bonus token's candidates after a full acceptance)."""
        step_done = on_step or (lambda: None)
        started = time.perf_counter()
        prepared: list[tuple[_Slot, list[int], int]] = []
        for request_id, context, _ in items:
            slot = self._slot_for(request_id)
            keep = min(_common_prefix(slot.tokens, context), len(context) - 1)
            prepared.append((slot, context[keep:], keep))
            # Until this job's keys and values are written, only the common prefix is trustworthy.
            slot.tokens = slot.tokens[:keep]
        last_hidden: list[torch.Tensor | None] = [None] * len(items)
        short = [i for i, (_, new, _) in enumerate(prepared) if len(new) <= LONG_CATCH_UP]
        long = [i for i, (_, new, _) in enumerate(prepared) if len(new) > LONG_CATCH_UP]
        if short:
            hidden = self._catch_up([prepared[i] for i in short])
            step_done()
            for row, i in enumerate(short):
                last_hidden[i] = hidden[row]
        for i in long:
            last_hidden[i] = self._catch_up([prepared[i]])[0]
            step_done()
        for (slot, _, _), (_, context, _) in zip(prepared, items, strict=True):
            slot.tokens = list(context)
        stacked = torch.stack([h for h in last_hidden if h is not None])
        tokens, logprobs, top = self._next(stacked, want_logprobs, top_f)
        self.last_first_token_seconds = time.perf_counter() - started
        drafts: list[list[int]] = [[t] for t in tokens]
        draft_logprobs: list[list[float]] = [[lp] for lp in logprobs] if logprobs is not None else []
        candidates: list[list[list[int]]] = [[row] for row in top] if top is not None else [[] for _ in items]
        wanted = [min(n, self.max_model_len - len(context)) for _, context, n in items]
        slot_ids = torch.tensor([slot.index for slot, _, _ in prepared])
        # With candidates, each row runs one step past its draft: the candidates for the position after it.
        for step in range(1, max(wanted, default=0) + (1 if top_f else 0)):
            active = [i for i, n in enumerate(wanted) if n > step or (top_f and n == step)]
            feed = torch.tensor([[drafts[i][-1]] for i in active])
            positions = torch.tensor([[len(items[i][1]) + step - 1] for i in active])
            hidden = self._forward(feed, positions, slot_ids[active], torch.ones(len(active), 1, dtype=torch.bool))
            tokens, logprobs, top = self._next(hidden[:, 0], want_logprobs, top_f)
            step_done()
            for row, i in enumerate(active):
                prepared[i][0].tokens.append(drafts[i][-1])
                if step < wanted[i]:
                    drafts[i].append(tokens[row])
                    if logprobs is not None:
                        draft_logprobs[i].append(logprobs[row])
                if top is not None:
                    candidates[i].append(top[row])
        out: list[tuple[list[int], list[float] | None, list[list[int]]]] = []
        for i, n in enumerate(wanted):
            out.append((drafts[i][: max(0, n)], draft_logprobs[i][: max(0, n)] if want_logprobs else None,
                        candidates[i][: max(0, n) + 1] if top_f and n > 0 else []))
        return out

    @torch.no_grad()
    def draft_tree(self, items: list[tuple[str, list[int], tuple[int, ...], int]], want_logprobs: bool,
                   on_step: Callable[[], None] | None = None, top_f: int = 0
                   ) -> list[tuple[list[int], list[float] | None, list[list[int]]]] | None:
        """Lookahead's branches as a tree per request, one batch row per request: items are (request id, committed
        context, tail, tokens to draft), every item of a request with the same context. The tokens committed since
        the last job are fed once, into the request's own slot at their positions; each branch's tail and drafted
        tokens go to a region of that slot past the committed context (never read as committed: the slot's tokens
        stay the context), and the attention mask lets a branch's queries see the committed entries and its own
        region only. So a job costs one row per request per forward rather than one per branch, with no copies of
        the committed KV. Returns draft_with_candidates' answers per item in order; None where the regions do not
        fit the cache (the caller forks slots instead)."""
        step_done = on_step or (lambda: None)
        started = time.perf_counter()
        requests: dict[str, list[int]] = {}
        for i, (request_id, _, _, _) in enumerate(items):
            requests.setdefault(request_id, []).append(i)
        # Per item: drafts wanted (the context's room), region start in its request's slot.
        wanted = [max(0, min(n, self.max_model_len - len(context) - len(tail))) for _, context, tail, n in items]
        start = [0] * len(items)
        rows: list[tuple[str, list[int], list[int]]] = []  # (request id, context, its items)
        for request_id, indices in requests.items():
            context = items[indices[0]][1]
            if any(items[i][1] != context for i in indices[1:]):
                return None
            end = len(context)
            for i in indices:
                if len(context) + len(items[i][2]) > self.max_model_len:
                    return None
                start[i] = end
                end += len(items[i][2]) + wanted[i]
            if end > self.k_cache[0].shape[2]:
                return None
            rows.append((request_id, context, indices))
        # Long catch-ups (a new prompt, a restart) first, each alone in its own slot, so they do not pad every row.
        for request_id, context, _ in rows:
            slot = self.slots.get(request_id)
            if len(context) - (_common_prefix(slot.tokens, context) if slot is not None else 0) > LONG_CATCH_UP:
                self.draft_with_candidates([(request_id, context, 0)], False)
                step_done()
        slots = [self._slot_for(request_id) for request_id, _, _ in rows]
        slot_ids = torch.tensor([slot.index for slot in slots])
        key_len = max(start[i] + len(items[i][2]) + wanted[i] for _, _, indices in rows for i in indices)
        key_len = max(key_len, max(len(context) for _, context, _ in rows))
        # Which branch owns each cache entry of each row's slot: -1 committed, -2 unused by this job.
        owner = torch.full((len(rows), key_len), -2, dtype=torch.long)
        for r, (_, context, indices) in enumerate(rows):
            owner[r, :len(context)] = -1
            for i in indices:
                owner[r, start[i]:start[i] + len(items[i][2]) + wanted[i]] = i
        key_index = torch.arange(key_len).view(1, 1, key_len)

        def run(queries: list[list[tuple[int, int, int, int]]], row_ids: list[int]) -> torch.Tensor:
            """queries per row: (token, position, cache index, owning item or -1); returns hidden [rows, N, D]."""
            batch, num = len(row_ids), max(len(q) for q in queries)
            table = torch.zeros(batch, num, 4, dtype=torch.long)
            valid = torch.zeros(batch, num, dtype=torch.bool)
            for b, row in enumerate(queries):
                table[b, :len(row)] = torch.tensor(row)
                valid[b, :len(row)] = True
            cache_index, query_owner = table[..., 2], table[..., 3]
            keys_owner = owner[row_ids].view(batch, 1, key_len)
            visible = (key_index <= cache_index.view(batch, num, 1)) & (
                (keys_owner == -1) | (keys_owner == query_owner.view(batch, num, 1)))
            # A padded query sees everything (its output is never read; with no visible key the softmax is NaN).
            mask = (visible | ~valid.view(batch, num, 1)).unsqueeze(1)
            return self._forward(table[..., 0], table[..., 1], slot_ids[row_ids], valid, cache_index, mask)

        # The catch-up: per row the committed tokens new to the slot, then every branch's tail.
        catch_up: list[list[tuple[int, int, int, int]]] = []
        first_query: list[tuple[int, int]] = [(0, 0)] * len(items)  # (row, query) whose output drafts item's 1st token
        for r, ((_, context, indices), slot) in enumerate(zip(rows, slots, strict=True)):
            keep = min(_common_prefix(slot.tokens, context), len(context) - 1)
            slot.tokens = slot.tokens[:keep]
            queries = [(token, keep + j, keep + j, -1) for j, token in enumerate(context[keep:])]
            last_committed = len(queries) - 1
            for i in indices:
                tail = items[i][2]
                queries.extend((token, len(context) + j, start[i] + j, i) for j, token in enumerate(tail))
                first_query[i] = (r, len(queries) - 1 if tail else last_committed)
            catch_up.append(queries)
        hidden = run(catch_up, list(range(len(rows))))
        step_done()
        for slot, (_, context, _) in zip(slots, rows, strict=True):
            slot.tokens = list(context)
        rows_of = torch.tensor([first_query[i][0] for i in range(len(items))])
        queries_of = torch.tensor([first_query[i][1] for i in range(len(items))])
        tokens, logprobs, top = self._next(hidden[rows_of, queries_of], want_logprobs, top_f)
        self.last_first_token_seconds = time.perf_counter() - started
        drafts: list[list[int]] = [[t] for t in tokens]
        draft_logprobs: list[list[float]] = [[lp] for lp in logprobs] if logprobs is not None else [[] for _ in items]
        candidates: list[list[list[int]]] = [[row] for row in top] if top is not None else [[] for _ in items]
        # With candidates, each branch runs one step past its draft: the candidates for the position after it.
        for step in range(1, max(wanted, default=0) + (1 if top_f else 0)):
            active = [i for i, n in enumerate(wanted) if n > step or (top_f and n == step)]
            if not active:
                break
            per_row: dict[int, list[int]] = {}
            for i in active:
                per_row.setdefault(first_query[i][0], []).append(i)
            row_ids = sorted(per_row)
            step_queries = [[(drafts[i][-1], len(rows[r][1]) + len(items[i][2]) + step - 1,
                              start[i] + len(items[i][2]) + step - 1, i) for i in per_row[r]] for r in row_ids]
            hidden = run(step_queries, row_ids)
            order = [(b, q) for b, r in enumerate(row_ids) for q in range(len(per_row[r]))]
            tokens, logprobs, top = self._next(hidden[torch.tensor([b for b, _ in order]),
                                                      torch.tensor([q for _, q in order])], want_logprobs, top_f)
            step_done()
            for n, i in enumerate(i for r in row_ids for i in per_row[r]):
                if step < wanted[i]:
                    drafts[i].append(tokens[n])
                    if logprobs is not None:
                        draft_logprobs[i].append(logprobs[n])
                if top is not None:
                    candidates[i].append(top[n])
        return [(drafts[i][:n], draft_logprobs[i][:n] if want_logprobs else None,
                 candidates[i][:n + 1] if top_f and n > 0 else []) for i, n in enumerate(wanted)]


DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def concrete_dtype(settings: dict[str, Any]) -> torch.dtype:
    """The engine resolves "auto" before starting a drafter (placement.resolve_dtype): anything else is a bug that
    would silently load the draft in another dtype than the target's."""
    name = str(settings.get("dtype"))
    if name not in DTYPES:
        raise ValueError(f"drafter dtype must be one of {', '.join(DTYPES)} (resolved by the engine), got {name!r}")
    return DTYPES[name]
