"""A Llama/Qwen3-shaped decoder in plain torch with random weights, written to be captured as a CUDA graph.

Per layer: RMSNorm, fused QKV projection, (Qwen3) RMSNorm over each head's queries and keys, attention over a dense
per-request KV cache with `scaled_dot_product_attention`, output projection, RMSNorm, SwiGLU MLP with a fused
gate/up projection; then a final RMSNorm and the LM head. What a forward pass costs depends on these shapes, not on
the weights' values, so nothing is loaded. Not modelled (and not needed for cost): RoPE, sampling, rejection.

Graph-safe: every shape, cache slice and mask is fixed when the call is made (positions are Python ints, so the
cache writes are static slices), and nothing reads a value back to the host (the draft loop feeds each argmax to the
next pass on the device). A CUDA graph captures one call and replays it.

Grouped-query attention without copying keys: the g query heads that share a KV head are folded into the query
length ([B, kv_heads, g * q, head_dim] against [B, kv_heads, L, head_dim]), so each KV head is read once per layer,
as a serving engine's attention kernel does, on every torch version and SDPA backend.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from minedraft.profile.architecture import Architecture

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}

# Random weights: small enough that activations stay finite in bf16 through 64 layers (values do not change cost).
_WEIGHT_STD = 0.02


@dataclass
class _Layer:
    input_norm: torch.Tensor
    qkv: torch.Tensor
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    o: torch.Tensor
    post_norm: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor


@dataclass
class KVCache:
    """Dense per-request cache: per layer [batch, kv_heads, positions, head_dim] keys and values."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]

    @property
    def positions(self) -> int:
        return int(self.keys[0].shape[2])


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


class RandomDecoder:
    def __init__(self, arch: Architecture, dtype: torch.dtype, device: torch.device | str, seed: int = 0):
        self.arch = arch
        self.dtype = dtype
        self.device = torch.device(device)
        torch.manual_seed(seed)
        a = arch
        self.group = a.heads // a.kv_heads

        def weight(*shape: int) -> torch.Tensor:
            return torch.empty(shape, dtype=dtype, device=self.device).normal_(0.0, _WEIGHT_STD)

        def norm(size: int) -> torch.Tensor:
            return torch.ones(size, dtype=dtype, device=self.device)

        self.embed = weight(a.vocab, a.hidden)
        self.layers = [
            _Layer(input_norm=norm(a.hidden), qkv=weight((a.heads + 2 * a.kv_heads) * a.head_dim, a.hidden),
                   q_norm=norm(a.head_dim) if a.qk_norm else None, k_norm=norm(a.head_dim) if a.qk_norm else None,
                   o=weight(a.hidden, a.heads * a.head_dim), post_norm=norm(a.hidden),
                   gate_up=weight(2 * a.inter, a.hidden), down=weight(a.hidden, a.inter))
            for _ in range(a.layers)
        ]
        self.final_norm = norm(a.hidden)
        self.lm_head = self.embed if a.tied_embeddings else weight(a.vocab, a.hidden)

    def num_parameters(self) -> int:
        tensors = [self.embed, self.final_norm]
        if self.lm_head is not self.embed:
            tensors.append(self.lm_head)
        for layer in self.layers:
            tensors += [t for t in (layer.input_norm, layer.qkv, layer.q_norm, layer.k_norm, layer.o,
                                    layer.post_norm, layer.gate_up, layer.down) if t is not None]
        return sum(t.numel() for t in tensors)

    # -- inputs (allocated before a capture, never inside it) -------------------------------------------------------

    def new_cache(self, batch: int, positions: int) -> KVCache:
        shape = (batch, self.arch.kv_heads, positions, self.arch.head_dim)
        # Filled, not empty: uninitialised memory can hold denormals or NaNs, which slow a CPU down.
        return KVCache(keys=[torch.randn(shape, dtype=self.dtype, device=self.device) for _ in self.layers],
                       values=[torch.randn(shape, dtype=self.dtype, device=self.device) for _ in self.layers])

    def new_tokens(self, batch: int, num: int) -> torch.Tensor:
        return torch.randint(0, self.arch.vocab, (batch, num), device=self.device)

    def mask(self, num: int, start: int) -> torch.Tensor | None:
        """Which cached positions each of `num` new tokens (at start, start+1, ...) may attend to, in the folded
        layout (row = query head in the group * num + token); None for one token (it sees the whole cache)."""
        if num == 1:
            return None
        token = torch.arange(self.group * num, device=self.device) % num
        return torch.arange(start + num, device=self.device).view(1, -1) <= (start + token).view(-1, 1)

    # -- the model ----------------------------------------------------------------------------------------------------

    def hidden_states(self, tokens: torch.Tensor, cache: KVCache, start: int,
                      mask: torch.Tensor | None) -> torch.Tensor:
        """tokens [B, q] at positions start..start+q-1 (their keys/values written to the cache there); returns the
        final-normed hidden states [B, q, hidden]."""
        a = self.arch
        batch, num = tokens.shape
        end = start + num
        q_size, kv_size = a.heads * a.head_dim, a.kv_heads * a.head_dim
        x = F.embedding(tokens, self.embed)
        for layer, k_cache, v_cache in zip(self.layers, cache.keys, cache.values, strict=True):
            h = _rms_norm(x, layer.input_norm, a.rms_norm_eps)
            q, k, v = F.linear(h, layer.qkv).split([q_size, kv_size, kv_size], dim=-1)
            q = q.view(batch, num, a.kv_heads, self.group, a.head_dim)
            k = k.view(batch, num, a.kv_heads, a.head_dim)
            if layer.q_norm is not None and layer.k_norm is not None:
                q = _rms_norm(q, layer.q_norm, a.rms_norm_eps)
                k = _rms_norm(k, layer.k_norm, a.rms_norm_eps)
            k_cache[:, :, start:end].copy_(k.transpose(1, 2))
            v_cache[:, :, start:end].copy_(v.view(batch, num, a.kv_heads, a.head_dim).transpose(1, 2))
            folded = q.permute(0, 2, 3, 1, 4).reshape(batch, a.kv_heads, self.group * num, a.head_dim)
            attn = F.scaled_dot_product_attention(folded, k_cache[:, :, :end], v_cache[:, :, :end], attn_mask=mask)
            attn = attn.view(batch, a.kv_heads, self.group, num, a.head_dim).permute(0, 3, 1, 2, 4)
            x = x + F.linear(attn.reshape(batch, num, q_size), layer.o)
            h = _rms_norm(x, layer.post_norm, a.rms_norm_eps)
            gate, up = F.linear(h, layer.gate_up).chunk(2, dim=-1)
            x = x + F.linear(F.silu(gate) * up, layer.down)
        return _rms_norm(x, self.final_norm, a.rms_norm_eps)

    def forward(self, tokens: torch.Tensor, cache: KVCache, start: int, mask: torch.Tensor | None) -> torch.Tensor:
        """A decode step (one token) or a verification (k + 1 tokens): logits for every new position, argmax."""
        return F.linear(self.hidden_states(tokens, cache, start, mask), self.lm_head).argmax(dim=-1)

    def prefill(self, tokens: torch.Tensor, cache: KVCache, start: int, mask: torch.Tensor | None) -> torch.Tensor:
        """A prompt chunk [B, P] after `start` cached tokens: every position's keys and values into the cache, the
        next token from the last position only (a serving engine computes no other logits in a prefill)."""
        return F.linear(self.hidden_states(tokens, cache, start, mask)[:, -1], self.lm_head).argmax(dim=-1)

    def draft_loop(self, tokens: torch.Tensor, cache: KVCache, start: int, k: int,
                   mask: torch.Tensor | None) -> torch.Tensor:
        """A k-token draft: one pass over the k + 1 accepted/bonus tokens [B, k + 1] at start, then k - 1 one-token
        passes, each fed the previous pass's argmax on the device (no host sync). Returns the drafts [B, k]."""
        batch, num = tokens.shape
        drafts = []
        hidden = self.hidden_states(tokens, cache, start, mask)
        nxt = F.linear(hidden[:, -1], self.lm_head).argmax(dim=-1)
        drafts.append(nxt)
        for step in range(k - 1):
            hidden = self.hidden_states(nxt.view(batch, 1), cache, start + num + step, None)
            nxt = F.linear(hidden[:, -1], self.lm_head).argmax(dim=-1)
            drafts.append(nxt)
        return torch.stack(drafts, dim=1)
