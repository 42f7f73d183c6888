"""Pure-JAX Based linear attention: the CPU fallback and the oracle the kernels are tested against.

Based (Arora et al., 2024) replaces softmax(q.k) with a second-order Taylor approximation of exp:

    phi(q) . phi(k) = 1 + s + s^2 / 2,      s = q . k / sqrt(d),   d = 16 (feature dim)

with the explicit feature map

    phi(x) = [1,  x / d^(1/4),  vec(x x^T) / (sqrt(2) sqrt(d))]      (1 + 16 + 256 = 273 features).

Causal output at token t (per batch and head):

    num_t = sum_{j<=t} (phi(q_t) . phi(k_j)) v_j          den_t = sum_{j<=t} phi(q_t) . phi(k_j)
    y_t   = num_t / (den_t + eps)   if normalize   else   num_t

The recurrent state after the last token is S = sum_j phi(k_j) v_j^T  [273, Dv] and
z = sum_j phi(k_j)  [273]; an initial state (S0, z0) adds phi(q_t) S0 to num_t and phi(q_t) . z0
to den_t, so prefill can be split into pieces and continued by decode steps.

The sequence is processed in chunks of C tokens (`lax.scan` over chunks carries S and z):
inside a chunk the quadratic form tril(1 + s + s^2/2) V is cheap (C x C), and everything
before the chunk is summarised by the carried state. Every state and sum is float32.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

FEATURE_DIM = 16
NUM_FEATURES = 1 + FEATURE_DIM + FEATURE_DIM * FEATURE_DIM  # 273

# The reference is the oracle for the kernels on GPU too, where float32 matmuls at default
# precision may run as TF32 (10-bit mantissa): ask for full float32.
_PRECISION = lax.Precision.HIGHEST


def taylor_feature_map(x: jax.Array) -> jax.Array:
    """phi(x) for x [..., d] -> float32 [..., 1 + d + d*d], so phi(q).phi(k) = 1 + s + s^2/2."""
    d = x.shape[-1]
    x = x.astype(jnp.float32)
    order0 = jnp.ones(x.shape[:-1] + (1,), jnp.float32)
    order1 = x / d**0.25
    # An einsum rather than broadcasting: XLA differentiates it into a batched mat-vec, which
    # runs ~20x faster on CPU than the broadcast-and-reduce the other form becomes.
    outer = jnp.einsum("...i,...j->...ij", x, x, precision=_PRECISION)
    order2 = outer.reshape(x.shape[:-1] + (d * d,)) / (math.sqrt(2.0) * math.sqrt(d))
    return jnp.concatenate([order0, order1, order2], axis=-1)


def _dot(subscripts: str, a: jax.Array, b: jax.Array) -> jax.Array:
    return jnp.einsum(subscripts, a, b, precision=_PRECISION, preferred_element_type=jnp.float32)


def _zero_state(like, batch: int, heads: int, num_features: int, value_dim: int):
    # zeros_like(`like`): inside shard_map the state then has the inputs' device-varying type,
    # as the chunk scan's carry must.
    return (jnp.zeros_like(like, jnp.float32, shape=(batch, heads, num_features, value_dim)),
            jnp.zeros_like(like, jnp.float32, shape=(batch, heads, num_features)))


def based_forward(q, k, v, *, normalize: bool, eps: float, initial_state=None, chunk: int = 64):
    """Causal Based linear attention, chunked.

    q, k: [B, T, H, d] (d = 16 in Based; any d works here), v: [B, T, H, Dv].
    initial_state: None or (S0 [B, H, 1+d+d*d, Dv] f32, z0 [B, H, 1+d+d*d] f32).
    Returns (y [B, T, H, Dv] in v's dtype, (S [B, H, 1+d+d*d, Dv] f32, z [B, H, 1+d+d*d] f32)).
    No input checks here: the public wrapper (tk_jax.linear_attention) does them.
    """
    batch, seq_len, heads, d = q.shape
    value_dim = v.shape[-1]
    num_features = 1 + d + d * d
    if initial_state is None:
        initial_state = _zero_state(v, batch, heads, num_features, value_dim)
    state0 = tuple(s.astype(jnp.float32) for s in initial_state)

    # Pad T up to a multiple of the chunk. Padded keys must be masked out explicitly:
    # phi(0) = [1, 0, ...] is not zero, so a zero key would still add 1 to the normaliser z.
    num_chunks = -(-seq_len // chunk)
    padded_len = num_chunks * chunk
    pad = padded_len - seq_len

    def to_chunks(x):
        # [B, T, H, X] -> [num_chunks, B, H, chunk, X] (the scan walks the leading axis)
        x = jnp.pad(x.astype(jnp.float32), ((0, 0), (0, pad), (0, 0), (0, 0)))
        x = x.reshape(batch, num_chunks, chunk, heads, x.shape[-1])
        return x.transpose(1, 0, 3, 2, 4)

    key_is_real = (jnp.arange(padded_len) < seq_len).reshape(num_chunks, chunk)
    causal = jnp.tril(jnp.ones((chunk, chunk), dtype=bool))
    scale = 1.0 / math.sqrt(d)

    def one_chunk(state, inputs):
        s_prev, z_prev = state
        q_c, k_c, v_c, real = inputs  # [B, H, C, d], [B, H, C, d], [B, H, C, Dv], [C]

        # Tokens of this chunk against each other: the quadratic form, masked causally.
        s = _dot("bhcd,bhed->bhce", q_c, k_c) * scale
        weights = 1.0 + s + 0.5 * s * s
        weights = jnp.where(causal & real[None, :], weights, 0.0)
        num = _dot("bhce,bhev->bhcv", weights, v_c)
        den = weights.sum(axis=-1)

        # Everything before this chunk, through the carried state.
        phi_q = taylor_feature_map(q_c)
        num = num + _dot("bhcf,bhfv->bhcv", phi_q, s_prev)
        den = den + _dot("bhcf,bhf->bhc", phi_q, z_prev)

        # Fold this chunk's (real) keys into the state for the chunks after it.
        phi_k = jnp.where(real[:, None], taylor_feature_map(k_c), 0.0)
        s_next = s_prev + _dot("bhcf,bhcv->bhfv", phi_k, v_c)
        z_next = z_prev + phi_k.sum(axis=-2)
        return (s_next, z_next), (num, den)

    (s_final, z_final), (num, den) = lax.scan(
        one_chunk, state0, (to_chunks(q), to_chunks(k), to_chunks(v), key_is_real))

    y = num / (den[..., None] + eps) if normalize else num
    # [num_chunks, B, H, C, Dv] -> [B, T, H, Dv]
    y = y.transpose(1, 0, 3, 2, 4).reshape(batch, padded_len, heads, value_dim)[:, :seq_len]
    return y.astype(v.dtype), (s_final, z_final)


def based_decode_step_reference(q_t, k_t, v_t, state, *, normalize: bool, eps: float):
    """One token of recurrent Based attention.

    q_t, k_t: [..., H, d], v_t: [..., H, Dv], state: (S [..., H, F, Dv] f32, z [..., H, F] f32)
    with F = 1 + d + d*d. The new token attends to itself, so the state is updated first.
    Returns (y_t [..., H, Dv] in v_t's dtype, (S', z')).
    """
    s_prev, z_prev = state
    phi_k = taylor_feature_map(k_t)
    s_next = s_prev + phi_k[..., :, None] * v_t.astype(jnp.float32)[..., None, :]
    z_next = z_prev + phi_k
    phi_q = taylor_feature_map(q_t)
    num = _dot("...f,...fv->...v", phi_q, s_next)
    if normalize:
        den = _dot("...f,...f->...", phi_q, z_next)
        num = num / (den[..., None] + eps)
    return num.astype(v_t.dtype), (s_next, z_next)
