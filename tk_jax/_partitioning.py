"""Partitioning rules for the kernel calls: under `jax.jit` with sharded inputs every device
runs the kernel on its own (batch, head) shard, with no collective.

`shard_over_batch_and_heads(fn, operands, results)` wraps a per-device function (the forward
kernel, the backward, ...). It is built on `jax.experimental.custom_partitioning` with a Shardy
sharding rule: under plain `jit` the shardings of the inputs are only known to the compiler (not
while tracing), and custom_partitioning is the hook that lets the compiler ask us how to split
the call. The attention calls also take a sequence split: the rule then hands the per-device
program to tk_jax/_context_parallel.py (context parallelism: K/V around a ring or gathered, no
gather of Q). Any other sharded axis (head_dim; the sequence of the Based calls) is gathered
first, with a one-time warning.
Inside `shard_map` or `pmap` the call already sees local shards and the rule is not used;
`on_local_shards` calls a kernel there directly.

A layout names each dimension of an array: "b" (batch) and "hq" / "hkv" (query / key-value
heads) may be split across devices; every other name (tq, tk: sequence; d, e: head dims)
must be whole on each device. Attention is independent per batch element and per head, so
splitting b and the heads needs no communication. Grouped-query attention (query head h
reads kv head h // G): the kv heads are split like the query heads when their count allows
it; otherwise K/V stay whole on every device and each device picks the kv heads its query
heads read.
"""
from __future__ import annotations

import functools
import logging
import math
import warnings

import jax
import jax.numpy as jnp
from jax import lax
from jax.custom_batching import custom_vmap
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec

BATCH, Q_HEADS, KV_HEADS = "b", "hq", "hkv"
SEQUENCE_DIMS = ("t", "tq", "tk")
SPLITTABLE = (BATCH, Q_HEADS, KV_HEADS)

# Layouts of the attention halves (see attention_fwd_impl / attention_bwd_impl).
ATTENTION_FWD_LAYOUT = ("b tq hq d, b tk hkv d, b tk hkv e", "b tq hq e, b hq tq")
_BWD_OPERANDS = "b tq hq d, b tk hkv d, b tk hkv e, b tq hq e, b hq tq, b tq hq e"
ATTENTION_BWD_LAYOUT = (_BWD_OPERANDS, "b tq hq d, b tk hkv d, b tk hkv e")
ATTENTION_BWD_WITH_DLSE_LAYOUT = (_BWD_OPERANDS + ", b hq tq", ATTENTION_BWD_LAYOUT[1])
# The optional masks of either half, appended after its arrays in this order (the order of
# tk_jax.attention.AttentionMasks): segment ids split with the batch and are read whole by
# every head shard, lengths split with the batch.
ATTENTION_MASK_LAYOUTS = {"q_segment_ids": "b tq", "kv_segment_ids": "b tk",
                          "q_seq_lengths": "b", "kv_seq_lengths": "b"}
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
def shard_over_batch_and_heads(fn, operands: str, results: str, sequence: tuple | None = None):
    """Wrap `fn(*arrays, **static) -> tuple of arrays` with a partitioning rule.

    `operands` and `results` are comma-separated layouts, one per array, e.g.
    ATTENTION_FWD_LAYOUT = ("b tq hq d, b tk hkv d, b tk hkv e", "b tq hq e, b hq tq").
    The wrapper is called like fn (keyword arguments must be hashable Python values: they are
    static) and computes the same thing; under a sharded jit it runs fn once per device on the
    local (batch, head) shard. It also works eagerly, on one device, inside shard_map / pmap
    (where JAX calls fn on the local shards directly, without the rule), and under vmap
    (vmapped axes are folded into the batch).

    sequence: ("forward" or "backward", mask names) for the attention kernels (the layouts of
    ATTENTION_FWD_LAYOUT / ATTENTION_BWD*_LAYOUT with the masks appended): a split of the query
    sequence (tq) then runs context-parallel (tk_jax/_context_parallel.py) instead of being
    gathered.
    """
    return _BatchHeadPartitioned(fn, _parse_layouts(operands), _parse_layouts(results),
                                 sequence)


class _BatchHeadPartitioned:
    """See shard_over_batch_and_heads. One instance per (fn, layouts)."""

    def __init__(self, fn, operand_dims, result_dims, sequence=None):
        self.fn = fn
        self.sequence = sequence
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

    def _sequence(self, static):
        """self.sequence, or None where context parallelism cannot take the call."""
        if self.sequence is None:
            return None
        from tk_jax import _context_parallel
        return self.sequence if _context_parallel.takes(self.sequence, dict(static)) else None

    def _infer_result_shardings(self, static, mesh, arg_shapes, result_shape):
        plan = _SplitPlan.from_operands(mesh, arg_shapes, self.operand_dims,
                                        self._sequence(static))
        return tuple(plan.sharding(dims) for dims in self.result_dims)

    def _partition(self, static, mesh, arg_shapes, result_shape):
        plan = _SplitPlan.from_operands(mesh, arg_shapes, self.operand_dims,
                                        self._sequence(static))
        arg_shardings = tuple(plan.sharding(dims) for dims in self.operand_dims)
        result_shardings = tuple(plan.sharding(dims) for dims in self.result_dims)

        if plan.sequence_axes:  # the hook of context parallelism
            from tk_jax import _context_parallel
            per_device = _context_parallel.sequence_sharded_program(
                self.sequence, self.fn, dict(static), mesh, plan.sequence_axes,
                plan.kv_sequence_split, [a.shape for a in arg_shapes])
            return mesh, per_device, result_shardings, arg_shardings

        def per_device(*arrays):
            return plan.run(self.fn, dict(static), arrays, self.operand_dims, self.result_dims)

        return mesh, per_device, result_shardings, arg_shardings


def _varying_axes(x) -> frozenset:
    """The shard_map axes along which x differs between devices, as JAX's type system tracks
    them (empty outside shard_map)."""
    return frozenset(jax.typeof(x).manual_axis_type.varying)


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
            out = lax.pcast(out, missing, to="varying")
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

    def __init__(self, mesh, batch_axes, head_axes, kv_mode, heads_q, heads_kv,
                 sequence_axes=(), kv_sequence_split=False):
        self.mesh = mesh
        self.batch_axes = batch_axes
        self.head_axes = head_axes
        self.kv_mode = kv_mode
        self.heads_q = heads_q
        self.heads_kv = heads_kv
        # Context parallelism: the mesh axes of the query sequence (tq), and whether the key
        # sequence (tk) is split over them too (else K/V are whole on every device).
        self.sequence_axes = sequence_axes
        self.kv_sequence_split = kv_sequence_split

    @classmethod
    def from_operands(cls, mesh, arg_shapes, operand_dims, sequence=None):
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
        sequence_axes, kv_sequence_split = (), False
        if sequence is not None and kv_mode == "split":
            sequence_axes, kv_sequence_split = _sequence_split(mesh, arg_shapes, operand_dims,
                                                               sizes)

        # Anything else sharded besides batch and heads is gathered: say so, once.
        for dims, a in zip(operand_dims, arg_shapes):
            for name, entry in zip(dims, _padded_spec(a.sharding, len(a.shape))):
                if entry is None or name in SPLITTABLE:
                    continue
                if sequence_axes and name in ("tq", "tk"):
                    continue
                if name in SEQUENCE_DIMS:
                    _warn_once("sequence", (
                        "tk_jax: an input is sharded along the sequence axis in a way this "
                        "kernel call does not split (a Based call; for attention: the keys but "
                        "not the queries, a split that does not divide the sequence, or kv "
                        "heads picked per device); it gathers the whole sequence on every "
                        "device (correct but memory-hungry). Attention with the queries' "
                        "sequence split evenly runs context-parallel."))
                else:
                    _warn_once(f"dim-{name}", (
                        f"tk_jax: an attention input is sharded along its {name!r} dimension; "
                        "it is gathered before the attention call"))
        return cls(mesh, batch_axes, head_axes, kv_mode, heads_q, heads_kv, sequence_axes,
                   kv_sequence_split)

    def _split_of(self, name):
        if name == BATCH:
            return self.batch_axes
        if name == Q_HEADS or (name == KV_HEADS and self.kv_mode == "split"):
            return self.head_axes
        if name == "tq" or (name == "tk" and self.kv_sequence_split):
            return self.sequence_axes  # and the segment ids ("b tq", "b tk") with them
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


def _sequence_split(mesh, arg_shapes, operand_dims, sizes):
    """(mesh axes of the query sequence, whether K/V are split over them too) for context
    parallelism, or ((), False) when q's sequence is not split (evenly). K/V follow the queries'
    split if their sequence is split at all (over any axes), else they stay whole."""
    spec = dict(zip(operand_dims[0], _padded_spec(arg_shapes[0].sharding,
                                                  len(arg_shapes[0].shape))))
    axes = _axes(spec.get("tq"))
    if not axes or sizes["tq"] % _mesh_size(mesh, axes):
        return (), False
    k_spec = dict(zip(operand_dims[1], _padded_spec(arg_shapes[1].sharding,
                                                    len(arg_shapes[1].shape))))
    kv_split = bool(_axes(k_spec.get("tk"))) and sizes["tk"] % _mesh_size(mesh, axes) == 0
    return axes, kv_split


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


@functools.lru_cache(maxsize=None)
def arrays_as_keywords(fn, names: tuple[str, ...]):
    """`fn` called with its last len(names) arrays passed as the keyword arguments `names`
    (the partitioning rule and shard_map see only positional arrays). One wrapper per
    (fn, names), so that the rule built on it is built once."""
    if not names:
        return fn

    @functools.wraps(fn)
    def call(*arrays, **static):
        split = len(arrays) - len(names)
        return fn(*arrays[:split], **dict(zip(names, arrays[split:])), **static)
    return call


def _with_masks(layout, mask_names):
    operands, results = layout
    return ", ".join([operands] + [ATTENTION_MASK_LAYOUTS[n] for n in mask_names]), results


def partitioned_attention_fwd(fn, *, mask_names: tuple[str, ...] = ()):
    """`fn(q, k, v, *, scale, window_left, window_right[, masks by name]) -> (o, lse)` with
    the batch/head rule; called as wrapper(q, k, v, *mask_arrays, **static), the masks named
    by mask_names (see ATTENTION_MASK_LAYOUTS), in that order."""
    mask_names = tuple(mask_names)
    return shard_over_batch_and_heads(arrays_as_keywords(fn, mask_names),
                                      *_with_masks(ATTENTION_FWD_LAYOUT, mask_names),
                                      sequence=("forward", mask_names))


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


def partitioned_attention_bwd(fn, *, with_dlse: bool, mask_names: tuple[str, ...] = ()):
    """`fn(q, k, v, o, lse, do[, dlse], *, scale, window_left, window_right[, masks by name])
    -> (dq, dk, dv)` with the batch/head rule; masks as in partitioned_attention_fwd."""
    layout = ATTENTION_BWD_WITH_DLSE_LAYOUT if with_dlse else ATTENTION_BWD_LAYOUT
    mask_names = tuple(mask_names)
    return shard_over_batch_and_heads(arrays_as_keywords(fn, mask_names),
                                      *_with_masks(layout, mask_names),
                                      sequence=("backward", mask_names))


# ----------------------------------------------------------------------------------------------
# Attention against a key/value cache (tk_jax/kvcache.py): q, k_cache, v_cache, seqlens and,
# for a paged cache, the page table -> o, lse. A contiguous cache [B, S, Hkv, D] splits like
# K/V over batch and kv heads. A paged cache [num_pages, page_size, Hkv, D] is one pool that
# every batch row indexes through its page table: it splits over kv heads only (its page axis
# stays whole on each device), while q, seqlens and the page table still split over batch.

KVCACHE_LAYOUT = ("b tq hq d, b s hkv d, b s hkv d, b", "b tq hq d, b hq tq")
KVCACHE_PAGED_LAYOUT = ("b tq hq d, n p hkv d, n p hkv d, b, b m", "b tq hq d, b hq tq")


class _PagedKVCachePartitioned(_BatchHeadPartitioned):
    """The batch/head rule for a paged-cache call; vmap folds the mapped axis into the batch
    as for the other calls, but keeps one pool: a mapped pool's pages are laid end to end and
    each mapped page table is offset to its own pool's pages."""

    def _vmap_rule(self, static, axis_size, in_batched, q, k_pool, v_pool, seqlens, page_table):
        def fold(x, batched):
            if not batched:
                x = jnp.broadcast_to(x, (axis_size,) + x.shape)
            return x.reshape((axis_size * x.shape[1],) + x.shape[2:])

        q_batched, k_batched, v_batched, lens_batched, table_batched = in_batched
        if k_batched or v_batched:
            num_pages = (k_pool.shape[1] if k_batched else k_pool.shape[0])
            k_pool, v_pool = fold(k_pool, k_batched), fold(v_pool, v_batched)
            if not table_batched:
                page_table = jnp.broadcast_to(page_table, (axis_size,) + page_table.shape)
            # Clamp first: an out-of-range id reads the nearest page of its own pool.
            offsets = (jnp.arange(axis_size, dtype=jnp.int32) * num_pages)[:, None, None]
            page_table = jnp.clip(page_table, 0, num_pages - 1) + offsets
            table_batched = True
        folded = (fold(q, q_batched), k_pool, v_pool, fold(seqlens, lens_batched),
                  fold(page_table, table_batched))
        outs = self(*folded, **dict(static))
        outs = tuple(o.reshape((axis_size, o.shape[0] // axis_size) + o.shape[1:]) for o in outs)
        return outs, tuple(True for _ in outs)


@functools.lru_cache(maxsize=None)
def partitioned_attention_kvcache(fn, *, paged: bool):
    """`fn(q, k_cache, v_cache, seqlens[, page_table], *, scale, window_left, window_right)
    -> (o, lse)` with the batch/head rule (KVCACHE_LAYOUT or KVCACHE_PAGED_LAYOUT)."""
    if not paged:
        return shard_over_batch_and_heads(fn, *KVCACHE_LAYOUT)
    operands, results = (tuple(tuple(part.split()) for part in text.split(","))
                         for text in KVCACHE_PAGED_LAYOUT)
    return _PagedKVCachePartitioned(fn, operands, results)
