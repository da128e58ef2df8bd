"""A Llama-3-shaped decoder over a paged KV cache: what ``aiokv bench serve`` prefills.

Seeded random weights, RMSNorm, RoPE, SwiGLU, and grouped-query attention through torch's
``scaled_dot_product_attention``. The KV cache is paged in blocks of 16 tokens: per layer a
``(2, num_blocks, 16, kv_heads, head_dim)`` tensor (K and V), so one layer's K or V page of
a block is 32 KiB in bf16 at Llama-3-8B's shape. A prefill reads the cached prefix from the
pages named by a block table and writes the new tokens' K and V into them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

__all__ = ["BLOCK_TOKENS", "LlamaModel", "ModelConfig", "PrefillInputs"]

BLOCK_TOKENS = 16
"""Tokens per KV block (vLLM's default block size)."""


@dataclass(frozen=True)
class ModelConfig:
    """Layer shapes of a Llama-style decoder; ``llama3_8b`` is Llama-3-8B's."""

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    rope_theta: float = 500000.0
    eps: float = 1e-5

    @classmethod
    def llama3_8b(cls, layers: int = 32) -> ModelConfig:
        """Llama-3-8B: hidden 4096, 32 heads, 8 KV heads of 128, FFN 14336, vocab 128256."""
        return cls("llama3-8b", layers, 4096, 32, 8, 128, 14336, 128256)

    @classmethod
    def tiny(cls, layers: int = 2) -> ModelConfig:
        """The same structure, small enough for a CPU test: GQA 4:2, FFN 3.5x hidden."""
        return cls("tiny", layers, 64, 4, 2, 16, 224, 512)

    def with_layers(self, layers: int) -> ModelConfig:
        if layers < 1:
            raise ValueError(f"layers must be >= 1, got {layers}")
        return replace(self, layers=layers)

    def page_bytes(self, dtype: torch.dtype) -> int:
        """Bytes of one layer's K (or V) page of one block."""
        return BLOCK_TOKENS * self.kv_heads * self.head_dim * _itemsize(dtype)

    def block_bytes(self, dtype: torch.dtype) -> int:
        """Bytes of one block over every layer, K and V: what one cache key moves."""
        return 2 * self.layers * self.page_bytes(dtype)

    def params_per_layer(self) -> int:
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return self.hidden * (q + 2 * kv) + q * self.hidden + 3 * self.hidden * self.ffn

    def prefill_flops(self, new: int, cached: int) -> float:
        """Model FLOPs of a prefill of ``new`` tokens after ``cached`` ones: the matmuls of
        every layer, causal attention (each query sees the keys up to itself) and the
        LM head of the last token; norms, RoPE and softmax are not counted."""
        if new <= 0:
            return 0.0
        linear = 2.0 * self.params_per_layer() * new
        keys_seen = new * cached + new * (new + 1) / 2
        attention = 4.0 * self.heads * self.head_dim * keys_seen
        return self.layers * (linear + attention) + 2.0 * self.hidden * self.vocab


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


class LlamaModel:
    """Weights of a ``ModelConfig`` on a device, and a prefill over a paged KV cache."""

    def __init__(self, config: ModelConfig, *, device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32, seed: int = 0) -> None:
        self.config = c = config
        self.device = torch.device(device)
        self.dtype = dtype
        gen = torch.Generator(device=self.device).manual_seed(seed)

        def weight(rows: int, cols: int) -> torch.Tensor:
            # Scaled by 1/sqrt(fan-in) so activations stay O(1) through every layer.
            w = torch.randn(rows, cols, generator=gen, device=self.device, dtype=dtype)
            return w.mul_(1.0 / math.sqrt(cols))

        q, kv = c.heads * c.head_dim, c.kv_heads * c.head_dim
        self.embed = torch.randn(c.vocab, c.hidden, generator=gen, device=self.device, dtype=dtype)
        self.layers = [
            _Layer(
                attn_norm=torch.ones(c.hidden, device=self.device, dtype=dtype),
                qkv=weight(q + 2 * kv, c.hidden),  # fused, as serving engines run it
                out=weight(c.hidden, q),
                ffn_norm=torch.ones(c.hidden, device=self.device, dtype=dtype),
                gate_up=weight(2 * c.ffn, c.hidden),
                down=weight(c.hidden, c.ffn),
            )
            for _ in range(c.layers)
        ]
        self.norm = torch.ones(c.hidden, device=self.device, dtype=dtype)
        self.lm_head = weight(c.vocab, c.hidden)
        inv = 1.0 / (c.rope_theta ** (torch.arange(0, c.head_dim, 2, dtype=torch.float64) / c.head_dim))
        self._inv_freq = inv.to(self.device)

    def new_kv_cache(self, num_blocks: int) -> list[torch.Tensor]:
        """Per-layer ``(2, num_blocks, 16, kv_heads, head_dim)`` K/V pages (``block_dim=1``)."""
        c = self.config
        return [torch.zeros(2, num_blocks, BLOCK_TOKENS, c.kv_heads, c.head_dim,
                            device=self.device, dtype=self.dtype) for _ in range(c.layers)]

    @torch.inference_mode()
    def prefill(self, tokens: torch.Tensor | np.ndarray | Sequence[int], start: int,
                block_table: Sequence[int], kv_cache: Sequence[torch.Tensor], *,
                gate: Callable[[int], object] | None = None,
                after_layer: Callable[[int], object] | None = None) -> torch.Tensor:
        """Run ``tokens`` at positions ``start..`` and return the last position's logits
        (float32, on the device): ``forward`` of ``prepare``.

        Positions ``0..start-1`` are read from the pages of ``block_table`` (block ``i``
        holds positions ``16*i .. 16*i+15``); the new tokens' K and V are written there too,
        so ``block_table`` must cover ``start + len(tokens)`` positions. ``gate(i)`` runs
        just before layer ``i`` first reads the cached prefix (a layerwise load's gate: the
        new tokens' projections go ahead of it, the prefix read waits for the layer);
        ``after_layer(i)`` once layer ``i``'s new K and V are written (a layerwise store's
        push: the copy runs beside the rest of the forward).
        """
        return self.forward(self.prepare(tokens, start, block_table), kv_cache, gate=gate,
                            after_layer=after_layer)

    @torch.inference_mode()
    def prepare(self, tokens: torch.Tensor | np.ndarray | Sequence[int], start: int,
                block_table: Sequence[int]) -> PrefillInputs:
        """A prefill's inputs on the device, as a serving engine prepares them before it
        starts the step's loads: token ids, the new and the cached positions' slots, the
        rotary tables and the attention (``prefill`` says what the arguments mean).

        Host data goes over in one copy from pinned memory on CUDA, not enqueued behind
        the host's wait for it, so nothing here blocks the thread on the device."""
        ids_host = torch.as_tensor(tokens, dtype=torch.long, device="cpu").reshape(-1)
        new = int(ids_host.numel())
        total = start + new
        if new < 1 or start < 0:
            raise ValueError(f"a prefill needs >= 1 token at a position >= 0 (got {new} at {start})")
        if len(block_table) * BLOCK_TOKENS < total:
            raise ValueError(f"block table of {len(block_table)} blocks is short for {total} positions")
        host = torch.cat([ids_host, torch.as_tensor(list(block_table), dtype=torch.long)])
        if self.device.type == "cuda":
            host = host.pin_memory()
        both = host.to(self.device, non_blocking=True)
        ids, table = both[:new], both[new:]
        positions = torch.arange(start, total, device=self.device)
        slots = table[positions // BLOCK_TOKENS] * BLOCK_TOKENS + positions % BLOCK_TOKENS
        past_slots = None
        if start:
            past = torch.arange(start, device=self.device)
            past_slots = table[past // BLOCK_TOKENS] * BLOCK_TOKENS + past % BLOCK_TOKENS
        cos, sin = self._rope(positions)
        attend = _attention(new, start, self.device)
        return PrefillInputs(ids, start, slots, past_slots, cos, sin, attend, host)

    @torch.inference_mode()
    def forward(self, inputs: PrefillInputs, kv_cache: Sequence[torch.Tensor], *,
                gate: Callable[[int], object] | None = None,
                after_layer: Callable[[int], object] | None = None) -> torch.Tensor:
        """The decoder over ``prepare``'s inputs: every layer, then the last position's
        logits (``prefill`` says what ``gate`` and ``after_layer`` are called for)."""
        c = self.config
        ids, slots, past_slots = inputs.ids, inputs.slots, inputs.past_slots
        cos, sin, attend = inputs.cos, inputs.sin, inputs.attend
        new = int(ids.numel())
        x = self.embed[ids]
        q_width, kv_width = c.heads * c.head_dim, c.kv_heads * c.head_dim
        for i, (layer, pages) in enumerate(zip(self.layers, kv_cache)):
            h = _rms_norm(x, layer.attn_norm, c.eps)
            q, k, v = F.linear(h, layer.qkv).split([q_width, kv_width, kv_width], dim=-1)
            q = _rotate(q.view(new, c.heads, c.head_dim), cos, sin)
            k = _rotate(k.view(new, c.kv_heads, c.head_dim), cos, sin)
            v = v.view(new, c.kv_heads, c.head_dim)
            flat = pages.view(2, -1, c.kv_heads, c.head_dim)
            flat[0].index_copy_(0, slots, k)
            flat[1].index_copy_(0, slots, v)
            if after_layer is not None:
                after_layer(i)
            if past_slots is not None:  # the cached prefix, read back from its pages
                if gate is not None:
                    gate(i)
                k = torch.cat([flat[0].index_select(0, past_slots), k])
                v = torch.cat([flat[1].index_select(0, past_slots), v])
            attn = attend(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1))
            x = x + F.linear(attn.transpose(0, 1).reshape(new, q_width), layer.out)
            h = _rms_norm(x, layer.ffn_norm, c.eps)
            g, up = F.linear(h, layer.gate_up).chunk(2, dim=-1)
            x = x + F.linear(F.silu(g) * up, layer.down)
        last = _rms_norm(x[-1:], self.norm, c.eps)
        return F.linear(last, self.lm_head).float().squeeze(0)

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        angles = positions.to(torch.float64)[:, None] * self._inv_freq[None, :]
        cos = torch.cat([angles.cos(), angles.cos()], dim=-1)[:, None, :].to(self.dtype)
        sin = torch.cat([angles.sin(), angles.sin()], dim=-1)[:, None, :].to(self.dtype)
        return cos, sin


def _attention(new: int, start: int, device: torch.device) -> Callable[..., torch.Tensor]:
    """Causal GQA attention of ``new`` queries at positions ``start..`` over every key up to
    them, through ``scaled_dot_product_attention`` (inputs ``(heads, tokens, head_dim)``).

    From scratch it is SDPA's causal kernel. After a cached prefix the causal mask aligns
    to the bottom right: CUDA's flash kernel takes that as is (``causal_lower_right``). On
    the CPU a masked SDPA runs at about half the speed of its causal kernel, so there a
    prefix under three times the new tokens is covered by padding the queries in front
    (the causal kernel over the square, keeping the last rows: less work than the mask
    then), and a longer one by a mask built once per prefill.
    """
    def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw: Any) -> torch.Tensor:
        return F.scaled_dot_product_attention(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0),
                                              enable_gqa=True, **kw).squeeze(0)

    total = start + new
    if start == 0:
        return partial(sdpa, is_causal=True)
    if device.type == "cuda":
        return partial(sdpa, attn_mask=causal_lower_right(new, total))
    if start < 3 * new:
        def padded(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            q = torch.cat([q.new_zeros(q.shape[0], start, q.shape[2]), q], dim=1)
            return sdpa(q, k, v, is_causal=True)[:, start:]

        return padded
    mask = torch.ones(new, total, dtype=torch.bool, device=device).tril(start)
    return partial(sdpa, attn_mask=mask)


@dataclass
class PrefillInputs:
    """What ``LlamaModel.prepare`` puts on the device for one prefill (``host`` keeps the
    pinned source of its copy alive while that copy may still run)."""

    ids: torch.Tensor
    start: int
    slots: torch.Tensor
    past_slots: torch.Tensor | None
    cos: torch.Tensor
    sin: torch.Tensor
    attend: Callable[..., torch.Tensor]
    host: torch.Tensor


@dataclass
class _Layer:
    attn_norm: torch.Tensor
    qkv: torch.Tensor
    out: torch.Tensor
    ffn_norm: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    var = x.float().pow(2).mean(-1, keepdim=True)
    return (x.float() * torch.rsqrt(var + eps)).to(x.dtype) * weight


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE in the half-split form Llama checkpoints use in Hugging Face's layout."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin
