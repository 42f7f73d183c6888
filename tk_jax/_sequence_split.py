"""Splitting a Based sequence across thread blocks when batch x heads is too small to fill a GPU.

The Based kernels give each (batch, head, 64 value columns) one thread block that walks the
whole sequence; with few of them (one sequence being prefilled, say) most SMs idle. Cutting
the sequence into G groups of L tokens and running them as a batch of B * G gives G times the
blocks. Each group must then start from the state of everything before it:

  forward:  pass 1 runs the groups from zero states; their final states are the per-group
            sums phi(K_g)^T [V_g, 1]. An exclusive prefix sum over the groups (plus S0, z0)
            gives every group its start; pass 2 runs the groups from those starts for y, the
            normaliser and the final state.
  backward: pass 1 runs the groups with zero cotangents at their ends: its dq is already
            right (the dq sweep only reads the start states), and its dS0 is each group's own
            sum phi(Q_g)^T dnum'_g. A reverse exclusive prefix sum (plus dS, dz) gives every
            group the cotangent at its end; pass 2 runs with those for dk, dv and dS0.

Each pass costs about one unsplit call, so a split pays when it multiplies the blocks by 4 or
more. The sequence is padded with zero tokens to G * L: they add nothing to S (v = 0) or to
the backward (dy = 0), but 1 each to the constant feature of z, which is taken off again.

The kernels' column block and chunk come from the extension (tk_jax._kernels.based_conventions,
defined in cpp/kernels/based/based.h), looked up through the package at call time so that the
tests' kernel_path fixture can stand in for the kernels on a CPU.
"""
from __future__ import annotations

import math

import jax.numpy as jnp
from jax import lax

import tk_jax._kernels

MIN_GROUP_TOKENS = 256    # shorter groups spend more on the extra pass than they gain
MIN_GROUPS = 4            # two passes: fewer groups than this cannot pay off


def _conventions():
    return tk_jax._kernels.based_conventions()


def num_groups(batch: int, heads: int, value_dim: int, seq_len: int, num_sms: int) -> int:
    """How many groups to cut the sequence into (1: no split): the largest power of two that
    keeps all blocks in one wave on `num_sms` multiprocessors and groups >= 256 tokens."""
    blocks = batch * heads * max(1, value_dim // _conventions()["column_block"])
    groups = 1
    while blocks * groups * 2 <= num_sms and seq_len >= 2 * groups * MIN_GROUP_TOKENS:
        groups *= 2
    return groups if groups >= MIN_GROUPS else 1


def multiprocessor_count() -> int:
    """SMs of the device the kernels run on (from the CUDA runtime, through the extension)."""
    return tk_jax._kernels.multiprocessor_count()


def _padded_length(seq_len: int, groups: int) -> int:
    """G groups of whole chunks."""
    chunk = _conventions()["chunk"]
    return math.ceil(seq_len / (groups * chunk)) * groups * chunk


def _to_groups(x, groups: int, padded_len: int):
    """[B, T, ...] -> [B * G, L, ...], zeros appended to T first."""
    pad = [(0, 0)] * x.ndim
    pad[1] = (0, padded_len - x.shape[1])
    x = jnp.pad(x, pad)
    return x.reshape((x.shape[0] * groups, padded_len // groups) + x.shape[2:])


def _from_groups(x, batch: int, seq_len: int):
    """[B * G, L, ...] -> [B, T, ...]."""
    return x.reshape((batch, -1) + x.shape[2:])[:, :seq_len]


def _stats_to_groups(x, groups: int, padded_len: int, fill: float):
    """[B, H, T] -> [B * G, H, L], padded with `fill`."""
    batch, heads, seq_len = x.shape
    x = jnp.pad(x, ((0, 0), (0, 0), (0, padded_len - seq_len)), constant_values=fill)
    x = x.reshape(batch, heads, groups, padded_len // groups).transpose(0, 2, 1, 3)
    return x.reshape(batch * groups, heads, padded_len // groups)


def _stats_from_groups(x, batch: int, seq_len: int):
    """[B * G, H, L] -> [B, H, T]."""
    groups_heads = x.reshape((batch, -1) + x.shape[1:]).transpose(0, 2, 1, 3)
    return groups_heads.reshape(batch, x.shape[1], -1)[..., :seq_len]


def _per_group(x, batch: int):
    """[B * G, ...] -> [B, G, ...]."""
    return x.reshape((batch, -1) + x.shape[1:])


def _exclusive_prefix_sum(x, *, reverse: bool = False):
    """Over axis 1: sum of the entries before (or, reversed, after) each one."""
    zeros = jnp.zeros_like(x[:, :1])
    if reverse:
        return jnp.concatenate([lax.cumsum(x[:, 1:], axis=1, reverse=True), zeros], axis=1)
    return jnp.concatenate([zeros, jnp.cumsum(x[:, :-1], axis=1)], axis=1)


def _plus_prefix(total, parts, batch: int, *, reverse: bool = False):
    """total [B, ...] + the exclusive prefix sums of parts [B * G, ...] over the groups."""
    return (total[:, None] + _exclusive_prefix_sum(_per_group(parts, batch), reverse=reverse)
            ).reshape(parts.shape)


def forward(kernel, q, k, v, s0, z0, groups: int, *, normalize: bool, eps: float):
    """The forward kernel over G groups. kernel(q, k, v, s0, z0, normalize=, eps=) ->
    (y, S, z, den) is the (partitioned) kernel call. Returns (y, (S, z), den, starts), where
    starts = the groups' start states, a residual for backward()."""
    batch, seq_len = q.shape[:2]
    padded = _padded_length(seq_len, groups)
    gq, gk, gv = (_to_groups(x, groups, padded) for x in (q, k, v))
    zero_s = jnp.zeros_like(gv, jnp.float32, shape=(gv.shape[0],) + s0.shape[1:])
    zero_z = jnp.zeros_like(gv, jnp.float32, shape=(gv.shape[0],) + z0.shape[1:])
    _, sum_s, sum_z, _ = kernel(gq, gk, gv, zero_s, zero_z, normalize=normalize, eps=eps)
    start_s, start_z = _plus_prefix(s0, sum_s, batch), _plus_prefix(z0, sum_z, batch)
    y, end_s, end_z, den = kernel(gq, gk, gv, start_s, start_z, normalize=normalize, eps=eps)
    # The padded tokens counted 1 each in the constant feature (index 0) of z.
    constant_feature = (jnp.arange(z0.shape[-1]) == 0).astype(jnp.float32)
    z = _per_group(end_z, batch)[:, -1] - (padded - seq_len) * constant_feature
    return (_from_groups(y, batch, seq_len), (_per_group(end_s, batch)[:, -1], z),
            _stats_from_groups(den, batch, seq_len), (start_s, start_z))


def backward(kernel, q, k, v, y, den, dy, starts, d_state, d_z, *, normalize: bool, eps: float):
    """The backward kernel over the groups of forward(); kernel(q, k, v, y, den, dy, s0, z0, dS,
    dz, normalize=, eps=, with_dq=) -> (dq, dk, dv, dS0, dz0). Returns the same for the whole
    sequence."""
    batch, seq_len = q.shape[:2]
    start_s, start_z = starts
    groups = start_s.shape[0] // batch
    padded = _padded_length(seq_len, groups)
    gq, gk, gv, gy, gdy = (_to_groups(x, groups, padded) for x in (q, k, v, y, dy))
    gden = _stats_to_groups(den, groups, padded, fill=1.0)  # padded rows: dy = 0, den finite
    run = lambda end_s, end_z, with_dq: kernel(gq, gk, gv, gy, gden, gdy, start_s, start_z, end_s,
                                               end_z, normalize=normalize, eps=eps, with_dq=with_dq)
    dq, _, _, own_s, own_z = run(jnp.zeros_like(start_s), jnp.zeros_like(start_z), True)
    end_s = _plus_prefix(d_state, own_s, batch, reverse=True)
    end_z = _plus_prefix(d_z, own_z, batch, reverse=True)
    _, dk, dv, ds0, dz0 = run(end_s, end_z, False)  # dq is pass 1's: skip its sweep here
    dq, dk, dv = (_from_groups(g, batch, seq_len) for g in (dq, dk, dv))
    return dq, dk, dv, _per_group(ds0, batch)[:, 0], _per_group(dz0, batch)[:, 0]
