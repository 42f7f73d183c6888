"""Static plans of context-parallel attention: which (query, key) blocks each device computes,
with which mask, in which step of the ring.

Plain Python and NumPy on shapes and positions, decided while tracing; tk_jax/_context_parallel.py
runs the plans. Nothing here knows JAX.

The global mask is flash_attention's (bottom-right aligned): query i sees key j iff
    (window_left  < 0 or j >= i + offset - window_left) and
    (window_right < 0 or j <= i + offset + window_right),        offset = Tk - Tq
(causal: window_right = 0). A device holds its part of a sequence as chunks: runs of
consecutive global positions, stored one after the other in its local arrays. Layouts:

    contiguous     device r holds positions [r L, (r+1) L)             (L = local length)
    load_balanced  device r holds chunks r and 2n-1-r of 2n equal chunks, in that order
    whole          every device holds the whole sequence (K/V after an all-gather)

For one device, its query chunks and one set of key chunks, the visible pairs are cut into
blocks: a block is one kernel call on a rectangle of local rows and local keys whose visible
pairs are exactly those of a band mask (window_left', window_right' >= 0 or -1, bottom-right
aligned on the rectangle). Rows and keys that see nothing are trimmed away, so a pair of
chunks that shares no visible pair costs no call at all. Where one band covers all the
device's chunks (the load-balanced causal diagonal: the local order is the global order) it
is one call; otherwise one call per pair of chunks, with unmasked neighbours merged.

A ring step s: device r holds the keys that started on device (r - s) mod n. The blocks of a
step differ between devices; the distinct block lists are the step's branches (a switch on
the device index runs the right one), and a step where no device has a block is skipped.
"""
from __future__ import annotations

import dataclasses
import functools

import numpy as np

CONTIGUOUS, LOAD_BALANCED, WHOLE = "contiguous", "load_balanced", "whole"
LAYOUTS = (CONTIGUOUS, LOAD_BALANCED, WHOLE)


@dataclasses.dataclass(frozen=True)
class Chunk:
    """`length` consecutive global positions from `global_start`, stored at local rows
    [local_start, local_start + length)."""

    local_start: int
    global_start: int
    length: int


@dataclasses.dataclass(frozen=True)
class Block:
    """One kernel call: local query rows [q_start, q_stop) against local keys
    [k_start, k_stop), under the band (window_left, window_right) bottom-right aligned on that
    rectangle. `pairs` is the number of visible (query, key) pairs: the work."""

    q_start: int
    q_stop: int
    k_start: int
    k_stop: int
    window_left: int
    window_right: int
    pairs: int

    @property
    def unmasked(self) -> bool:
        return self.window_left < 0 and self.window_right < 0


Blocks = tuple  # tuple[Block, ...]: one device's calls for one set of keys


@dataclasses.dataclass(frozen=True)
class Lengths:
    """A step as one call on every device: local rows [0, rows) x keys [0, keys), unmasked, of
    which device r computes rows [0, q_lengths[r]) x keys [0, kv_lengths[r]) (given to the
    kernels as sequence lengths: rows past q_len come back o = 0, lse = -inf, zero dq; keys
    past kv_len are seen by no row and get zero dk, dv)."""

    rows: int
    keys: int
    q_lengths: tuple  # tuple[int, ...], per device
    kv_lengths: tuple

    @property
    def block(self) -> Block:
        return Block(0, self.rows, 0, self.keys, -1, -1, self.rows * self.keys)


@dataclasses.dataclass(frozen=True)
class Step:
    """One set of keys per device (ring step `distance`: the keys of device r - distance).
    Device r runs branches[branch_of_device[r]] (an empty tuple: nothing to compute), or, where
    `lengths` is set, every device runs lengths.block with its own lengths instead.

    rows_swapped: the blocks count the device's query rows with the two halves of its local
    rows exchanged (the load-balanced layout's second chunk first); else in the layout's
    order."""

    distance: int
    branches: tuple  # tuple[Blocks, ...]
    branch_of_device: tuple  # tuple[int, ...]
    rows_swapped: bool = False
    lengths: Lengths | None = None

    def blocks_of(self, device: int) -> Blocks:
        return self.branches[self.branch_of_device[device]]

    def pairs_of(self, device: int) -> int:
        return sum(b.pairs for b in self.blocks_of(device))

    @property
    def empty(self) -> bool:
        return not any(self.branches)


@dataclasses.dataclass(frozen=True)
class RingPlan:
    """Steps 0 .. len(steps) - 1 of a ring (each passes the keys on by one device); the steps
    after the last one with work are left out, so the keys travel no further than needed."""

    num_devices: int
    steps: tuple  # tuple[Step, ...]

    @property
    def rows_swapped(self) -> bool:
        """Whether some step counts the query rows swapped (the executor then keeps its
        accumulators in that order)."""
        return any(s.rows_swapped for s in self.steps)

    @property
    def hops(self) -> int:
        """Transfers of a key block along the ring (one per step after the first)."""
        return max(len(self.steps) - 1, 0)

    def step_times(self) -> list[int]:
        """Per step, the work of its busiest device: the devices wait for each other at every
        step, so this is what a step costs."""
        return [max(s.pairs_of(r) for r in range(self.num_devices)) for s in self.steps]


# ----------------------------------------------------------------------------------------------
# Layouts.


def swapped_chunks(chunks: tuple, length: int) -> tuple:
    """`chunks` of `length` local rows as they sit with the two halves of the rows exchanged
    (each chunk must lie within one half, as the load-balanced layout's do)."""
    half = length // 2
    return tuple(Chunk((c.local_start + half) % length, c.global_start, c.length) for c in chunks)


def layout_chunks(layout: str, device: int, num_devices: int, length: int) -> tuple:
    """The chunks of a device's `length` local positions in `layout`."""
    if layout == CONTIGUOUS:
        return (Chunk(0, device * length, length),)
    if layout == WHOLE:
        return (Chunk(0, 0, length),)
    if layout == LOAD_BALANCED:
        if length % 2:
            raise ValueError(f"the load-balanced layout needs an even local length, got {length}")
        half = length // 2
        return (Chunk(0, device * half, half),
                Chunk(half, (2 * num_devices - 1 - device) * half, half))
    raise ValueError(f"unknown layout {layout!r}; expected one of {LAYOUTS}")


# ----------------------------------------------------------------------------------------------
# Blocks of one device against one set of keys.


def _visible_intervals(q_chunks, k_chunks, q_length, offset, window_left, window_right):
    """Per local query row: the lowest and highest local key it sees and how many it sees
    (count 0: none; rows outside q_chunks see none)."""
    rows = np.full(q_length, -1, np.int64)         # global position of each local row
    held = np.zeros(q_length, bool)
    for c in q_chunks:
        rows[c.local_start:c.local_start + c.length] = c.global_start + np.arange(c.length)
        held[c.local_start:c.local_start + c.length] = True
    big = np.iinfo(np.int64).max // 4
    first = rows + offset - window_left if window_left >= 0 else np.full(q_length, -big)
    last = rows + offset + window_right if window_right >= 0 else np.full(q_length, big)
    lo = np.full(q_length, big)
    hi = np.full(q_length, -1)
    count = np.zeros(q_length, np.int64)
    for c in k_chunks:
        a = np.maximum(first, c.global_start)
        b = np.minimum(last, c.global_start + c.length - 1)
        seen = held & (a <= b)
        lo = np.where(seen, np.minimum(lo, a - c.global_start + c.local_start), lo)
        hi = np.where(seen, np.maximum(hi, b - c.global_start + c.local_start), hi)
        count += np.where(seen, b - a + 1, 0)
    return lo, hi, count


def _band(lo, hi, start, stop) -> Block | None:
    """Rows [start, stop) (each seeing keys lo..hi, all of them) as one kernel call, if their
    keys form a band of the rectangle they span; else None."""
    i = np.arange(stop - start)
    lo, hi = lo[start:stop], hi[start:stop]
    k_start, k_stop = int(lo.min()), int(hi.max()) + 1
    tq, tk = stop - start, k_stop - k_start
    offset = tk - tq
    lo, hi = lo - k_start, hi - k_start

    def window(edge_at_limit, distance):
        """The window for one edge: -1 if every row reaches the rectangle's side, else the
        one distance >= 0 from the diagonal that every other row's edge sits at."""
        if edge_at_limit.all():
            return -1
        values = np.unique(distance[~edge_at_limit])
        if len(values) != 1 or values[0] < 0:
            return None
        return int(values[0])

    right = window(hi == tk - 1, hi - i - offset)
    left = window(lo == 0, i + offset - lo)
    if right is None or left is None:
        return None
    # The rows at the rectangle's sides must agree with the band too.
    want_hi = np.minimum(tk - 1, i + offset + right) if right >= 0 else np.full(tq, tk - 1)
    want_lo = np.maximum(0, i + offset - left) if left >= 0 else np.zeros(tq, np.int64)
    if not (np.array_equal(want_hi, hi) and np.array_equal(want_lo, lo)):
        return None
    return Block(start, stop, k_start, k_stop, left, right, int((hi - lo + 1).sum()))


def _blocks_of_rows(lo, hi, count) -> Blocks | None:
    """The rows that see something, as one call, if they are one run whose keys form a band."""
    seen = count > 0
    if not seen.any():
        return ()
    rows = np.flatnonzero(seen)
    start, stop = int(rows[0]), int(rows[-1]) + 1
    if not seen[start:stop].all() or not np.array_equal(
            count[start:stop], hi[start:stop] - lo[start:stop] + 1):
        return None
    block = _band(lo, hi, start, stop)
    return None if block is None else (block,)


def _merge_unmasked(blocks: list) -> list:
    """Merge unmasked blocks that share their keys and have adjacent rows, or share their rows
    and have adjacent keys: one larger call instead of two calls and a merge."""
    merged = True
    while merged:
        merged = False
        for x in range(len(blocks)):
            for y in range(len(blocks)):
                a, b = blocks[x], blocks[y]
                if x == y or not (a.unmasked and b.unmasked):
                    continue
                same_keys = (a.k_start, a.k_stop) == (b.k_start, b.k_stop) and a.q_stop == b.q_start
                same_rows = (a.q_start, a.q_stop) == (b.q_start, b.q_stop) and a.k_stop == b.k_start
                if same_keys or same_rows:
                    union = Block(a.q_start, b.q_stop if same_keys else a.q_stop,
                                  a.k_start, b.k_stop if same_rows else a.k_stop,
                                  -1, -1, a.pairs + b.pairs)
                    blocks = [c for z, c in enumerate(blocks) if z not in (x, y)] + [union]
                    merged = True
                    break
            if merged:
                break
    return sorted(blocks, key=lambda b: (b.q_start, b.k_start))


def device_blocks(q_chunks, k_chunks, q_length, offset, window_left, window_right) -> Blocks:
    """The kernel calls one device makes for its queries (q_chunks, q_length local rows)
    against one set of keys (k_chunks). Empty: no visible pair."""
    lo, hi, count = _visible_intervals(q_chunks, k_chunks, q_length, offset, window_left,
                                       window_right)
    whole = _blocks_of_rows(lo, hi, count)
    if whole is not None:
        return whole
    blocks = []
    for qc in q_chunks:
        for kc in k_chunks:
            pair = _blocks_of_rows(*_visible_intervals((qc,), (kc,), q_length, offset,
                                                       window_left, window_right))
            if pair is None:  # a band cut by two rectangles' edges is always a band
                raise AssertionError(f"no band for chunks {qc} x {kc}")
            blocks.extend(pair)
    return tuple(_merge_unmasked(blocks))


# ----------------------------------------------------------------------------------------------
# Plans.


def _step(distance, device_lists, rows_swapped: bool = False) -> Step:
    branches, index = [], []
    for blocks in device_lists:
        if blocks not in branches:
            branches.append(blocks)
        index.append(branches.index(blocks))
    return Step(distance, tuple(branches), tuple(index), rows_swapped)


def _prefix_lengths(step: Step) -> Lengths | None:
    """The step as one call with per-device lengths, if every device's blocks are one unmasked
    rectangle from local row 0 and key 0."""
    q_lengths, kv_lengths = [], []
    for device in range(len(step.branch_of_device)):
        blocks = step.blocks_of(device)
        if len(blocks) != 1 or not blocks[0].unmasked or blocks[0].q_start or blocks[0].k_start:
            return None
        q_lengths.append(blocks[0].q_stop)
        kv_lengths.append(blocks[0].k_stop)
    return Lengths(max(q_lengths), max(kv_lengths), tuple(q_lengths), tuple(kv_lengths))


@functools.lru_cache(maxsize=256)
def ring_plan(num_devices: int, layout: str, q_length: int, k_length: int, offset: int,
              window_left: int, window_right: int, by_lengths: bool = True) -> RingPlan:
    """The ring's steps: queries and keys both in `layout` (q_length / k_length local
    positions per device), keys passed on one device per step.

    by_lengths: a step whose devices differ runs as one call with per-device lengths where it
    fits (in the layout's row order, else with the rows swapped; see the module docstring);
    False: every such step is a switch."""
    q_chunks = [layout_chunks(layout, r, num_devices, q_length) for r in range(num_devices)]
    k_chunks = [layout_chunks(layout, r, num_devices, k_length) for r in range(num_devices)]

    def step(s, rows_swapped):
        return _step(s, [device_blocks(
            swapped_chunks(q_chunks[r], q_length) if rows_swapped else q_chunks[r],
            k_chunks[(r - s) % num_devices], q_length, offset, window_left, window_right)
            for r in range(num_devices)], rows_swapped)

    def planned_step(s):
        plain = step(s, False)
        if not by_lengths or len(plain.branches) == 1:
            return plain
        # Exchanging the halves moves whole chunks only where the chunks are the halves.
        candidates = [plain] + ([step(s, True)] if layout == LOAD_BALANCED else [])
        for candidate in candidates:
            lengths = _prefix_lengths(candidate)
            if lengths is not None:
                return dataclasses.replace(candidate, lengths=lengths)
        return plain

    steps = [planned_step(s) for s in range(num_devices)]
    while steps and steps[-1].empty:
        steps.pop()
    return RingPlan(num_devices, tuple(steps))


@functools.lru_cache(maxsize=256)
def whole_keys_plan(num_devices: int, layout: str, q_length: int, k_total: int, offset: int,
                    window_left: int, window_right: int) -> Step:
    """The calls of each device when it holds all the keys (k_total, in global order) and its
    queries in `layout`."""
    keys = layout_chunks(WHOLE, 0, num_devices, k_total)
    return _step(0, [device_blocks(layout_chunks(layout, r, num_devices, q_length), keys,
                                   q_length, offset, window_left, window_right)
                     for r in range(num_devices)])


def ring_time(plan: RingPlan) -> int:
    """The ring's compute time in visible pairs: the sum over steps of the busiest device."""
    return sum(plan.step_times())


def whole_keys_time(step: Step, num_devices: int) -> int:
    """Compute time in visible pairs with all keys on every device: the busiest device."""
    return max(step.pairs_of(r) for r in range(num_devices))
