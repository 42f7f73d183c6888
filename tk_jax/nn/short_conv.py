"""Gated short causal convolution mixer (Flax NNX), the local token mixer of Based models."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.typing import DTypeLike


def causal_depthwise_conv(x: jax.Array, weight: jax.Array, bias: jax.Array) -> jax.Array:
    """y_t = bias + sum_i weight[i] * x_{t-i} per channel (x_{<0} = 0).

    x [B, T, C], weight [K, C], bias [C]. K is small (3-4), so a sum of K shifted copies is
    simpler and as fast as a convolution call.
    """
    kernel_size = weight.shape[0]
    seq_len = x.shape[1]
    padded = jnp.pad(x, ((0, 0), (kernel_size - 1, 0), (0, 0)))
    y = bias
    for shift in range(kernel_size):
        # padded[:, K-1-shift + t] == x[:, t - shift]
        start = kernel_size - 1 - shift
        y = y + weight[shift] * padded[:, start:start + seq_len]
    return y


class GatedShortConv(nnx.Module):
    """x [B, T, d_model] -> out_proj(conv(u) * silu(gate)), with (u, gate) = in_proj(x).

    The causal conv lets each token see the few tokens before it (e.g. a value token sees its
    key: what associative recall needs); the gate makes the mixing input dependent.
    """

    def __init__(self, d_model: int, *, kernel_size: int = 4, dtype: DTypeLike = jnp.float32,
                 rngs: nnx.Rngs):
        if kernel_size < 1:
            raise ValueError(f"GatedShortConv: kernel_size must be >= 1, got {kernel_size}")
        self.dtype = dtype
        self.in_proj = nnx.Linear(d_model, 2 * d_model, use_bias=False, dtype=dtype, rngs=rngs)
        bound = 1.0 / kernel_size**0.5
        self.conv_weight = nnx.Param(
            jax.random.uniform(rngs.params(), (kernel_size, d_model), minval=-bound, maxval=bound))
        self.conv_bias = nnx.Param(jnp.zeros((d_model,)))
        self.out_proj = nnx.Linear(d_model, d_model, use_bias=False, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        u, gate = jnp.split(self.in_proj(x), 2, axis=-1)
        u = causal_depthwise_conv(u, self.conv_weight[...].astype(self.dtype),
                                  self.conv_bias[...].astype(self.dtype))
        return self.out_proj(u * nnx.silu(gate))
