"""Public Based linear attention: input checks, backend choice and the custom_vjp.

    y = based_linear_attention(q, k, v)                                  # causal, normalised
    y, (S, z) = based_linear_attention(q, k, v, return_state=True)       # prefill
    y_t, (S, z) = based_decode_step(q_t, k_t, v_t, (S, z))               # then one token at a time

The math is documented in tk_jax/reference/based.py. On a Hopper GPU the forward and backward run
the compiled kernels for supported inputs (bf16/fp16, value dim 64 or 128); elsewhere the
pure-JAX reference runs, and its backward recomputes the forward.
`based_fwd_impl` / `based_bwd_impl` below are the dispatch points.
"""
from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from tk_jax import _kernels, _partitioning, _sequence_split
from tk_jax._backend import select_backend
from tk_jax._checks import check_array, check_bool, check_same
from tk_jax.reference import based as reference

FEATURE_DIM = reference.FEATURE_DIM      # 16: the q/k feature dim of Based
NUM_FEATURES = reference.NUM_FEATURES    # 273: 1 + 16 + 16*16 Taylor features


class BasedState(NamedTuple):
    """Recurrent state: S = sum_j phi(k_j) v_j^T [..., H, 273, Dv], z = sum_j phi(k_j) [..., H, 273]
    (float32). A plain (S, z) tuple is accepted wherever a state is."""
    S: jax.Array
    z: jax.Array


# ---------------------------------------------------------------------------------------------
# Dispatch point for the compiled kernels. Inputs here are already checked and rank-4:
# q, k [B, T, H, 16], v [B, T, H, Dv], initial_state None or (S0 [B,H,273,Dv], z0 [B,H,273]).
# ---------------------------------------------------------------------------------------------

def _based_kernel_unsupported(q, k, v, *, normalize, initial_state) -> str | None:
    """Why the kernel cannot run these inputs (a sentence), or None when it can.
    The kernel takes every option (normalize, eps, initial_state); only shapes/dtypes limit it."""
    return _kernels.based_kernel_unsupported(q, k, v)


def _kernel_start_state(v, initial_state):
    """The kernels always start from a state: zeros when there is none (zeros_like(v), so that
    under shard_map they vary over devices like the inputs)."""
    if initial_state is not None:
        return initial_state
    batch, _, heads, value_dim = v.shape
    return reference._zero_state(v, batch, heads, NUM_FEATURES, value_dim)


def based_fwd_impl(q, k, v, initial_state, *, normalize, eps, backend):
    """Forward. Returns ((y, (S, z)), residuals for based_bwd_impl)."""
    if backend == "kernel":
        batch, seq_len, heads, value_dim = v.shape
        s0, z0 = _kernel_start_state(v, initial_state)
        # The partitioning rule lets a sharded jit run the kernel per (batch, head) shard.
        kernel = _partitioning.partitioned_based_fwd(_kernels.based_fwd)
        groups = _sequence_split.num_groups(batch, heads, value_dim, seq_len,
                                            _sequence_split.multiprocessor_count())
        if groups > 1:  # too few (batch, head) blocks to fill the GPU: split the sequence
            y, (s, z), den, starts = _sequence_split.forward(
                kernel, q, k, v, s0, z0, groups, normalize=normalize, eps=eps)
        else:
            (y, s, z, den), starts = kernel(q, k, v, s0, z0, normalize=normalize, eps=eps), None
        # The backward kernel needs y and the normaliser den ([B, H, T] floats) besides the
        # inputs, and with a split the groups' start states.
        return (y, (s, z)), (q, k, v, initial_state, y, den, starts)
    outputs = reference.based_forward(q, k, v, normalize=normalize, eps=eps,
                                      initial_state=initial_state)
    # The reference backward recomputes the forward from the inputs: only the inputs are kept
    # between the passes, not the per-chunk intermediates (memory stays low in deep models).
    return outputs, (q, k, v, initial_state)


def based_bwd_impl(residuals, cotangents, *, normalize, eps, backend):
    """Backward. cotangents = (dy, (dS, dz)); returns (dq, dk, dv, d_initial_state)."""
    dy, (d_state, d_z) = cotangents
    if backend == "kernel":
        q, k, v, initial_state, y, den, starts = residuals
        kernel = _partitioning.partitioned_based_bwd(_kernels.based_bwd)
        if starts is not None:  # the forward split the sequence: so does the backward
            dq, dk, dv, ds0, dz0 = _sequence_split.backward(
                kernel, q, k, v, y, den, dy, starts, d_state, d_z, normalize=normalize, eps=eps)
        else:
            s0, z0 = _kernel_start_state(v, initial_state)
            dq, dk, dv, ds0, dz0 = kernel(q, k, v, y, den, dy, s0, z0, d_state, d_z,
                                          normalize=normalize, eps=eps)
        return dq, dk, dv, (None if initial_state is None else (ds0, dz0))

    q, k, v, initial_state = residuals

    def forward(q, k, v, initial_state):
        return reference.based_forward(q, k, v, normalize=normalize, eps=eps,
                                       initial_state=initial_state)

    _, vjp = jax.vjp(forward, q, k, v, initial_state)
    return vjp(cotangents)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _based(q, k, v, initial_state, normalize, eps, backend):
    outputs, _ = based_fwd_impl(q, k, v, initial_state, normalize=normalize, eps=eps,
                                backend=backend)
    return outputs


def _based_fwd(q, k, v, initial_state, normalize, eps, backend):
    return based_fwd_impl(q, k, v, initial_state, normalize=normalize, eps=eps, backend=backend)


def _based_bwd(normalize, eps, backend, residuals, cotangents):
    return based_bwd_impl(residuals, cotangents, normalize=normalize, eps=eps, backend=backend)


_based.defvjp(_based_fwd, _based_bwd)


# ---------------------------------------------------------------------------------------------
# Input checks
# ---------------------------------------------------------------------------------------------

def _check_eps(eps, op: str) -> float:
    """eps is static (a Python number): it is baked into the compiled computation."""
    if isinstance(eps, bool) or not isinstance(eps, (int, float, np.integer, np.floating)):
        raise TypeError(f"{op}: eps must be a Python number (finite, >= 0), got {eps!r}")
    eps = float(eps)
    if not math.isfinite(eps) or eps < 0:
        raise ValueError(f"{op}: eps must be finite and >= 0, got {eps}")
    return eps


def _check_feature_dim(x, name: str, op: str) -> None:
    if x.shape[-1] != FEATURE_DIM:
        raise ValueError(
            f"{op}: {name} must have feature dim (last axis) {FEATURE_DIM}, got shape "
            f"{tuple(x.shape)}; project queries and keys to {FEATURE_DIM} features first")


def _check_qkv(arrays: dict, *, min_ndim: int, axes: str, op: str) -> None:
    """q, k, v (under the names given, in that order): arrays of equal rank >= min_ndim, q and k
    with feature dim 16, all three alike in every axis but the last (`axes` names those axes
    for the message) and in dtype."""
    for name, x in arrays.items():
        check_array(x, name, min_ndim=min_ndim, op=op)
    check_same({name: x.ndim for name, x in arrays.items()}, "ranks", op)
    (q_name, q), (k_name, k) = list(arrays.items())[:2]
    _check_feature_dim(q, q_name, op)
    _check_feature_dim(k, k_name, op)
    check_same({name: tuple(x.shape[:-1]) for name, x in arrays.items()},
               f"shapes {axes} (all but the last axis)", op)
    check_same({name: x.dtype for name, x in arrays.items()}, "dtypes", op)


def _check_state(state, name: str, *, batch_heads: tuple, value_dim: int, op: str):
    """state is (S [*batch_heads, 273, Dv] f32, z [*batch_heads, 273] f32); returns a tuple."""
    if not isinstance(state, (tuple, list)) or len(state) != 2:
        raise TypeError(f"{op}: {name} must be a pair (S, z) of arrays, got {type(state).__name__}")
    s, z = state
    expected = {f"{name}[0] (S)": (s, batch_heads + (NUM_FEATURES, value_dim)),
                f"{name}[1] (z)": (z, batch_heads + (NUM_FEATURES,))}
    for label, (x, shape) in expected.items():
        check_array(x, label, min_ndim=len(shape), dtypes=(jnp.float32,), op=op)
        if tuple(x.shape) != shape:
            raise ValueError(f"{op}: {label} must have shape {shape}, got {tuple(x.shape)}")
    return s, z


# ---------------------------------------------------------------------------------------------
# Public functions
# ---------------------------------------------------------------------------------------------

def based_linear_attention(
        q: jax.Array, k: jax.Array, v: jax.Array, *, normalize: bool = True, eps: float = 1e-6,
        initial_state: tuple[jax.Array, jax.Array] | None = None, return_state: bool = False,
        backend: str = "auto") -> jax.Array | tuple[jax.Array, BasedState]:
    """Causal Based linear attention (Taylor feature map, feature dim 16).

    Args:
      q, k: [..., T, H, 16] bf16, fp16 or float32 (at least one leading batch dim; extra
        leading dims are folded into the batch).
      v: [..., T, H, Dv], same dtype and leading dims as q.
      normalize: divide by the normaliser sum_j phi(q_t).phi(k_j) (+ eps).
      eps: finite Python number >= 0 added to the normaliser.
      initial_state: None or (S0 [..., H, 273, Dv] f32, z0 [..., H, 273] f32), e.g. the state
        returned by an earlier call on the preceding tokens.
      return_state: also return the state after the last token.
      backend: "auto" | "kernel" | "reference".

    Returns:
      y [..., T, H, Dv] in v's dtype; with return_state, (y, BasedState(S, z)).

    Differentiable in q, k, v and initial_state in reverse mode (grad, vjp); a custom_vjp
    has no forward mode, so jax.jvp raises.
    """
    op = "based_linear_attention"
    _check_qkv({"q": q, "k": k, "v": v}, min_ndim=4, axes="[..., T, H]", op=op)
    normalize = check_bool(normalize, "normalize", op)
    return_state = check_bool(return_state, "return_state", op)
    eps = _check_eps(eps, op)

    batch_shape = tuple(q.shape[:-3])
    seq_len, heads = q.shape[-3], q.shape[-2]
    value_dim = v.shape[-1]
    if initial_state is not None:
        initial_state = _check_state(initial_state, "initial_state",
                                     batch_heads=batch_shape + (heads,), value_dim=value_dim,
                                     op=op)

    # Fold leading batch dims into one: the implementations see rank-4 inputs.
    batch = math.prod(batch_shape)
    q4 = q.reshape(batch, seq_len, heads, FEATURE_DIM)
    k4 = k.reshape(batch, seq_len, heads, FEATURE_DIM)
    v4 = v.reshape(batch, seq_len, heads, value_dim)
    if initial_state is not None:
        initial_state = (initial_state[0].reshape(batch, heads, NUM_FEATURES, value_dim),
                         initial_state[1].reshape(batch, heads, NUM_FEATURES))

    which = select_backend(
        backend, op=op,
        unsupported=_based_kernel_unsupported(q4, k4, v4, normalize=normalize,
                                              initial_state=initial_state))
    y, (s, z) = _based(q4, k4, v4, initial_state, normalize, eps, which)

    y = y.reshape(batch_shape + (seq_len, heads, value_dim))
    if not return_state:
        return y
    state = BasedState(s.reshape(batch_shape + (heads, NUM_FEATURES, value_dim)),
                       z.reshape(batch_shape + (heads, NUM_FEATURES)))
    return y, state


def based_decode_step(
        q_t: jax.Array, k_t: jax.Array, v_t: jax.Array, state: tuple[jax.Array, jax.Array], *,
        normalize: bool = True, eps: float = 1e-6,
        backend: str = "auto") -> tuple[jax.Array, BasedState]:
    """One generation step of Based attention (jit, vmap and grad work as usual).

    Args:
      q_t, k_t: [..., H, 16] (the new token's query and key), v_t: [..., H, Dv]; same dtype.
      state: (S [..., H, 273, Dv] f32, z [..., H, 273] f32), e.g. from
        based_linear_attention(..., return_state=True) or an earlier decode step.
      backend: "auto" | "kernel" | "reference". The kernel (bf16/fp16, Dv 64 or 128) reads and
        writes the state once, in place when the old state is not used afterwards (as in a
        jitted generation loop); its gradient comes from the reference.
    Returns:
      (y_t [..., H, Dv] in v_t's dtype, BasedState(S', z')) where the new token is included.
    """
    op = "based_decode_step"
    _check_qkv({"q_t": q_t, "k_t": k_t, "v_t": v_t}, min_ndim=2, axes="[..., H]", op=op)
    normalize = check_bool(normalize, "normalize", op)
    eps = _check_eps(eps, op)
    batch_heads = tuple(q_t.shape[:-1])
    state = _check_state(state, "state", batch_heads=batch_heads, value_dim=v_t.shape[-1], op=op)

    which = select_backend(backend, op=op, unsupported=_decode_kernel_unsupported(q_t, v_t))
    # Fold leading dims into one batch dim: the implementations see [B, H, ...].
    batch, heads, value_dim = math.prod(batch_heads[:-1]), batch_heads[-1], v_t.shape[-1]
    q3, k3 = (x.reshape(batch, heads, FEATURE_DIM) for x in (q_t, k_t))
    v3 = v_t.reshape(batch, heads, value_dim)
    state3 = (state[0].reshape(batch, heads, NUM_FEATURES, value_dim),
              state[1].reshape(batch, heads, NUM_FEATURES))
    y, (s, z) = _decode(q3, k3, v3, state3, normalize, eps, which)
    return y.reshape(v_t.shape), BasedState(s.reshape(state[0].shape), z.reshape(state[1].shape))


def _decode_kernel_unsupported(q_t, v_t) -> str | None:
    return _kernels.based_decode_unsupported(q_t, v_t)


def _decode_impl(q_t, k_t, v_t, state, normalize, eps, backend):
    if backend == "kernel":
        kernel = _partitioning.partitioned_based_decode(_kernels.based_decode)
        y, s, z = kernel(q_t, k_t, v_t, *state, normalize=normalize, eps=eps)
        return y, (s, z)
    return reference.based_decode_step_reference(q_t, k_t, v_t, state, normalize=normalize,
                                                 eps=eps)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _decode(q_t, k_t, v_t, state, normalize, eps, backend):
    return _decode_impl(q_t, k_t, v_t, state, normalize, eps, backend)


def _decode_fwd(q_t, k_t, v_t, state, normalize, eps, backend):
    return _decode_impl(q_t, k_t, v_t, state, normalize, eps, backend), (q_t, k_t, v_t, state)


def _decode_bwd(normalize, eps, backend, residuals, cotangents):
    """Both backends differentiate the reference step (a single token: cheap)."""
    del backend

    def step(q_t, k_t, v_t, state):
        return reference.based_decode_step_reference(q_t, k_t, v_t, state, normalize=normalize,
                                                     eps=eps)

    return jax.vjp(step, *residuals)[1](cotangents)


_decode.defvjp(_decode_fwd, _decode_bwd)
