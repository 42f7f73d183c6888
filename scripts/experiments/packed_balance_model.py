"""How evenly the forward's blocks finish on packed rows (no GPU): the bench's documents cut
into query tiles as the segment-id prologue cuts them (segment_ranges.cuh: a tile at every start
of a document of >= 64 tokens, then every 128 rows), each (tile, head) an item costing its key
tiles plus a start-up, and 132 blocks taking the items dealt in turn (the unmasked persistent
grid's order), claimed in turn, or claimed heaviest first. Prints each makespan over the ideal.

    python3 scripts/experiments/packed_balance_model.py
"""
import heapq
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import numpy as np  # noqa: E402

from bench import packed  # noqa: E402

BLOCKS, HEADS, TILE, ANCHOR_RUN, START_UP = 132, 16, 128, 64, 0.5


def item_costs(row):
    """Key tiles of each query tile of one row, causal within documents."""
    starts = np.cumsum([0] + list(row))
    ids = np.repeat(np.arange(len(row)), row)
    total = int(starts[-1])
    anchors = sorted({0} | {int(s) for s, n in zip(starts[:-1], row) if n >= ANCHOR_RUN})
    costs = []
    for i, a in enumerate(anchors):
        stop = anchors[i + 1] if i + 1 < len(anchors) else total
        for q0 in range(a, stop, TILE):
            q_end = min(q0 + TILE, stop)
            first_key = starts[ids[q0]]
            costs.append(-(-(q_end - first_key) // TILE))
    return costs


def makespan(costs, order):
    loads = [(0.0, b) for b in range(BLOCKS)]
    for c in order(costs):
        load, b = heapq.heappop(loads)
        heapq.heappush(loads, (load + c, b))
    return max(load for load, _ in loads)


def dealt(costs):
    loads = np.zeros(BLOCKS)
    for t, c in enumerate(costs):
        n, x = divmod(t, BLOCKS)
        loads[x if n % 2 == 0 else BLOCKS - 1 - x] += c
    return loads.max()


def main():
    for layout in packed.LAYOUTS:
        rows = packed.document_lengths(layout, 4, 16384)
        costs = [c + START_UP for row in rows for c in item_costs(row) for _ in range(HEADS)]
        ideal = sum(costs) / BLOCKS
        print(f"{layout:10s} {len(costs)} items: dealt {dealt(costs) / ideal:.3f}, claimed in turn "
              f"{makespan(costs, list) / ideal:.3f}, heaviest first "
              f"{makespan(costs, lambda c: sorted(c, reverse=True)) / ideal:.3f} of the ideal")


if __name__ == "__main__":
    main()
