"""Causal sliding-window softmax attention layer (Flax NNX) on tk_jax.flash_attention."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.typing import DTypeLike

from tk_jax.attention import flash_attention
from tk_jax.nn.rotary import apply_rotary


class SlidingWindowAttention(nnx.Module):
    """Each token attends to itself and the `window - 1` tokens before it (rotary positions).

    x [B, T, d_model] -> [B, T, d_model].
    """

    def __init__(self, d_model: int, num_heads: int, window: int, *,
                 head_dim: int | None = None, rope_base: float = 10000.0,
                 dtype: DTypeLike = jnp.float32, backend: str = "auto", rngs: nnx.Rngs):
        if window < 1:
            raise ValueError(f"SlidingWindowAttention: window must be >= 1, got {window}")
        head_dim = head_dim or d_model // num_heads
        if head_dim % 2:
            raise ValueError(f"SlidingWindowAttention: head_dim must be even for rotary "
                             f"embeddings, got {head_dim}")
        self.num_heads, self.head_dim, self.window = num_heads, head_dim, window
        self.rope_base, self.backend = rope_base, backend

        def linear(d_in, d_out):
            return nnx.Linear(d_in, d_out, use_bias=False, dtype=dtype, rngs=rngs)

        self.q_proj = linear(d_model, num_heads * head_dim)
        self.k_proj = linear(d_model, num_heads * head_dim)
        self.v_proj = linear(d_model, num_heads * head_dim)
        self.out_proj = linear(num_heads * head_dim, d_model)

    def __call__(self, x: jax.Array) -> jax.Array:
        batch, seq_len, _ = x.shape
        split_heads = lambda t: t.reshape(batch, seq_len, self.num_heads, self.head_dim)
        q = apply_rotary(split_heads(self.q_proj(x)), base=self.rope_base)
        k = apply_rotary(split_heads(self.k_proj(x)), base=self.rope_base)
        v = split_heads(self.v_proj(x))
        # window_size=(left, right): a query sees keys j with i - (window-1) <= j <= i.
        o = flash_attention(q, k, v, causal=True, window_size=(self.window - 1, 0),
                            backend=self.backend)
        return self.out_proj(o.reshape(batch, seq_len, self.num_heads * self.head_dim))
