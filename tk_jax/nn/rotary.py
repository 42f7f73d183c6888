"""Rotary position embedding (RoPE) for the sliding-window attention layer."""
from __future__ import annotations

import jax
import jax.numpy as jnp


def apply_rotary(x: jax.Array, *, base: float = 10000.0) -> jax.Array:
    """Rotate feature pairs (i, i + D/2) of x [B, T, H, D] by angle t * base^(-2i/D).

    Dot products of rotated queries and keys then depend on positions only through t_q - t_k.
    """
    seq_len, head_dim = x.shape[1], x.shape[-1]
    half = head_dim // 2
    inv_freq = base ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angles = jnp.arange(seq_len, dtype=jnp.float32)[:, None] * inv_freq[None, :]  # [T, D/2]
    cos = jnp.cos(angles)[None, :, None, :]
    sin = jnp.sin(angles)[None, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)
    return rotated.astype(x.dtype)
