"""SwiGLU feed-forward block (Flax NNX)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.typing import DTypeLike


class SwiGLU(nnx.Module):
    """x [..., d_model] -> down(silu(gate(x)) * up(x)), hidden width `hidden_dim`."""

    def __init__(self, d_model: int, hidden_dim: int, *, dtype: DTypeLike = jnp.float32,
                 rngs: nnx.Rngs):
        def linear(d_in, d_out):
            return nnx.Linear(d_in, d_out, use_bias=False, dtype=dtype, rngs=rngs)

        self.gate_proj = linear(d_model, hidden_dim)
        self.up_proj = linear(d_model, hidden_dim)
        self.down_proj = linear(hidden_dim, d_model)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down_proj(nnx.silu(self.gate_proj(x)) * self.up_proj(x))
