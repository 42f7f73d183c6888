"""Context-parallel softmax attention, per device: the sequence is split over a mesh axis and
each device computes its own queries, with the keys and values brought to it either around a
ring (one block per step, passed on while the current one is computed) or by one all-gather.

Two callers run these functions on local shards, inside a region where the mesh axes are
bound (so that lax.ppermute, all_gather and axis_index work):
  - tk_jax.ring_attention, inside the user's shard_map;
  - flash_attention on a sequence-sharded input under jit: the partitioning rule of
    tk_jax/_partitioning.py hands its per-device program to sequence_sharded_forward /
    sequence_sharded_backward below.
Which blocks a device computes, and with which mask, is planned statically
(tk_jax/_ring_plan.py); a step that no device has work in is skipped, and devices with
different work in one step take different branches of a switch on the device index.

Steps by lengths. On GPU a switch makes the host read the branch index every step, a round
trip that drains the queue. Where the plan marks a step as one call by lengths (every
device's work one unmasked rectangle from local row 0 and key 0: the load-balanced causal
ring beyond its diagonal, with the queries' two chunks swapped), every device makes the same
call and its own rectangle reaches the kernels as q_seq_lengths / kv_seq_lengths, looked up
in the plan's static table by the device's ring position: device arrays, no branch. The
kernels skip the rows and keys past the lengths; those rows come back o = 0, lse = -inf (a
no-op in merge) and zero gradients. The queries' swapped copy is made once per forward (q)
and once per backward (q, o, lse, do, dlse); the accumulators (o, lse; dq) are kept in the
swapped order, so only the diagonal step's result changes order, where it is written or
added, and the result once, where it is cast. TK_JAX_RING_STEPS=switch plans every such
step as a switch again, for comparing the two (docs/DESIGN.md has the measurement).

Overlap. The ring is unrolled (a Python loop, not a scan), so every transfer is its own pair of
collective-permute-start/done in one straight-line program: the next block's transfer is
issued before this block's computation and only the next step's computation waits for it.
One transfer per step: XLA's latency-hiding scheduler lets one collective-permute at a time
overlap computation, so K and V travel as one payload (the arrays' bits packed into one
uint32 vector), and in the backward the same payload also carries the dK/dV partial sums of
the block the receiver holds now: both are ready when the step starts. The receiver needs the
K/V part only for its next step and the partial sums only after its own kernels of this step
(they are added outside the step: a switch whose operands included them would wait for the
transfer). The device's own block is computed last in the backward, so that the last hop
(the partial sums going home) overlaps it, unless the backward has to send its first keys
itself (see ring_backward). Each transfer is tied to the result of the step before the one it
overlaps (see _after), so that XLA cannot run it early, where it would hold up another.
"""
from __future__ import annotations

import functools
import os
from typing import Callable, Hashable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from tk_jax import _ring_plan as plans
from tk_jax._ring_plan import CONTIGUOUS, LOAD_BALANCED

AxisName = Hashable  # a mesh axis name, or a tuple of them
# attend(q, k, v, window_left, window_right, **masks) -> (o, lse [B, Hq, Tq] f32), on local
# blocks; masks: any of the block's q_segment_ids and kv_segment_ids ([B, rows] / [B, keys]
# int32) and q_seq_lengths and kv_seq_lengths ([B] int32: rows and keys at or past a length
# are padding, as in the kernels).
BlockForward = Callable
# attend_bwd(q, k, v, o, lse, do, dlse or None, window_left, window_right, **masks)
# -> (dq, dk, dv).
BlockBackward = Callable


class DqStateCalls(NamedTuple):
    """The kernels' backward in three calls (tk_jax/_kernels.py), which sum dQ over several
    blocks in the kernels' own float32 state rather than returning each block's dq: the row
    statistics are computed once, dQ is zeroed once and converted once, and no block's dq is
    added outside the kernels.

    row_stats(o, lse, do, dlse or None) -> state, for all of the device's rows;
    keys(state, q, k, v, do, *, dq_rows, dq_row_shift, window_left, window_right, **masks)
        -> (state, dk, dv): one block, its query row i being row (i + dq_row_shift) mod dq_rows
        of the state (whole 64-row tiles only);
    dq(state, like) -> dq shaped and typed like `like`."""

    row_stats: Callable
    keys: Callable
    dq: Callable

RING, ALL_GATHER, WHOLE_KV = "ring", "all_gather", "whole_kv"
EXCHANGE_ENV = "TK_JAX_CONTEXT_PARALLEL"  # "ring" | "all_gather" | unset ("auto")
# "switch": every ring step whose work differs between devices is a switch on the device
# index; unset ("lengths"): such a step runs as one call with per-device lengths where the
# plan allows (tk_jax/_ring_plan.py). For comparing the two; read when a plan is made.
STEPS_ENV = "TK_JAX_RING_STEPS"


def _env_choice(name: str, choices: tuple, default: str) -> str:
    """The environment variable `name`, one of `choices`, else `default`. A value not among
    them is ignored with a warning rather than an error: this runs inside XLA's partitioner
    too, where an exception would end the compilation (or the process)."""
    value = os.environ.get(name, default)
    if value in choices:
        return value
    from tk_jax._partitioning import _warn_once
    allowed = ", ".join(map(repr, choices[:-1])) + f" or {choices[-1]!r}"
    _warn_once(f"env-{name}-{value}", f"tk_jax: {name} must be {allowed}, got {value!r}; "
                                      f"ignored")
    return default


def steps_by_lengths() -> bool:
    """Whether ring plans may run a step whose work differs between devices as one call with
    per-device lengths (the default), rather than as a switch (TK_JAX_RING_STEPS=switch)."""
    return _env_choice(STEPS_ENV, ("lengths", "switch"), "lengths") == "lengths"


# ----------------------------------------------------------------------------------------------
# Pieces.


# A ring's order: order[d] is the ring position of device d (the position the plans count
# devices in); None: the device index itself.
Order = tuple | None


def send(x, axis_name: AxisName, num_devices: int, shift: int = 1, order: Order = None):
    """Every device passes x (one array: one transfer) to the device `shift` places further on
    the ring."""
    order = tuple(range(num_devices)) if order is None else order
    device_at = {position: device for device, position in enumerate(order)}
    perm = [(d, device_at[(order[d] + shift) % num_devices]) for d in range(num_devices)]
    return lax.ppermute(x, axis_name, perm)


def ring_position(axis_name: AxisName, order: Order = None):
    """This device's ring position (an int32 scalar)."""
    me = lax.axis_index(axis_name)
    return me if order is None else jnp.asarray(order, jnp.int32)[me]


def _to_words(x):
    """x's bits as a uint32 vector (2-byte types in pairs, padded to an even count)."""
    flat = x.reshape(-1)
    size = jnp.dtype(x.dtype).itemsize
    if size == 4:
        return lax.bitcast_convert_type(flat, jnp.uint32)
    if size == 2:
        if flat.shape[0] % 2:
            flat = jnp.pad(flat, (0, 1))
        return lax.bitcast_convert_type(flat.reshape(-1, 2), jnp.uint32)
    if size == 8:
        return lax.bitcast_convert_type(flat, jnp.uint32).reshape(-1)
    raise TypeError(f"cannot pack {x.dtype} into a ring payload")


def _from_words(words, like):
    """Inverse of _to_words, for an array shaped and typed like `like` (a ShapeDtypeStruct)."""
    size = jnp.dtype(like.dtype).itemsize
    if size == 4:
        flat = lax.bitcast_convert_type(words, like.dtype)
    elif size == 2:
        flat = lax.bitcast_convert_type(words, like.dtype).reshape(-1)[:int(np.prod(like.shape))]
    else:
        flat = lax.bitcast_convert_type(words.reshape(-1, 2), like.dtype)
    return flat.reshape(like.shape)


def _word_count(like) -> int:
    count = int(np.prod(like.shape)) * jnp.dtype(like.dtype).itemsize
    return -(-count // 4)


def pack(arrays) -> jax.Array:
    """Arrays of any shapes and types as one uint32 payload (one transfer)."""
    return jnp.concatenate([_to_words(x) for x in arrays])


def unpack(payload, likes) -> tuple:
    """The arrays shaped and typed like `likes` from a payload made by pack()."""
    out, start = [], 0
    for like in likes:
        stop = start + _word_count(like)
        out.append(_from_words(payload[start:stop], like))
        start = stop
    return tuple(out)


def _shape_of(x):
    return jax.ShapeDtypeStruct(x.shape, x.dtype)


def merge(o_acc, lse_acc, o, lse):
    """Combine two partial softmax results over disjoint key sets by their logsumexp.
    o [B, T, H, D], lse [B, H, T]; a side that saw no key has lse = -inf and weight 0; NaN in
    either side reaches the result."""
    lse_new = jnp.logaddexp(lse_acc, lse)  # -inf when both are -inf
    ref = jnp.where(jnp.isneginf(lse_new), 0.0, lse_new)

    def weight(part_lse):  # [B, H, T] -> [B, T, H, 1]
        return jnp.swapaxes(jnp.exp(part_lse - ref), 1, 2)[..., None]

    return weight(lse_acc) * o_acc + weight(lse) * o.astype(jnp.float32), lse_new


def replace_rows(x, rows: slice, new, *, axis: int):
    """x with the positions `rows` along `axis` replaced by `new`. Slices and a concatenation
    rather than x.at[rows].set(new): on GPU (jax 0.11.2) the scatter that .at[] becomes inside a
    manual shard_map region crashed XLA's partitioner."""
    start, stop, _ = rows.indices(x.shape[axis])
    if (start, stop) == (0, x.shape[axis]):
        return new
    parts = (lax.slice_in_dim(x, 0, start, axis=axis), new,
             lax.slice_in_dim(x, stop, x.shape[axis], axis=axis))
    return jnp.concatenate([p for p in parts if p.shape[axis]], axis=axis)


def _run_step(step: plans.Step, axis_name, branch: Callable, *operands, order: Order = None):
    """branch(blocks, *operands, lengths=...) with this device's blocks of the step: called
    directly when every device has the same blocks; for a step by lengths, called once with
    the step's one block and this device's (q_len, kv_len) (int32 scalars, looked up by the
    device's ring position in the plan's table: no host round trip, unlike a switch); else
    through lax.switch on the ring position (each device runs only its own branch)."""
    if step.lengths is not None:
        me = ring_position(axis_name, order)
        table = step.lengths
        lengths = tuple(jnp.asarray(t, jnp.int32)[me]
                        for t in (table.q_lengths, table.kv_lengths))
        return branch((table.block,), *operands, lengths=lengths)
    if len(step.branches) == 1:
        return branch(step.branches[0], *operands)
    index = jnp.asarray(step.branch_of_device, jnp.int32)[ring_position(axis_name, order)]
    return lax.switch(index, [functools.partial(branch, b) for b in step.branches], *operands)


def _length_masks(lengths, batch: int) -> dict:
    """A block's sequence lengths (scalars, the same for every batch row) as the kernels take
    them, or {} without."""
    if lengths is None:
        return {}
    q_len, kv_len = lengths
    return {"q_seq_lengths": jnp.broadcast_to(q_len, (batch,)),
            "kv_seq_lengths": jnp.broadcast_to(kv_len, (batch,))}


def _swap_halves(x, axis: int):
    """x with the two halves along `axis` exchanged (its own inverse); None stays None."""
    if x is None:
        return None
    first, second = _halves(x, axis)
    return jnp.concatenate([second, first], axis=axis)


def _in_row_orders(plan: plans.RingPlan, items) -> dict:
    """The query-side arrays `items` ((array or None, its row axis) pairs) in each row order
    the plan's steps count in: {False: as given, True: halves exchanged, if a step needs it},
    each copy made once for all steps."""
    orders = {False: tuple(x for x, _ in items)}
    if plan.rows_swapped:
        orders[True] = tuple(_swap_halves(x, axis) for x, axis in items)
    return orders


def _accumulator_rows(start: int, stop: int, length: int, moved: bool) -> list:
    """Rows [start, stop) of a block (of `length` local rows) as pairs (rows of the block's
    result, rows of the accumulators): one pair, the same rows, when the step and the
    accumulators count the rows alike; else (`moved`: one of them has the halves exchanged)
    the block cut at the middle and each part moved by half the length."""
    if not moved:
        return [(slice(0, stop - start), slice(start, stop))]
    half = length // 2
    pairs = []
    for lo, hi, shift in ((start, min(stop, half), half), (max(start, half), stop, -half)):
        if lo < hi:
            pairs.append((slice(lo - start, hi - start), slice(lo + shift, hi + shift)))
    return pairs


def _touched_rows(step: plans.Step, rows: np.ndarray, moved: bool) -> np.ndarray:
    """`rows` (True: no device has written this accumulator row yet) after the step."""
    rows = rows.copy()
    for blocks in step.branches:
        for b in blocks:
            for _, written in _accumulator_rows(b.q_start, b.q_stop, len(rows), moved):
                rows[written] = False
    return rows


# ----------------------------------------------------------------------------------------------
# Forward.


def _empty_forward(q, v):
    """The forward accumulators before any key: o = 0 (float32), lse = -inf. Built from q
    (zeros_like / full_like) so that inside shard_map they have q's device-varying type."""
    b, t, h, _ = q.shape
    o = jnp.zeros_like(q, jnp.float32, shape=(b, t, h, v.shape[-1]))
    lse = jnp.full_like(q[..., 0], -jnp.inf, jnp.float32).swapaxes(1, 2)
    return o, lse


def _segments(q_segment_ids, kv, rows, keys) -> dict:
    """The segment ids of one block (the keys' travel with K/V as kv[2]), or {} without."""
    if q_segment_ids is None:
        return {}
    return {"q_segment_ids": q_segment_ids[:, rows], "kv_segment_ids": kv[2][:, keys]}


def _forward_blocks(attend: BlockForward, unwritten: np.ndarray, q_segment_ids, moved: bool,
                    blocks, q, kv, acc, lengths=None):
    """Merge this device's blocks against the keys `kv` = (k, v[, kv_segment_ids]) into
    acc = (o f32, lse). q and q_segment_ids count the rows in the step's order; `moved`: the
    accumulators count them with the halves exchanged (see _accumulator_rows). Rows that no
    device has written yet (`unwritten`, static, accumulator order) take the block's result
    as it is; rows past a length come back o = 0, lse = -inf, which merge leaves as they
    were."""
    k, v = kv[:2]
    o_acc, lse_acc = acc
    unwritten = unwritten.copy()
    for b in blocks:
        rows, keys = slice(b.q_start, b.q_stop), slice(b.k_start, b.k_stop)
        o, lse = attend(q[:, rows], k[:, keys], v[:, keys], b.window_left, b.window_right,
                        **_segments(q_segment_ids, kv, rows, keys),
                        **_length_masks(lengths, q.shape[0]))
        for part, target in _accumulator_rows(b.q_start, b.q_stop, q.shape[1], moved):
            o_part, lse_part = o[:, part], lse[..., part]
            if unwritten[target].all():
                o_new, lse_new = o_part.astype(jnp.float32), lse_part
            else:
                o_new, lse_new = merge(o_acc[:, target], lse_acc[..., target], o_part, lse_part)
            unwritten[target] = False
            o_acc = replace_rows(o_acc, target, o_new, axis=1)
            lse_acc = replace_rows(lse_acc, target, lse_new, axis=2)
    return o_acc, lse_acc


def _after(payload, result):
    """(payload, result), with the payload's transfer tied to `result` (the previous step's):
    XLA then issues the transfer only once that step is done. A chain of transfers that only
    pass a block on depends on no computation, and a scheduler (XLA's default one) may
    otherwise run the whole chain back to back before the first step, so that none of the
    steps overlaps a transfer; tied, transfer s+1 starts after step s-1 and is awaited only
    by step s+1: it runs during step s."""
    return lax.optimization_barrier((payload, result))


def _with_segments(k, v, kv_segment_ids) -> tuple:
    return (k, v) if kv_segment_ids is None else (k, v, kv_segment_ids)


def ring_forward(q, k, v, *, plan: plans.RingPlan, axis_name: AxisName, attend: BlockForward,
                 q_segment_ids=None, kv_segment_ids=None, keep_neighbour_keys: bool = False,
                 order: Order = None):
    """(o [B, Tq, Hq, Dv] in q's dtype, lse [B, Hq, Tq] float32) of this device's queries; the
    keys and values (and their segment ids, [B, T] int32, if given) go around the ring (one
    transfer per step after the first, issued before the step's computation).

    keep_neighbour_keys: also return the payload of the previous device's keys (None in a
    ring of one step), for ring_backward, whose first step needs them. order: the devices'
    ring positions (None: their indices)."""
    acc = _empty_forward(q, v)
    unwritten = np.ones(q.shape[1], bool)
    # The queries in each row order the steps count in (the swapped copy made once), the
    # accumulators in the swapped one where there is one: only the diagonal step's result
    # then moves, as it is written (converted to float32 anyway), and the result moves back
    # once, as it is cast.
    swapped = plan.rows_swapped
    queries = _in_row_orders(plan, [(q, 1), (q_segment_ids, 1)])
    kv = _with_segments(k, v, kv_segment_ids)
    likes = tuple(map(_shape_of, kv))
    payload = pack(kv) if len(plan.steps) > 1 else None
    neighbour_keys = None
    for index, step in enumerate(plan.steps):
        last = index == len(plan.steps) - 1
        if not last:
            if index:
                payload, acc = _after(payload, acc)
            # Issued before this step's computation; the block is passed on as it came.
            payload = send(payload, axis_name, plan.num_devices, order=order)
            if index == 0:
                neighbour_keys = payload
        q_step, q_segment_ids_step = queries[step.rows_swapped]
        moved = step.rows_swapped != swapped
        branch = functools.partial(_forward_blocks, attend, unwritten, q_segment_ids_step,
                                   moved)
        acc = _run_step(step, axis_name, branch, q_step, kv, acc, order=order)
        unwritten = _touched_rows(step, unwritten, moved)
        kv = None if last else unpack(payload, likes)
    o, lse = acc
    if swapped:
        o, lse = _swap_halves(o, 1), _swap_halves(lse, 2)
    if keep_neighbour_keys:
        return o.astype(q.dtype), lse, neighbour_keys
    return o.astype(q.dtype), lse


def whole_keys_forward(q, k, v, *, step: plans.Step, axis_name: AxisName,
                       attend: BlockForward, q_segment_ids=None, kv_segment_ids=None,
                       order: Order = None):
    """Forward with all keys and values on this device (k, v [B, Tk, Hkv, D] in global
    order), its queries in the layout `step` was planned for."""
    branch = functools.partial(_forward_blocks, attend, np.ones(q.shape[1], bool),
                               q_segment_ids, False)
    o, lse = _run_step(step, axis_name, branch, q, _with_segments(k, v, kv_segment_ids),
                       _empty_forward(q, v), order=order)
    return o.astype(q.dtype), lse


# ----------------------------------------------------------------------------------------------
# Backward. With the global o and lse, the backward of one block gives that block's share of
# dq, dk and dv (the gradient is a sum over blocks).


# The backward sums each device's dq over its blocks in one of two ways, behind one interface
# (start, add, finish): in a float32 array here, from block calls that return their dq
# (_DqInFloat32), or in the kernels' dQ state (_DqInKernelState).
_TILE = 64  # query rows of the kernels' dQ tiles: a block's rows must be whole tiles of the state


class _DqInFloat32:
    """dq (float32, local rows in the accumulator's order) summed here from attend_bwd's."""

    def __init__(self, attend_bwd: BlockBackward):
        self.attend_bwd = attend_bwd

    def start(self, q, o, lse, do, dlse):
        return jnp.zeros_like(q, jnp.float32)

    def add(self, dq, b: plans.Block, moved: bool, saved, kv, masks: dict):
        q, o, lse, do, dlse, _ = saved
        rows, keys = slice(b.q_start, b.q_stop), slice(b.k_start, b.k_stop)
        dq_b, dk_b, dv_b = self.attend_bwd(
            q[:, rows], kv[0][:, keys], kv[1][:, keys], o[:, rows], lse[..., rows], do[:, rows],
            None if dlse is None else dlse[..., rows], b.window_left, b.window_right, **masks)
        for part, target in _accumulator_rows(b.q_start, b.q_stop, q.shape[1], moved):
            dq = replace_rows(dq, target, dq[:, target] + dq_b[:, part].astype(jnp.float32),
                              axis=1)
        return dq, dk_b, dv_b

    def finish(self, dq, like):
        return dq.astype(like.dtype)


class _DqInKernelState:
    """dq summed in the kernels' dQ state (DqStateCalls): a block's rows, counted in the step's
    order, sit in the state's (the accumulator's) order moved by half the rows if `moved`,
    which with whole tiles is a rotation of the state's rows."""

    def __init__(self, calls: DqStateCalls):
        self.calls = calls

    @staticmethod
    def fits(swapped: bool, steps, length: int) -> bool:
        """Whether every block of `steps` is whole tiles of a state of `length` rows (counted
        with the halves exchanged if `swapped`), moved by whole tiles."""
        def whole(*rows):
            return all(r % _TILE == 0 for r in rows)
        return whole(length) and all(
            whole(b.q_start, b.q_stop) and (step.rows_swapped == swapped or whole(length // 2))
            for step in steps for blocks in step.branches for b in blocks)

    def start(self, q, o, lse, do, dlse):
        return self.calls.row_stats(o, lse, do, dlse)

    def add(self, state, b: plans.Block, moved: bool, saved, kv, masks: dict):
        q, _, _, do, _, _ = saved
        length = q.shape[1]
        rows, keys = slice(b.q_start, b.q_stop), slice(b.k_start, b.k_stop)
        shift = (b.q_start + (length // 2 if moved else 0)) % length
        return self.calls.keys(state, q[:, rows], kv[0][:, keys], kv[1][:, keys], do[:, rows],
                               dq_rows=length, dq_row_shift=shift,
                               window_left=b.window_left, window_right=b.window_right, **masks)

    def finish(self, state, like):
        return self.calls.dq(state, like)


def _dq_sum(attend_bwd: BlockBackward, dq_state: DqStateCalls | None, swapped: bool, steps,
            length):
    """How a backward of these steps sums dq (its accumulator's rows swapped or not): in the
    kernels' state where given and where the blocks fit its tiles, else here in float32."""
    if dq_state is not None and _DqInKernelState.fits(swapped, steps, length):
        return _DqInKernelState(dq_state)
    return _DqInFloat32(attend_bwd)


def _backward_blocks(dq_sum, saved, moved: bool, blocks, kv, dq, lengths=None):
    """This device's blocks against the keys `kv` = (k, v[, kv_segment_ids]): dq (dq_sum's
    state) with the blocks' share added, and the blocks' dk, dv contributions returned as
    float32 arrays shaped like k, v (zero where none). `saved` counts the rows in the step's
    order; `moved`: dq counts them with the halves exchanged (see _accumulator_rows)."""
    q, q_segment_ids = saved[0], saved[5]
    k, v = kv[:2]
    gk, gv = jnp.zeros_like(k, jnp.float32), jnp.zeros_like(v, jnp.float32)
    unwritten = np.ones(k.shape[1], bool)  # key rows no block has written yet: no add needed
    for b in blocks:
        rows, keys = slice(b.q_start, b.q_stop), slice(b.k_start, b.k_stop)
        masks = {**_segments(q_segment_ids, kv, rows, keys), **_length_masks(lengths, q.shape[0])}
        dq, dk_b, dv_b = dq_sum.add(dq, b, moved, saved, kv, masks)
        fresh = unwritten[keys].all()
        unwritten[keys] = False
        gk = replace_rows(gk, keys, dk_b.astype(jnp.float32) if fresh else
                          gk[:, keys] + dk_b.astype(jnp.float32), axis=1)
        gv = replace_rows(gv, keys, dv_b.astype(jnp.float32) if fresh else
                          gv[:, keys] + dv_b.astype(jnp.float32), axis=1)
    return dq, (gk, gv)


def ring_backward(q, k, v, o, lse, do, dlse=None, *, plan: plans.RingPlan,
                  axis_name: AxisName, attend_bwd: BlockBackward,
                  dq_state: DqStateCalls | None = None, q_segment_ids=None,
                  kv_segment_ids=None, neighbour_keys=None, order: Order = None):
    """(dq, dk, dv) in the dtypes of q, k, v, for the global o, lse of this device's queries
    and the cotangents do (and dlse, or None). neighbour_keys: the payload ring_forward kept
    (keep_neighbour_keys), which spares the first transfer; else it is sent again. dq_state:
    the kernels' three calls, which sum dq over the steps in their own state where the blocks
    are whole tiles (else attend_bwd's dq are summed here).

    The keys go around the ring again; the dK/dV partial sums (float32, one transfer per
    step) travel with their block, each device adding its share. With the neighbour keys
    kept, the steps with other devices' keys run first and the device's own block last: the
    partial sums of the own block then come home during its computation. Without them, the
    own block runs first, while the neighbour keys travel, and the sums' last hop is
    awaited at the end."""
    n, steps = plan.num_devices, len(plan.steps)
    own = _with_segments(k, v, kv_segment_ids)
    own_first = steps > 1 and neighbour_keys is None
    if steps > 1:
        # Tied to the forward's result and the cotangent, the backward's transfers belong to
        # the backward: their operands are ready early, and a scheduler that moves one into
        # the forward makes one of the forward's own transfers wait for it, with nothing to
        # overlap (the cotangent alone does not hold it back where the cotangent is an input
        # of the program rather than computed from o).
        if neighbour_keys is None:  # step 1's keys: the previous device's, sent now
            payload, (do, o) = _after(pack(own), (do, o))
            kv_words = send(payload, axis_name, n, order=order)
        else:  # ... or kept by the forward; the next transfer (step 2's keys) is tied
            kv_words, (do, o) = _after(neighbour_keys, (do, o))
    # The query-side arrays in each row order the steps count in (the swapped copies made
    # once), dq in the swapped one where there is one (see ring_forward).
    swapped = plan.rows_swapped
    saved = _in_row_orders(plan, [(q, 1), (o, 1), (lse, 2), (do, 1), (dlse, 2),
                                  (q_segment_ids, 1)])
    dq_sum = _dq_sum(attend_bwd, dq_state, swapped, plan.steps, q.shape[1])

    def branch(step):
        return functools.partial(_backward_blocks, dq_sum, saved[step.rows_swapped],
                                 step.rows_swapped != swapped)
    def own_block(dq):  # -> (dq, the own block's dk, dv)
        return _run_step(plan.steps[0], axis_name, branch(plan.steps[0]), own, dq, order=order)

    dq = dq_sum.start(*saved[swapped][:5])
    own_grads = None
    if own_first:
        dq, own_grads = own_block(dq)
    kv_likes = tuple(map(_shape_of, own))
    sum_likes = tuple(jax.ShapeDtypeStruct(x.shape, jnp.float32) for x in (k, v))
    home = None  # the other devices' share of this device's dk, dv
    if steps > 1:
        kv = unpack(kv_words, kv_likes)
        kv_count = sum(map(_word_count, kv_likes))
        finished = None  # partial sums of the block this device held in the previous step
        for index in range(1, steps):
            last = index == steps - 1
            # One payload, issued before this step's computation: this step's keys as they
            # came (for the receiver's next step) and the partial sums of the previous step's
            # block (the block the receiver holds now). The sums tie the transfer to the
            # previous step (see _after); the first one, with keys only, to nothing.
            parts = ([] if last else [kv_words]) + ([] if finished is None else [pack(finished)])
            received = send(jnp.concatenate(parts), axis_name, n, order=order) if parts else None
            step = plan.steps[index]
            dq, contribution = _run_step(step, axis_name, branch(step), kv, dq, order=order)
            if finished is not None:  # the previous devices' share of the block held now
                incoming = unpack(received[kv_count if not last else 0:], sum_likes)
                contribution = jax.tree.map(jnp.add, incoming, contribution)
            finished = contribution
            if not last:
                kv_words = received[:kv_count]
                kv = unpack(kv_words, kv_likes)
        # The partial sums of the last block go home (device r - (steps - 1) -> shift back),
        # while the device computes its own block if it has not yet.
        home = unpack(send(pack(finished), axis_name, n, shift=-(steps - 1), order=order),
                      sum_likes)
    if plan.steps and own_grads is None:
        dq, own_grads = own_block(dq)
    if own_grads is None:  # no step at all
        own_grads = jnp.zeros_like(k, jnp.float32), jnp.zeros_like(v, jnp.float32)
    dk, dv = own_grads
    if home is not None:
        dk, dv = dk + home[0], dv + home[1]
    dq = dq_sum.finish(dq, q)
    if swapped:
        dq = _swap_halves(dq, 1)
    return dq, dk.astype(k.dtype), dv.astype(v.dtype)


def whole_keys_backward(q, k, v, o, lse, do, dlse=None, *, step: plans.Step,
                        axis_name: AxisName, attend_bwd: BlockBackward,
                        dq_state: DqStateCalls | None = None, q_segment_ids=None,
                        kv_segment_ids=None, order: Order = None):
    """(dq in q's dtype, dk, dv float32 over all keys: this device's share, to be summed
    over the devices) with all keys and values on this device."""
    dq_sum = _dq_sum(attend_bwd, dq_state, False, (step,), q.shape[1])
    saved = (q, o, lse, do, dlse, q_segment_ids)
    branch = functools.partial(_backward_blocks, dq_sum, saved, False)
    dq, (gk, gv) = _run_step(step, axis_name, branch, _with_segments(k, v, kv_segment_ids),
                             dq_sum.start(*saved[:5]), order=order)
    return dq_sum.finish(dq, q), gk, gv


# ----------------------------------------------------------------------------------------------
# From the contiguous split to a load-balanced one and back. Contiguous, device r holds chunks 2r
# and 2r+1 of 2n. Causal work is even when every device holds a pair of chunks x and 2n-1-x, so
# device r keeps its even chunk 2r and trades its odd chunk with device n-1-r, which holds the
# chunk 2n-1-2r it lacks: half a shard each way between partners, every array of a call in one
# payload (one transfer). The pair is stored lower chunk first, and the device's ring position
# is the x of its pair (paired_order): the plans of the load-balanced layout (position x holds
# chunks x and 2n-1-x, in that order) hold as they are.


def _halves(x, axis):
    half = x.shape[axis] // 2
    return (lax.slice_in_dim(x, 0, half, axis=axis),
            lax.slice_in_dim(x, half, x.shape[axis], axis=axis))


def paired_order(n: int) -> tuple:
    """Per device, its ring position in the paired layout: the x of its chunks (x, 2n-1-x)."""
    return tuple(2 * r if 2 * r < n else 2 * n - 1 - 2 * r for r in range(n))


def _trade(outgoing: list, axis_name: AxisName, n: int) -> list:
    """The arrays `outgoing` as the partner (device n-1-r) sent them, in one transfer."""
    likes = [_shape_of(x) for x in outgoing]
    partners = [(r, n - 1 - r) for r in range(n)]
    return list(unpack(lax.ppermute(pack(outgoing), axis_name, partners), likes))


def _each_present(items, fn) -> list:
    """fn over the arrays of `items` ((array or None, its sequence axis) pairs) together;
    None stays None."""
    present = [(x, axis) for x, axis in items if x is not None]
    results = iter(fn(present) if present else [])
    return [None if x is None else next(results) for x, _ in items]


def to_paired(items, axis_name: AxisName, n: int) -> list:
    """This device's contiguous parts of the arrays `items` -> its parts in the paired
    layout."""
    keeps_lower = 2 * lax.axis_index(axis_name) < n  # its chunk 2r is the lower of its pair

    def move(present):
        halves = [_halves(x, axis) for x, axis in present]
        received = _trade([odd for _, odd in halves], axis_name, n)
        return [jnp.where(keeps_lower, jnp.concatenate([even, got], axis=axis),
                          jnp.concatenate([got, even], axis=axis))
                for (even, _), got, (_, axis) in zip(halves, received, present)]
    return _each_present(items, move)


def from_paired(items, axis_name: AxisName, n: int) -> list:
    """Inverse of to_paired."""
    keeps_lower = 2 * lax.axis_index(axis_name) < n  # its chunk 2r is the lower of its pair

    def move(present):
        halves = [_halves(x, axis) for x, axis in present]
        kept = [jnp.where(keeps_lower, lower, upper) for lower, upper in halves]
        received = _trade([jnp.where(keeps_lower, upper, lower) for lower, upper in halves],
                          axis_name, n)
        return [jnp.concatenate([even, odd], axis=axis)
                for even, odd, (_, axis) in zip(kept, received, present)]
    return _each_present(items, move)


# ----------------------------------------------------------------------------------------------
# flash_attention on a sequence-sharded input under jit: the partitioning rule's per-device
# program. The user's arrays are split contiguously along the sequence over `axis_name`.
#
# Masks: the call's segment ids (layouts "b tq" / "b tk") are split like q and k, take the same
# layout permutation, and reach the executors (the keys' travel with K/V in one payload; every
# block gets its slices). Lengths become segment ids (see takes and _segment_ids).


class SequencePlan:
    """How one sharded call runs: the layout the queries (and ring keys) are computed in, how
    K/V reach the queries, and the static block plan.

    exchange: "ring"       K/V split like the queries, passed around the ring;
              "all_gather" K/V split like the queries, gathered whole on every device;
              "whole_kv"   K/V already whole on every device (no transfer).
    layout:   "load_balanced" when a causal mask would otherwise leave the last devices with
              most of the work (the shards then go into the paired layout and back, one
              transfer of half a shard each way, the devices in paired_order on the ring);
              else "contiguous".
    """

    def __init__(self, *, num_devices, tq, tk, heads_q, heads_kv, head_dim, value_dim,
                 window_left, window_right, offset, kv_split):
        n = num_devices
        self.num_devices = n
        tq_local = tq // n
        tk_local = tk // n if kv_split else tk
        self.exchange = (_choose_exchange(n, tq_local, tk_local, heads_q, heads_kv, head_dim,
                                          value_dim) if kv_split else WHOLE_KV)

        def time_in(layout):
            if self.exchange == RING:
                plan = plans.ring_plan(n, layout, tq_local, tk_local, offset, window_left,
                                       window_right, by_lengths=steps_by_lengths())
                return plan, plans.ring_time(plan)
            step = plans.whole_keys_plan(n, layout, tq_local, tk, offset, window_left,
                                         window_right)
            return step, plans.whole_keys_time(step, n)

        self.layout = CONTIGUOUS
        self.plan, contiguous_time = time_in(CONTIGUOUS)
        # The ring permutes K/V into the layout too, so it needs equal query and key splits.
        can_balance = n > 1 and tq_local % 2 == 0 and (self.exchange != RING or tq == tk)
        if can_balance:
            balanced_plan, balanced_time = time_in(LOAD_BALANCED)
            if balanced_time < 0.8 * contiguous_time:
                self.layout, self.plan = LOAD_BALANCED, balanced_plan

    @property
    def balanced(self) -> bool:
        return self.layout == LOAD_BALANCED

    @property
    def order(self) -> Order:
        """The devices' ring positions (see paired_order), or None: their indices."""
        return paired_order(self.num_devices) if self.balanced else None

    def __repr__(self):
        return f"SequencePlan(exchange={self.exchange!r}, layout={self.layout!r})"


# Rough machine constants of the exchange choice (H100/H200 with NVLink): HBM and the ring's
# per-device link bandwidth as NCCL collective-permutes reach them.
_HBM_BYTES_PER_S = 3.0e12
_LINK_BYTES_PER_S = 1.5e11


def _choose_exchange(n, tq_local, tk_local, heads_q, heads_kv, head_dim, value_dim) -> str:
    """Ring or all-gather of K/V, from what each costs beyond the attention itself.

    The ring hides its transfers behind the computation but merges partial results in float32
    every step: per device and step about 10 bytes per query element forward (o, lse) and
    8 (dq) plus 12 per key element (dk, dv) backward, through HBM. The all-gather needs no
    merge, but its transfers wait: (n-1) blocks of K and V forward, and in the backward once
    more plus a reduce-scatter of float32 dK/dV, over the link. With few KV heads the
    transfers are small and the all-gather wins; with as many KV heads as query heads the
    ring does. An all-gather that would hold more K/V than twice the local queries is not
    taken (memory). TK_JAX_CONTEXT_PARALLEL=ring|all_gather overrides the choice."""
    forced = _env_choice(EXCHANGE_ENV, (RING, ALL_GATHER, "auto"), "auto")
    if forced != "auto":
        return forced
    steps = n - 1
    q_elems = tq_local * heads_q * head_dim
    kv_elems = tk_local * heads_kv * (head_dim + value_dim)
    ring_s = steps * (10 * q_elems + 8 * q_elems + 12 * kv_elems) / _HBM_BYTES_PER_S
    gather_s = steps * kv_elems * (2 + 2 + 4) / _LINK_BYTES_PER_S
    fits = n * kv_elems <= 2 * tq_local * heads_q * value_dim
    return ALL_GATHER if fits and gather_s < ring_s else RING


def _kernel_calls(fn, static: dict, *, backward: bool):
    """The per-block kernel calls of the sharded program: fn (the kernel the partitioning rule
    wraps) with the block's window in place of the call's own."""
    base = {k: v for k, v in static.items() if k not in ("window_left", "window_right")}
    if "bottom_right" in base:  # blocks are planned bottom-right aligned on their rectangle
        base["bottom_right"] = True
    if backward:
        def attend_bwd(q, k, v, o, lse, do, dlse, window_left, window_right, **masks):
            extra = () if dlse is None else (dlse,)
            return tuple(fn(q, k, v, o, lse, do, *extra, window_left=window_left,
                            window_right=window_right, **base, **masks))
        return attend_bwd

    def attend(q, k, v, window_left, window_right, **masks):
        return tuple(fn(q, k, v, window_left=window_left, window_right=window_right, **base,
                        **masks))
    return attend


def plan_for(static: dict, q_shape, k_shape, v_shape, num_devices: int,
             kv_split: bool) -> SequencePlan:
    """The SequencePlan of a call with these global shapes ([B, T, H, D]) and static args."""
    tq, tk = q_shape[1], k_shape[1]
    offset = tk - tq if static.get("bottom_right", True) else 0
    return SequencePlan(num_devices=num_devices, tq=tq, tk=tk, heads_q=q_shape[2],
                        heads_kv=k_shape[2], head_dim=q_shape[3], value_dim=v_shape[3],
                        window_left=static["window_left"], window_right=static["window_right"],
                        offset=offset, kv_split=kv_split)


def _to_plan_layout(plan: SequencePlan, axis_name: AxisName, queries, keys) -> tuple:
    """(query-side arrays, key-side arrays) in the layout the plan computes in: each given as
    (array or None, its sequence axis). Load-balanced: the query side is permuted, the key
    side too when it travels the ring (gathered or whole, it is in global order anyway)."""
    def unchanged(items):
        return [x for x, _ in items]

    if not plan.balanced:
        return unchanged(queries), unchanged(keys)
    if plan.exchange != RING:
        return to_paired(queries, axis_name, plan.num_devices), unchanged(keys)
    moved = to_paired(queries + keys, axis_name, plan.num_devices)  # one transfer
    return moved[:len(queries)], moved[len(queries):]


def _gathered(axis_name: AxisName, *arrays) -> list:
    """Every device's part of each array (None stays None), along the sequence (axis 1)."""
    return [None if x is None else lax.all_gather(x, axis_name, axis=1, tiled=True)
            for x in arrays]


def sequence_sharded_forward(fn, static: dict, plan: SequencePlan, axis_name: AxisName,
                             q, k, v, q_segment_ids=None, kv_segment_ids=None):
    """Per device: (o, lse) of the local queries, in the contiguous split they came in.
    Segment ids (both or neither) are split like q and k."""
    attend = _kernel_calls(fn, static, backward=False)
    (q, q_seg), (k, v, kv_seg) = _to_plan_layout(
        plan, axis_name, [(q, 1), (q_segment_ids, 1)], [(k, 1), (v, 1), (kv_segment_ids, 1)])
    if plan.exchange == RING:
        o, lse = ring_forward(q, k, v, plan=plan.plan, axis_name=axis_name, attend=attend,
                              q_segment_ids=q_seg, kv_segment_ids=kv_seg, order=plan.order)
    else:
        if plan.exchange == ALL_GATHER:
            k, v, kv_seg = _gathered(axis_name, k, v, kv_seg)
        o, lse = whole_keys_forward(q, k, v, step=plan.plan, axis_name=axis_name,
                                    attend=attend, q_segment_ids=q_seg, kv_segment_ids=kv_seg,
                                    order=plan.order)
    if plan.balanced:
        o, lse = from_paired([(o, 1), (lse, 2)], axis_name, plan.num_devices)
    return o, lse


def sequence_sharded_backward(fn, static: dict, plan: SequencePlan, axis_name: AxisName,
                              q, k, v, o, lse, do, dlse=None, q_segment_ids=None,
                              kv_segment_ids=None):
    """Per device: (dq, dk, dv) of the local shards, in the split they came in."""
    from tk_jax.attention import attention_bwd_state_calls
    attend_bwd = _kernel_calls(fn, static, backward=True)
    dq_state = attention_bwd_state_calls(scale=static["scale"], backend="kernel")
    (q, o, do, lse, dlse, q_seg), (k, v, kv_seg) = _to_plan_layout(
        plan, axis_name, [(q, 1), (o, 1), (do, 1), (lse, 2), (dlse, 2), (q_segment_ids, 1)],
        [(k, 1), (v, 1), (kv_segment_ids, 1)])
    segments = dict(q_segment_ids=q_seg, kv_segment_ids=kv_seg)
    if plan.exchange == RING:
        dq, dk, dv = ring_backward(q, k, v, o, lse, do, dlse, plan=plan.plan,
                                   axis_name=axis_name, attend_bwd=attend_bwd,
                                   dq_state=dq_state, order=plan.order, **segments)
    else:
        k_local, v_local = k, v
        if plan.exchange == ALL_GATHER:
            k, v, segments["kv_segment_ids"] = _gathered(axis_name, k, v, kv_seg)
        dq, gk, gv = whole_keys_backward(q, k, v, o, lse, do, dlse, step=plan.plan,
                                         axis_name=axis_name, attend_bwd=attend_bwd,
                                         dq_state=dq_state, order=plan.order, **segments)
        if plan.exchange == ALL_GATHER:  # each device's share of every key, summed at home
            gk, gv = (lax.psum_scatter(g, axis_name, scatter_dimension=1, tiled=True)
                      for g in (gk, gv))
        else:
            gk, gv = lax.psum((gk, gv), axis_name)
        dk, dv = gk.astype(k_local.dtype), gv.astype(v_local.dtype)
    if plan.balanced:
        if plan.exchange == RING:
            dq, dk, dv = from_paired([(dq, 1), (dk, 1), (dv, 1)], axis_name, plan.num_devices)
        else:
            dq, = from_paired([(dq, 1)], axis_name, plan.num_devices)
    return dq, dk, dv


# Segment ids that mark padding (positions past a row's length): a query there sees nothing,
# a key there is seen by nothing. Values no packing scheme uses.
_PAD_QUERY, _PAD_KEY = np.int32(-2**31), np.int32(-2**31 + 1)
_LENGTHS = ("q_seq_lengths", "kv_seq_lengths")


def takes(sequence: tuple, static: dict) -> bool:
    """Whether context parallelism runs a call with these masks (sequence = (kind, mask
    names)) and static arguments. Lengths become segment ids (positions past a length get an
    id nothing else has), which is exact when the mask's alignment does not depend on them:
    top-left (bottom_right=False, jax.nn's alignment). Bottom-right with lengths moves each
    row's diagonal by kv_len - q_len, a per-row offset the static plans do not have: such a
    call is gathered."""
    _, names = sequence
    return static.get("bottom_right", True) is False or not any(n in _LENGTHS for n in names)


def _segment_ids(masks: dict, q_local: int, k_local: int, kv_split: bool, axis_name):
    """(q_segment_ids, kv_segment_ids) of this device's queries and keys ([B, T] int32, or
    both None without masks), with lengths folded in (see takes)."""
    if not masks:
        return None, None
    batch = next(iter(masks.values())).shape[0]
    me = lax.axis_index(axis_name)
    q_seg = masks.get("q_segment_ids")
    kv_seg = masks.get("kv_segment_ids")
    q_seg = jnp.zeros((batch, q_local), jnp.int32) if q_seg is None else q_seg
    kv_seg = jnp.zeros((batch, k_local), jnp.int32) if kv_seg is None else kv_seg
    if "q_seq_lengths" in masks:
        positions = me * q_local + jnp.arange(q_local)
        q_seg = jnp.where(positions < masks["q_seq_lengths"][:, None], q_seg, _PAD_QUERY)
    if "kv_seq_lengths" in masks:
        positions = (me * k_local if kv_split else 0) + jnp.arange(k_local)
        kv_seg = jnp.where(positions < masks["kv_seq_lengths"][:, None], kv_seg, _PAD_KEY)
    return q_seg, kv_seg


def sequence_sharded_program(sequence: tuple, fn, static: dict, mesh, sequence_axes: tuple,
                             kv_split: bool, global_shapes) -> Callable:
    """The per-device program of an attention kernel call (sequence = ("forward" or
    "backward", the names of its mask operands): fn is the forward or the backward kernel,
    taking the masks as trailing positional arrays) whose queries are split along the sequence
    over the mesh axes `sequence_axes` (K/V too when kv_split, else whole). Called by the
    partitioning rule (tk_jax/_partitioning.py), with the global shapes of the operands."""
    kind, names = sequence
    kernel = getattr(fn, "__wrapped__", fn) if names else fn  # masks as keywords
    axis_name = sequence_axes[0] if len(sequence_axes) == 1 else tuple(sequence_axes)
    n = int(np.prod([mesh.shape[a] for a in sequence_axes]))
    q_shape, k_shape, v_shape = global_shapes[:3]
    plan = plan_for(static, q_shape, k_shape, v_shape, n, kv_split)
    q_local, k_local = q_shape[1] // n, k_shape[1] // n if kv_split else k_shape[1]

    def program(*arrays):
        split = len(arrays) - len(names)
        arrays, masks = arrays[:split], dict(zip(names, arrays[split:]))
        q_seg, kv_seg = _segment_ids(masks, q_local, k_local, kv_split, axis_name)
        run = sequence_sharded_forward if kind == "forward" else sequence_sharded_backward
        return run(kernel, static, plan, axis_name, *arrays, q_segment_ids=q_seg,
                   kv_segment_ids=kv_seg)

    if kind not in ("forward", "backward"):
        raise ValueError(f"kind must be 'forward' or 'backward', got {kind!r}")
    return program
