"""Context-bounded drafting: the torch drafter reading at most a window of recent tokens (plus attention sinks).

A drafter's per-step cost at long contexts is its KV reads, which grow with the context (a 1.7B drafter at 8k tokens
reads ~9 ms of KV per step on an H100 by arithmetic, against ~0.5 ms for a 512-token window). Drafts are proposals:
the verifier keeps the output lossless whatever is proposed, so a drafter may look at less of the context and only
acceptance can drop. Here each draft step attends to the first `num_sink_tokens` tokens of the context (attention
sinks: softmax mass that models park on the first tokens, which StreamingLLM showed must stay visible) and the last
`window` tokens, whatever the context's length.

Per slot the keys and values live in a ring of sinks + window + ROLLBACK_MARGIN positions: the sinks at fixed
places, position p >= sinks at sinks + (p - sinks) mod (window + margin). Memory per slot is bounded by the window,
not the longest context. The margin is for rollback: drafted tokens are written into the ring while drafting and may
be rejected; the next job rewrites from the first rejected position, and without the margin the rejected positions
would have overwritten positions the next query's window still needs. Keys keep their absolute RoPE positions
(relative distances inside the window are exact).

A catch-up (a new prompt, the tokens accepted since the last job) takes in only what a later query can see: the
sinks and the last `window` positions; the positions between never enter the ring, so a newcomer's prompt costs the
drafter at most sinks + window tokens of prefill, whatever its length. For a one-layer drafter that is exact; in a
deeper one the first positions of the window are computed without the context before them (their lower layers'
own windows reach back further), one more approximation a proposal may make. What is taken in runs in chunks, each
attending to the ring and to itself, so no forward is wider than a chunk.

`device` puts weights, ring and computation on a GPU ("cuda", "cuda:N"); the dense drafter stays CPU-only.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from minedraft.engine.drafter.torch_backend import DTYPES, TorchLlamaDrafter, _rms_norm, _Slot

DEFAULT_NUM_SINK_TOKENS = 4
# Positions a job may roll back (rejected drafts rewritten): at least the longest draft (MAX_NUM_SPECULATIVE_TOKENS).
ROLLBACK_MARGIN = 16
MIN_CHUNK_TOKENS = 64


class WindowedTorchDrafter(TorchLlamaDrafter):
    def __init__(self, model_dir: str, max_slots: int, max_model_len: int, dtype: torch.dtype = torch.float32,
                 window: int = 0, num_sink_tokens: int = DEFAULT_NUM_SINK_TOKENS, device: str = "cpu",
                 config_overrides: dict[str, Any] | None = None) -> None:
        if window < 0 or num_sink_tokens < 0:
            raise ValueError(f"window and num_sink_tokens must be non-negative, got {window}, {num_sink_tokens}")
        # 0: the whole context (the ring then holds every position: this class only for its device).
        self.window = window if window else max_model_len
        self.num_sink_tokens = min(num_sink_tokens, self.window)
        self.ring = self.window + ROLLBACK_MARGIN
        self.capacity = self.num_sink_tokens + self.ring
        self.device = torch.device(device)
        # Catch-up tokens run through the model so far (what trimming to the window saves shows here).
        self.catch_up_tokens_taken = 0
        super().__init__(model_dir, max_slots, max_model_len, dtype, config_overrides)
        self._to_device()

    def _to_device(self) -> None:
        device = self.device
        self.embed = self.embed.to(device)
        self.final_norm = self.final_norm.to(device)
        self.lm_head = self.lm_head.to(device)
        self.cos, self.sin_signed = self.cos.to(device), self.sin_signed.to(device)
        for layer in self.layers:
            for name in ("input_norm", "qkv", "o", "post_norm", "gate_up", "down", "q_norm", "k_norm", "qk_norm"):
                value = getattr(layer, name)
                if value is not None:
                    setattr(layer, name, value.to(device))

    def _allocate_cache(self, max_slots: int, max_model_len: int, dtype: torch.dtype) -> None:
        shape = (max_slots, self.num_kv_heads, self.capacity, self.head_dim)
        self.k_cache = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in self.layers]
        self.v_cache = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in self.layers]
        # The position each ring entry holds; -1: empty.
        self.cache_positions = torch.full((max_slots, self.capacity), -1, dtype=torch.long, device=self.device)

    @property
    def cache_bytes(self) -> int:
        return sum(c.numel() * c.element_size() for c in (*self.k_cache, *self.v_cache))

    def _copy_slot(self, source: int, target: int, num_tokens: int) -> None:
        """A lookahead branch's scratch slot: the source's whole ring (bounded by the window), positions from
        `num_tokens` on marked empty (the branch writes its tail and drafts there)."""
        for k_cache, v_cache in zip(self.k_cache, self.v_cache, strict=True):
            k_cache[target] = k_cache[source]
            v_cache[target] = v_cache[source]
        positions = self.cache_positions[source]
        self.cache_positions[target] = torch.where(positions < num_tokens, positions, -1)

    def draft_tree(self, items: list[tuple[str, list[int], tuple[int, ...], int]], want_logprobs: bool,
                   on_step: Any = None, top_f: int = 0) -> None:
        """(Branch regions past the context do not fit a ring of recent positions: the caller forks slots.)"""
        return None

    def _ring_index(self, positions: torch.Tensor) -> torch.Tensor:
        sinks = self.num_sink_tokens
        return torch.where(positions < sinks, positions, sinks + (positions - sinks) % self.ring)

    def _catch_up(self, group: list[tuple[_Slot, list[int], int]]) -> torch.Tensor:
        """Each request's new committed tokens, trimmed to what a later query can see (the sinks, the last `window`
        positions); returns the last position's hidden state per request."""
        sinks, window = self.num_sink_tokens, self.window
        kept: list[list[tuple[int, int]]] = []
        for slot, new, start in group:
            end = start + len(new)
            # Ring entries from `start` on hold a previous context's tokens or rolled-back drafts; the trimmed
            # positions would not overwrite them, so they are emptied here.
            ring = self.cache_positions[slot.index]
            ring.masked_fill_(ring >= start, -1)
            kept.append([(start + i, token) for i, token in enumerate(new)
                         if start + i < sinks or start + i >= end - window])
        batch, num = len(group), max(len(row) for row in kept)
        tokens = torch.zeros(batch, num, dtype=torch.long)
        positions = torch.zeros(batch, num, dtype=torch.long)
        valid = torch.zeros(batch, num, dtype=torch.bool)
        for i, row in enumerate(kept):
            tokens[i, : len(row)] = torch.tensor([token for _, token in row])
            positions[i, : len(row)] = torch.tensor([position for position, _ in row])
            positions[i, len(row):] = row[-1][0]
            valid[i, : len(row)] = True
        self.catch_up_tokens_taken += int(valid.sum())
        slot_ids = torch.tensor([slot.index for slot, _, _ in group])
        hidden = self._forward(tokens, positions, slot_ids, valid)
        return hidden[torch.arange(batch), torch.tensor([len(row) - 1 for row in kept])]

    def _forward(self, tokens: torch.Tensor, positions: torch.Tensor, slot_ids: torch.Tensor,
                 valid: torch.Tensor, cache_index: torch.Tensor | None = None,
                 mask: torch.Tensor | None = None) -> torch.Tensor:
        if cache_index is not None or mask is not None:
            raise ValueError("the windowed drafter places keys by position in its ring (no draft_tree here)")
        device = self.device
        tokens, positions = tokens.to(device), positions.to(device)
        slot_ids, valid = slot_ids.to(device), valid.to(device)
        num = tokens.shape[1]
        chunk = max(MIN_CHUNK_TOKENS, self.window)
        hidden = [self._forward_chunk(tokens[:, i:i + chunk], positions[:, i:i + chunk], slot_ids,
                                      valid[:, i:i + chunk])
                  for i in range(0, num, chunk)]
        return hidden[0] if len(hidden) == 1 else torch.cat(hidden, dim=1)

    def _forward_chunk(self, tokens: torch.Tensor, positions: torch.Tensor, slot_ids: torch.Tensor,
                       valid: torch.Tensor) -> torch.Tensor:
        batch, num = tokens.shape
        # Where this chunk's tokens start, per row: ring entries from there on are stale (drafted tokens rolled back,
        # or a replaced context); what comes before is in the ring (earlier chunks of this forward wrote theirs).
        starts = positions[:, 0]
        sinks, window = self.num_sink_tokens, self.window
        x = self.embed[tokens]
        cos, sin = self._rope_at(positions)
        query = positions.view(batch, num, 1)

        def visible(key_positions: torch.Tensor) -> torch.Tensor:
            """[B, K] key positions -> [B, num, K]: causal, within the window or a sink."""
            keys = key_positions.view(batch, 1, -1)
            return (keys >= 0) & (keys <= query) & ((keys < sinks) | (keys > query - window))

        ring_positions = self.cache_positions[slot_ids]
        ring_positions = torch.where(ring_positions < starts.view(batch, 1), ring_positions, -1)
        chunk_positions = torch.where(valid, positions, -1)
        mask = torch.cat([visible(ring_positions), visible(chunk_positions)], dim=-1)
        # A padded query (its row has fewer new tokens) sees everything: its output is never used, and a query with
        # no visible key would make the softmax NaN.
        mask = (mask | ~valid.view(batch, num, 1)).unsqueeze(1)
        # Written back: the sinks and the last `ring` positions of each row (unique ring entries per row).
        last = torch.where(valid, positions, -1).max(dim=1, keepdim=True).values
        write = valid & ((positions < sinks) | (positions > last - self.ring))
        write_slots = slot_ids.view(batch, 1).expand(batch, num)[write]
        write_index = self._ring_index(positions)[write]
        q_size = self.num_heads * self.head_dim
        for layer, k_cache, v_cache in zip(self.layers, self.k_cache, self.v_cache, strict=True):
            q, k, v = self._attention_inputs(layer, x, cos, sin)
            keys = torch.cat([k_cache.index_select(0, slot_ids), k], dim=2)
            values = torch.cat([v_cache.index_select(0, slot_ids), v], dim=2)
            attn = F.scaled_dot_product_attention(
                q, keys, values, attn_mask=mask, enable_gqa=self.num_kv_heads != self.num_heads
            )
            k_cache[write_slots, :, write_index] = k.transpose(1, 2)[write]
            v_cache[write_slots, :, write_index] = v.transpose(1, 2)[write]
            x = x + attn.transpose(1, 2).reshape(batch, num, q_size) @ layer.o.T
            h = _rms_norm(x, layer.post_norm, self.eps)
            gate, up = (h @ layer.gate_up.T).chunk(2, dim=-1)
            x = x + (F.silu(gate) * up) @ layer.down.T
        self.cache_positions[write_slots, write_index] = positions[write]
        return _rms_norm(x, self.final_norm, self.eps)


def make_windowed_drafter(settings: dict[str, Any]) -> WindowedTorchDrafter:
    return WindowedTorchDrafter(
        settings["model"],
        max_slots=2 * int(settings["max_num_seqs"]) + 8,
        max_model_len=int(settings["max_model_len"]),
        dtype=DTYPES.get(str(settings.get("dtype")), torch.float32),
        window=int(settings.get("drafter_window") or 0),
        num_sink_tokens=int(settings.get("drafter_sink_tokens", DEFAULT_NUM_SINK_TOKENS)),
        device=str(settings.get("device", "cpu")),
        config_overrides=settings.get("hf_overrides"),
    )
