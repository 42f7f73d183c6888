"""Based linear-attention layer (Flax NNX)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.typing import DTypeLike

from tk_jax.linear_attention import FEATURE_DIM, based_linear_attention

OUTPUT_NORMS = ("denominator", "rmsnorm")


class BasedLinearAttention(nnx.Module):
    """Causal Based linear attention: x [B, T, d_model] -> [B, T, d_model].

    Queries and keys are projected to 16 features per head (the Taylor feature map expands
    them to 273 inside tk_jax.based_linear_attention), values to `head_dim` per head.

    output_norm:
      "denominator": y_t = num_t / (den_t + eps), the normalised form of the Based paper.
      "rmsnorm":     y_t = RMSNorm(num_t) per head (learned scale), no denominator; the
                     unnormalised sum grows with t, and the norm takes that scale out.
    """

    def __init__(self, d_model: int, num_heads: int, *, head_dim: int | None = None,
                 output_norm: str = "denominator", eps: float = 1e-6,
                 dtype: DTypeLike = jnp.float32, backend: str = "auto", rngs: nnx.Rngs):
        if output_norm not in OUTPUT_NORMS:
            raise ValueError(f"BasedLinearAttention: output_norm={output_norm!r} is not one of "
                             f"{OUTPUT_NORMS}")
        head_dim = head_dim or d_model // num_heads
        self.num_heads, self.head_dim = num_heads, head_dim
        self.output_norm, self.eps, self.backend = output_norm, eps, backend

        def linear(d_in, d_out):
            return nnx.Linear(d_in, d_out, use_bias=False, dtype=dtype, rngs=rngs)

        self.q_proj = linear(d_model, num_heads * FEATURE_DIM)
        self.k_proj = linear(d_model, num_heads * FEATURE_DIM)
        self.v_proj = linear(d_model, num_heads * head_dim)
        self.out_proj = linear(num_heads * head_dim, d_model)
        if output_norm == "rmsnorm":
            # One RMSNorm over each head's head_dim outputs (scale shared by the heads).
            self.head_norm = nnx.RMSNorm(head_dim, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        batch, seq_len, _ = x.shape
        split_heads = lambda t: t.reshape(batch, seq_len, self.num_heads, -1)
        q = split_heads(self.q_proj(x))
        k = split_heads(self.k_proj(x))
        v = split_heads(self.v_proj(x))
        y = based_linear_attention(q, k, v, normalize=self.output_norm == "denominator",
                                   eps=self.eps, backend=self.backend)
        if self.output_norm == "rmsnorm":
            y = self.head_norm(y)
        return self.out_proj(y.reshape(batch, seq_len, self.num_heads * self.head_dim))
