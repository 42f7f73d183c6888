"""Multi-device attention: partitioning rules for the kernel calls, and ring attention.

Two independent parts:

1. `shard_over_batch_and_heads(fn, operands, results)` wraps a per-device attention function
   (the forward kernel, the backward, ...) so that under `jax.jit` with sharded inputs every
   device runs `fn` on its own (batch, head) shard, with no collective. It is built on
   `jax.experimental.custom_partitioning` with a Shardy sharding rule: under plain `jit` the
   shardings of the inputs are only known to the compiler (not while tracing), and
   custom_partitioning is the hook that lets the compiler ask us how to split the call.
   Any other sharded axis (the sequence, head_dim) is gathered first, with a one-time
   warning: splitting the sequence needs a different algorithm, `ring_attention`.
   Inside `shard_map` or `pmap` the call already sees local shards and the rule is not used.

2. `ring_attention(q, k, v, axis_name=...)`, for use inside `shard_map` with the sequence split
   over `axis_name`: the K/V blocks travel around the ring of devices (lax.ppermute) while each
   device computes its queries against the block it holds; partial results are merged by their
   logsumexp. `to_load_balanced` / `from_load_balanced` reorder a sequence so that causal
   attention gives every device the same amount of work.
"""
from __future__ import annotations

import functools
import logging
import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.custom_batching import custom_vmap
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec

# ----------------------------------------------------------------------------------------------
# shard_map across JAX versions: jax.shard_map is the public name in new releases, older ones
# only have jax.experimental.shard_map.shard_map (with check_rep instead of check_vma).


def shard_map(f, *, mesh, in_specs, out_specs):
    """`jax.shard_map` where it exists, else `jax.experimental.shard_map.shard_map`."""
    if hasattr(jax, "shard_map"):
        return jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs)
    from jax.experimental.shard_map import shard_map as experimental_shard_map
    return experimental_shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs)


# ==============================================================================================
# Part 1: partitioning a per-(batch, head) computation under sharded jit.
#
# A layout names each dimension of an array: "b" (batch) and "hq" / "hkv" (query / key-value
# heads) may be split across devices; every other name (tq, tk: sequence; d, e: head dims)
# must be whole on each device. Attention is independent per batch element and per head, so
# splitting b and the heads needs no communication. Grouped-query attention (query head h
# reads kv head h // G): the kv heads are split like the query heads when their count allows
# it; otherwise K/V stay whole on every device and each device picks the kv heads its query
# heads read.

BATCH, Q_HEADS, KV_HEADS = "b", "hq", "hkv"
SEQUENCE_DIMS = ("t", "tq", "tk")
SPLITTABLE = (BATCH, Q_HEADS, KV_HEADS)

# Layouts of the attention halves (see attention_fwd_impl / attention_bwd_impl).
ATTENTION_FWD_LAYOUT = ("b tq hq d, b tk hkv d, b tk hkv e", "b tq hq e, b hq tq")
_BWD_OPERANDS = "b tq hq d, b tk hkv d, b tk hkv e, b tq hq e, b hq tq, b tq hq e"
ATTENTION_BWD_LAYOUT = (_BWD_OPERANDS, "b tq hq d, b tk hkv d, b tk hkv e")
ATTENTION_BWD_WITH_DLSE_LAYOUT = (_BWD_OPERANDS + ", b hq tq", ATTENTION_BWD_LAYOUT[1])
# Based forward: q, k, v, initial S and z -> y, final S and z, den (f features, n = 273 state rows).
BASED_FWD_LAYOUT = ("b t hq f, b t hq f, b t hq e, b hq n e, b hq n",
                    "b t hq e, b hq n e, b hq n, b hq t")
# Based decode step: q_t, k_t, v_t, S, z -> y_t, S', z'.
BASED_DECODE_LAYOUT = ("b hq f, b hq f, b hq e, b hq n e, b hq n", "b hq e, b hq n e, b hq n")
# Based backward: q, k, v, y, den, dy, S0, z0, dS, dz -> dq, dk, dv, dS0, dz0.
BASED_BWD_LAYOUT = ("b t hq f, b t hq f, b t hq e, b t hq e, b hq t, b t hq e, "
                    "b hq n e, b hq n, b hq n e, b hq n",
                    "b t hq f, b t hq f, b t hq e, b hq n e, b hq n")

_warned: set[str] = set()


def _warn_once(key: str, message: str) -> None:
    """Warn once per process. This runs inside XLA's partitioner, where an exception (from a
    warnings filter set to "error") would fail the compilation: such a warning is logged."""
    if key in _warned:
        return
    _warned.add(key)
    try:
        warnings.warn(message, stacklevel=2)
    except Warning:
        logging.getLogger(__name__).warning(message)


def _parse_layouts(text: str) -> tuple[tuple[str, ...], ...]:
    """"b tq hq d, b hq tq" -> (("b", "tq", "hq", "d"), ("b", "hq", "tq"))."""
    layouts = tuple(tuple(part.split()) for part in text.split(","))
    for dims in layouts:
        if not dims or dims[0] != BATCH:
            raise ValueError(f"every layout must start with the batch dim {BATCH!r}: {text!r}")
    return layouts


@functools.lru_cache(maxsize=None)
def shard_over_batch_and_heads(fn, operands: str, results: str):
    """Wrap `fn(*arrays, **static) -> tuple of arrays` with a partitioning rule.

    `operands` and `results` are comma-separated layouts, one per array, e.g.
    ATTENTION_FWD_LAYOUT = ("b tq hq d, b tk hkv d, b tk hkv e", "b tq hq e, b hq tq").
    The wrapper is called like fn (keyword arguments must be hashable Python values: they are
    static) and computes the same thing; under a sharded jit it runs fn once per device on the
    local (batch, head) shard. It also works eagerly, on one device, inside shard_map / pmap
    (where JAX calls fn on the local shards directly, without the rule), and under vmap
    (vmapped axes are folded into the batch).
    """
    return _BatchHeadPartitioned(fn, _parse_layouts(operands), _parse_layouts(results))


class _BatchHeadPartitioned:
    """See shard_over_batch_and_heads. One instance per (fn, layouts)."""

    def __init__(self, fn, operand_dims, result_dims):
        self.fn = fn
        self.operand_dims = operand_dims
        self.result_dims = result_dims
        if Q_HEADS not in operand_dims[0]:
            raise ValueError("the first operand must have query heads (hq): it decides the split")
        rule = (", ".join(" ".join(d) for d in operand_dims) + " -> "
                + ", ".join(" ".join(d) for d in result_dims))
        self._partitioned = custom_partitioning(self._call_fn, static_argnums=(0,))
        self._partitioned.def_partition(
            partition=self._partition,
            infer_sharding_from_operands=self._infer_result_shardings,  # for the GSPMD partitioner
            sharding_rule=rule)

    def __call__(self, *arrays, **static):
        if len(arrays) != len(self.operand_dims):
            raise TypeError(f"expected {len(self.operand_dims)} arrays, got {len(arrays)}")
        static = tuple(sorted(static.items()))
        # custom_partitioning has no vmap rule: fold vmapped axes into the batch ourselves.
        @custom_vmap
        def call(*arrays):
            return tuple(self._partitioned(static, *arrays))

        call.def_vmap(functools.partial(self._vmap_rule, static))
        return call(*arrays)

    def _call_fn(self, static, *arrays):
        return _vary_like(tuple(self.fn(*arrays, **dict(static))), arrays)

    def _vmap_rule(self, static, axis_size, in_batched, *arrays):
        """vmap: [N, B, ...] -> [N * B, ...] for every operand (unmapped ones are broadcast)."""
        folded = []
        for x, batched in zip(arrays, in_batched):
            if not batched:
                x = jnp.broadcast_to(x, (axis_size,) + x.shape)
            folded.append(x.reshape((axis_size * x.shape[1],) + x.shape[2:]))
        outs = self(*folded, **dict(static))
        outs = tuple(o.reshape((axis_size, o.shape[0] // axis_size) + o.shape[1:]) for o in outs)
        return outs, tuple(True for _ in outs)

    # -- the partitioning callbacks (they run inside XLA's partitioner: keep them simple) ----

    def _infer_result_shardings(self, static, mesh, arg_shapes, result_shape):
        plan = _SplitPlan.from_operands(mesh, arg_shapes, self.operand_dims)
        return tuple(plan.sharding(dims) for dims in self.result_dims)

    def _partition(self, static, mesh, arg_shapes, result_shape):
        plan = _SplitPlan.from_operands(mesh, arg_shapes, self.operand_dims)
        arg_shardings = tuple(plan.sharding(dims) for dims in self.operand_dims)
        result_shardings = tuple(plan.sharding(dims) for dims in self.result_dims)

        def per_device(*arrays):
            return plan.run(self.fn, dict(static), arrays, self.operand_dims, self.result_dims)

        return mesh, per_device, result_shardings, arg_shardings


def _varying_axes(x) -> frozenset:
    """The shard_map axes along which x differs between devices, as JAX's type system tracks
    them (empty outside shard_map). The attribute moved between JAX versions."""
    aval = jax.typeof(x) if hasattr(jax, "typeof") else jax.core.get_aval(x)
    vma = getattr(aval, "vma", None)
    if vma is None:
        vma = getattr(getattr(aval, "mat", None), "varying", None)
    return frozenset(vma or ())


def _vary_like(outs, arrays):
    """Type outs as varying wherever the inputs are. An FFI call's results are typed as if they
    were the same on every device; inside shard_map that is wrong for a per-device kernel, and
    autodiff would then sum their cotangents across devices (and custom_vjp refuses the
    mismatch). pcast only changes the type: no data moves."""
    axes = frozenset().union(*(_varying_axes(x) for x in arrays))
    if not axes:
        return outs
    fixed = []
    for out in outs:
        missing = tuple(sorted(axes - _varying_axes(out), key=str))
        if missing:
            out = (lax.pcast(out, missing, to="varying") if hasattr(lax, "pcast")
                   else lax.pvary(out, missing))
        fixed.append(out)
    return tuple(fixed)


def _padded_spec(sharding, ndim: int) -> tuple:
    spec = tuple(sharding.spec) if isinstance(sharding, NamedSharding) else ()
    return spec + (None,) * (ndim - len(spec))


def _axes(entry) -> tuple[str, ...]:
    """A PartitionSpec entry (None, a mesh axis name or a tuple of names) as a tuple."""
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)


def _entry(axes: tuple[str, ...]):
    """Inverse of _axes."""
    if not axes:
        return None
    return axes[0] if len(axes) == 1 else axes


class _SplitPlan:
    """How one call is split: the mesh axes of the batch and of the query heads, and whether
    the kv heads follow the query heads ("split") or stay whole on each device ("pick")."""

    def __init__(self, mesh, batch_axes, head_axes, kv_mode, heads_q, heads_kv):
        self.mesh = mesh
        self.batch_axes = batch_axes
        self.head_axes = head_axes
        self.kv_mode = kv_mode
        self.heads_q = heads_q
        self.heads_kv = heads_kv

    @classmethod
    def from_operands(cls, mesh, arg_shapes, operand_dims):
        q, q_dims = arg_shapes[0], operand_dims[0]
        spec = _padded_spec(q.sharding, len(q.shape))
        sizes = {name: size for dims, a in zip(operand_dims, arg_shapes)
                 for name, size in zip(dims, a.shape)}

        def usable(name):
            """q's mesh axes for dim `name`, if they split it evenly (else keep it whole)."""
            axes = _axes(spec[q_dims.index(name)])
            if axes and sizes[name] % _mesh_size(mesh, axes) != 0:
                _warn_once(f"uneven-{name}", (
                    f"tk_jax: the {name} dimension ({sizes[name]}) is sharded over mesh axes "
                    f"{axes} that do not divide it; it is gathered before the attention call"))
                return ()
            return axes

        batch_axes = usable(BATCH)
        head_axes = usable(Q_HEADS)
        heads_q = sizes[Q_HEADS]
        heads_kv = sizes.get(KV_HEADS, heads_q)
        kv_mode = "split" if heads_kv % _mesh_size(mesh, head_axes) == 0 else "pick"

        # Anything sharded besides batch and heads is gathered: say so, once.
        for dims, a in zip(operand_dims, arg_shapes):
            for name, entry in zip(dims, _padded_spec(a.sharding, len(a.shape))):
                if entry is None or name in SPLITTABLE:
                    continue
                if name in SEQUENCE_DIMS:
                    _warn_once("sequence", (
                        "tk_jax: an attention input is sharded along the sequence axis; the "
                        "kernel call gathers the whole sequence on every device (correct but "
                        "memory-hungry). For sequence parallelism in softmax attention call "
                        "tk_jax.ring_attention inside shard_map instead."))
                else:
                    _warn_once(f"dim-{name}", (
                        f"tk_jax: an attention input is sharded along its {name!r} dimension; "
                        "it is gathered before the attention call"))
        return cls(mesh, batch_axes, head_axes, kv_mode, heads_q, heads_kv)

    def _split_of(self, name):
        if name == BATCH:
            return self.batch_axes
        if name == Q_HEADS or (name == KV_HEADS and self.kv_mode == "split"):
            return self.head_axes
        return ()

    def sharding(self, dims) -> NamedSharding:
        return NamedSharding(self.mesh, PartitionSpec(*(_entry(self._split_of(n)) for n in dims)))

    def run(self, fn, static, arrays, operand_dims, result_dims):
        """The per-device computation: fn on local shards (inside the partitioned program)."""
        if self.kv_mode == "split":
            return tuple(fn(*arrays, **static))
        # "pick": this device holds query heads [first, first + m) of all heads_q; they read
        # kv heads (first + j) // G. K/V arrive whole; take the kv heads needed.
        m = self.heads_q // _mesh_size(self.mesh, self.head_axes)
        group = self.heads_q // self.heads_kv
        first = lax.axis_index(self.head_axes) * m
        if group % m == 0:   # all local query heads read the same kv head
            kv_index = jnp.reshape(first // group, (1,))
        else:                # one kv head per local query head (plain multi-head attention)
            kv_index = (first + jnp.arange(m)) // group
        local = [jnp.take(x, kv_index, axis=dims.index(KV_HEADS)) if KV_HEADS in dims else x
                 for x, dims in zip(arrays, operand_dims)]
        outs = []
        for out, dims in zip(fn(*local, **static), result_dims):
            if KV_HEADS in dims:
                # A kv-head result (dk, dv) sums the contributions of every query head that
                # reads that head; those live on several devices: add them up.
                axis = dims.index(KV_HEADS)
                shape = out.shape[:axis] + (self.heads_kv,) + out.shape[axis + 1:]
                index = (slice(None),) * axis + (kv_index,)
                total = jnp.zeros(shape, jnp.float32).at[index].add(out.astype(jnp.float32))
                out = lax.psum(total, self.head_axes).astype(out.dtype)
            outs.append(out)
        return tuple(outs)


def _mesh_size(mesh, axes) -> int:
    return math.prod(mesh.shape[a] for a in axes)


def on_local_shards(fn):
    """`fn` where its arrays are already this device's shards (inside shard_map): called
    directly, without a partitioning rule, its results typed as varying like the inputs.
    Ring attention calls the kernels this way: its blocks are local already, and a rule would
    only put one more partitioner callback inside the ring's loop."""
    @functools.wraps(fn)
    def call(*arrays, **static):
        return _vary_like(tuple(fn(*arrays, **static)), arrays)
    return call


def partitioned_attention_fwd(fn):
    """`fn(q, k, v, *, scale, window_left, window_right) -> (o, lse)` with the batch/head rule."""
    return shard_over_batch_and_heads(fn, *ATTENTION_FWD_LAYOUT)


def partitioned_based_fwd(fn):
    """`fn(q, k, v, s0, z0, *, normalize, eps) -> (y, s, z, den)` with the batch/head rule."""
    return shard_over_batch_and_heads(fn, *BASED_FWD_LAYOUT)


def partitioned_based_decode(fn):
    """`fn(q_t, k_t, v_t, s, z, *, normalize, eps) -> (y_t, s, z)` with the batch/head rule."""
    return shard_over_batch_and_heads(fn, *BASED_DECODE_LAYOUT)


def partitioned_based_bwd(fn):
    """`fn(q, k, v, y, den, dy, s0, z0, ds, dz, *, normalize, eps) -> (dq, dk, dv, ds0, dz0)`
    with the batch/head rule."""
    return shard_over_batch_and_heads(fn, *BASED_BWD_LAYOUT)


def partitioned_attention_bwd(fn, *, with_dlse: bool):
    """`fn(q, k, v, o, lse, do[, dlse], *, scale, window_left, window_right) -> (dq, dk, dv)`
    with the batch/head rule."""
    layout = ATTENTION_BWD_WITH_DLSE_LAYOUT if with_dlse else ATTENTION_BWD_LAYOUT
    return shard_over_batch_and_heads(fn, *layout)


# ==============================================================================================
# Part 2: ring attention, for a sequence split over a shard_map axis.
#
# Device r holds the queries and keys of its part of the sequence. In step s = 0..n-1 it holds
# the K/V block that started on device src = (r - s) mod n, computes its queries against it and
# merges the result; meanwhile the block moves on to device r + 1. Which (query, key) pairs of a
# step are visible under a causal mask follows from the two devices' chunk positions alone:
#
#   contiguous layout (device r holds chunk r):
#       src == r: the diagonal block (causal mask)  src < r: fully visible  src > r: invisible
#   load-balanced layout (device r holds chunks r and 2n-1-r, as halves of its block):
#       src == r: causal mask on the local block (the chunk order is kept)
#       src <  r: all local queries see the first half of the keys (chunk src), not the second
#       src >  r: only the second half of the queries (chunk 2n-1-r) sees keys, all of them
#   so with load balancing every device does the same work in every step; without it, device
#   n-1 works in every step while device 0 idles after the first.
#
# Invisible work is skipped with lax.switch (the branch is chosen per device at run time), not
# computed and discarded. Steps are numbered with src < r as "earlier" and src > r as "later".
# The kernels are called on the local blocks directly (on_local_shards), not through the
# partitioning rule.

RING_OP = "ring_attention"
_DIAGONAL, _EARLIER, _LATER = 0, 1, 2


def ring_attention(q, k, v, *, axis_name, causal=False, softmax_scale=None, backend="auto",
                   load_balanced=True):
    """Sequence-parallel softmax attention; call it inside `shard_map` (or `pmap`).

    The sequence axis of q, k and v is split over the mesh axis (or tuple of axes) `axis_name`;
    each argument is this device's part. K/V blocks travel around the ring of devices with
    lax.ppermute while each device works on the block it holds; nothing is gathered, so the
    memory per device stays that of the local part.

    Args:
      q: [..., T, Hq, D] local queries (T = the global length / number of devices).
      k, v: [..., T, Hkv, D] local keys and values (Hq % Hkv == 0), same dtype as q.
      axis_name: the shard_map / pmap axis name(s) the sequence is split over.
      causal: causal self-attention over the global sequence.
      softmax_scale: a positive Python number; None means 1 / sqrt(D).
      backend: "auto" | "kernel" | "reference", as for flash_attention.
      load_balanced: the sequence is in the load-balanced layout (see to_load_balanced), so
        that causal attention costs every device the same. Only matters when causal (T must
        then be even); without causal the layout does not change the result.

    Returns:
      o [..., T, Hq, D] in q's dtype, this device's part of the output, in the input's layout.
    """
    from tk_jax import attention

    attention._check_qkv(q, k, v, op=RING_OP)
    scale = attention._resolve_scale(softmax_scale, head_dim=q.shape[-1], op=RING_OP)
    attention._check_bool(causal, "causal", op=RING_OP)
    attention._check_bool(load_balanced, "load_balanced", op=RING_OP)
    attention._check_backend_name(backend, op=RING_OP)
    if q.shape[-3] != k.shape[-3]:
        raise ValueError(
            f"{RING_OP}: q and k must hold the same part of one sequence (self-attention): got "
            f"{q.shape[-3]} query and {k.shape[-3]} key positions on this device (axis -3)")
    num_devices = _ring_size(axis_name)
    balanced = bool(causal and load_balanced and num_devices > 1)
    if balanced and q.shape[-3] % 2:
        raise ValueError(
            f"{RING_OP}: with causal=True and load_balanced=True each device holds two equal "
            f"chunks, so its sequence length must be even; got {q.shape[-3]} (axis -3 of q). "
            f"Pad the sequence or pass load_balanced=False")

    batch_shape = q.shape[:-3]
    q4, k4, v4 = (attention._fold_batch_dims(x) for x in (q, k, v))
    resolved = attention.choose_backend(q4, k4, v4, backend, op=RING_OP)
    o = _ring(q4, k4, v4, axis_name, scale, bool(causal), balanced, resolved)
    return o.reshape(batch_shape + o.shape[1:])


def _ring_size(axis_name) -> int:
    try:
        if hasattr(lax, "axis_size"):
            return int(lax.axis_size(axis_name))
        return int(lax.psum(1, axis_name))
    except NameError as err:
        raise ValueError(
            f"{RING_OP}: axis_name={axis_name!r} is not a bound mesh axis: call ring_attention "
            f"inside shard_map or pmap over that axis ({err})") from None


def _send_to_next(x, axis_name, num_devices):
    """Every device passes x (arrays of one dtype) to the next device on the ring."""
    perm = [(i, (i + 1) % num_devices) for i in range(num_devices)]
    return lax.ppermute(x, axis_name, perm)


def _ring_loop(step, carry, kv, axis_name, num_devices):
    """carry = step(s, kv_s, carry) for s = 0..n-1, kv_s being the K/V block that started on
    device (r - s) mod n. The next block is sent before step s computes, so that the transfer
    can overlap the computation; the last step sends nothing."""
    def body(state, s):
        kv, carry = state
        next_kv = _send_to_next(kv, axis_name, num_devices)
        return (next_kv, step(s, kv, carry)), None

    (kv, carry), _ = lax.scan(body, (kv, carry), jnp.arange(num_devices - 1))
    return step(num_devices - 1, kv, carry)


def _block_kind(s, me):
    """_DIAGONAL for step 0 (the local block), then _EARLIER while the visiting block comes
    from a device before this one (src = me - s >= 0), else _LATER."""
    return jnp.where(s == 0, _DIAGONAL, jnp.where(me >= s, _EARLIER, _LATER))


def _merge(o_acc, lse_acc, o, lse):
    """Combine two partial softmax results over disjoint key sets by their logsumexp.
    o [B, T, H, D], lse [B, H, T]; a side that saw no key has lse = -inf and weight 0."""
    lse_new = jnp.logaddexp(lse_acc, lse)  # -inf when both are -inf
    ref = jnp.where(jnp.isneginf(lse_new), 0.0, lse_new)

    def weight(part_lse):  # [B, H, T] -> [B, T, H, 1]
        return jnp.swapaxes(jnp.exp(part_lse - ref), 1, 2)[..., None]

    return weight(lse_acc) * o_acc + weight(lse) * o.astype(jnp.float32), lse_new


def _replace_rows(x, rows, new, *, axis):
    """x with the positions `rows` along `axis` (a slice: all, or one contiguous part) replaced
    by `new`. Built from slices and a concatenation rather than x.at[rows].set(new): on GPU
    (jax 0.11.2) the scatter that .at[] becomes inside the ring's manual shard_map region
    crashed XLA's partitioner."""
    start, stop, _ = rows.indices(x.shape[axis])
    if (start, stop) == (0, x.shape[axis]):
        return new
    parts = (lax.slice_in_dim(x, 0, start, axis=axis), new,
             lax.slice_in_dim(x, stop, x.shape[axis], axis=axis))
    return jnp.concatenate([p for p in parts if p.shape[axis]], axis=axis)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6, 7))
def _ring(q, k, v, axis_name, scale, causal, balanced, backend):
    return _ring_forward(q, k, v, axis_name, scale, causal, balanced, backend)[0]


def _ring_forward(q, k, v, axis_name, scale, causal, balanced, backend):
    """(o [B, T, Hq, D] in q's dtype, lse [B, Hq, T] float32) of the local queries."""
    from tk_jax.attention import attention_fwd_impl

    num_devices = _ring_size(axis_name)
    half = q.shape[1] // 2

    def attend(acc, q_rows, k, v, window_right):
        """Merge attention(q[:, q_rows], k, v) into the accumulator (o, lse)."""
        o_acc, lse_acc = acc
        o, lse = attention_fwd_impl(q[:, q_rows], k, v, scale=scale, window_left=-1,
                                    window_right=window_right, backend=backend, local=True)
        o_new, lse_new = _merge(o_acc[:, q_rows], lse_acc[..., q_rows], o, lse)
        return _replace_rows(o_acc, q_rows, o_new, axis=1), _replace_rows(lse_acc, q_rows, lse_new, axis=2)

    everything, first, second = slice(None), slice(None, half), slice(half, None)
    if not causal:
        def step(s, kv, acc):
            return attend(acc, everything, *kv, window_right=-1)
    else:
        if balanced:
            earlier = lambda acc, k, v: attend(acc, everything, k[:, first], v[:, first], -1)
            later = lambda acc, k, v: attend(acc, second, k, v, -1)
        else:
            earlier = lambda acc, k, v: attend(acc, everything, k, v, -1)
            later = lambda acc, k, v: acc  # invisible: skipped
        diagonal = lambda acc, k, v: attend(acc, everything, k, v, 0)
        me = lax.axis_index(axis_name)

        def step(s, kv, acc):
            return lax.switch(_block_kind(s, me), (diagonal, earlier, later), acc, *kv)

    # zeros_like / full_like keep q's device-varying type inside shard_map.
    acc = (jnp.zeros_like(q, jnp.float32),
           jnp.full_like(q[..., 0], -jnp.inf, jnp.float32).swapaxes(1, 2))
    o, lse = _ring_loop(step, acc, (k, v), axis_name, num_devices)
    return o.astype(q.dtype), lse


def _ring_forward_rule(q, k, v, axis_name, scale, causal, balanced, backend):
    o, lse = _ring_forward(q, k, v, axis_name, scale, causal, balanced, backend)
    return o, (q, k, v, o, lse)


def _ring_backward_rule(axis_name, scale, causal, balanced, backend, residuals, do):
    """The same ring again: with the global o and lse, attention_bwd_impl on one block gives
    that block's share of dq, dk, dv. dq stays here; dk and dv travel with their K/V block and
    take one more hop at the end, which brings them home."""
    from tk_jax.attention import attention_bwd_impl

    q, k, v, o, lse = residuals
    num_devices = _ring_size(axis_name)
    half = q.shape[1] // 2

    def attend(grads, q_rows, k_rows, k, v, window_right):
        dq, dk, dv = grads
        gq, gk, gv = attention_bwd_impl(
            q[:, q_rows], k[:, k_rows], v[:, k_rows], o[:, q_rows], lse[..., q_rows],
            do[:, q_rows], scale=scale, window_left=-1, window_right=window_right,
            backend=backend, local=True)
        return (_replace_rows(dq, q_rows, dq[:, q_rows] + gq.astype(jnp.float32), axis=1),
                _replace_rows(dk, k_rows, dk[:, k_rows] + gk.astype(jnp.float32), axis=1),
                _replace_rows(dv, k_rows, dv[:, k_rows] + gv.astype(jnp.float32), axis=1))

    everything, first, second = slice(None), slice(None, half), slice(half, None)
    if not causal:
        def block(s, grads, k, v):
            return attend(grads, everything, everything, k, v, -1)
    else:
        if balanced:
            earlier = lambda g, k, v: attend(g, everything, first, k, v, -1)
            later = lambda g, k, v: attend(g, second, everything, k, v, -1)
        else:
            earlier = lambda g, k, v: attend(g, everything, everything, k, v, -1)
            later = lambda g, k, v: g  # invisible: nothing to add
        diagonal = lambda g, k, v: attend(g, everything, everything, k, v, 0)
        me = lax.axis_index(axis_name)

        def block(s, grads, k, v):
            return lax.switch(_block_kind(s, me), (diagonal, earlier, later), grads, k, v)

    def step(s, kv, carry):
        dq, dkv = carry
        dq, dk, dv = block(s, (dq, *dkv), *kv)
        # dk, dv (float32) move in their own ppermute: one dtype per transfer (see module doc).
        return dq, _send_to_next((dk, dv), axis_name, num_devices)

    init = (jnp.zeros_like(q, jnp.float32),
            (jnp.zeros_like(k, jnp.float32), jnp.zeros_like(v, jnp.float32)))
    dq, (dk, dv) = _ring_loop(step, init, (k, v), axis_name, num_devices)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


_ring.defvjp(_ring_forward_rule, _ring_backward_rule)


# ----------------------------------------------------------------------------------------------
# The load-balanced sequence layout. Cut the sequence into 2n chunks; device i gets chunks i and
# 2n-1-i. Reordering the chunks as [0, 2n-1, 1, 2n-2, ...] before a plain contiguous split
# (PartitionSpec over the sequence axis) gives exactly that.


def load_balanced_chunk_order(num_shards: int) -> np.ndarray:
    """[0, 2n-1, 1, 2n-2, ..., n-1, n]: the chunk order of the load-balanced layout."""
    pairs = [(i, 2 * num_shards - 1 - i) for i in range(num_shards)]
    return np.array([c for pair in pairs for c in pair])


def to_load_balanced(x, num_shards: int, *, axis: int = -3):
    """Reorder the sequence axis of a full (unsplit) array into the load-balanced layout."""
    return _reorder_chunks(x, load_balanced_chunk_order(num_shards), num_shards, axis)


def from_load_balanced(x, num_shards: int, *, axis: int = -3):
    """Inverse of to_load_balanced: back to the natural sequence order."""
    return _reorder_chunks(x, np.argsort(load_balanced_chunk_order(num_shards)), num_shards, axis)


def _reorder_chunks(x, order, num_shards, axis):
    if not isinstance(num_shards, (int, np.integer)) or isinstance(num_shards, bool) \
            or num_shards < 1:
        raise ValueError(f"num_shards must be a positive int, got {num_shards!r}")
    axis = axis % x.ndim
    length = x.shape[axis]
    if length % (2 * num_shards):
        raise ValueError(
            f"the load-balanced layout cuts the sequence into 2 * num_shards = {2 * num_shards} "
            f"equal chunks; axis {axis} has length {length}, not a multiple of that")
    chunks = jnp.reshape(x, x.shape[:axis] + (2 * num_shards, length // (2 * num_shards))
                         + x.shape[axis + 1:])
    return jnp.reshape(jnp.take(chunks, jnp.asarray(order), axis=axis), x.shape)
