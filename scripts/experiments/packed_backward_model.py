"""How a packed row's backward would spread if blocks owned whole documents (no GPU): each
document up to L tokens a unit of one block per KV head (its key blocks of 128 and query tiles
of 64 counted from the document's start, its GQA group's query heads walked by the block),
longer documents as today's 128-key blocks; the units claimed heaviest first by 132 blocks.
Prints, per layout of the packed bench and L, the share of tokens in owned documents (the rows
whose dQ would need no zeroing, conversion or row-statistics pass) and the makespan over the
ideal spread. L = infinity (every document owned) is the first line of each layout.

    python3 scripts/experiments/packed_backward_model.py
"""
import heapq
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from bench import packed  # noqa: E402

BLOCKS, KV_HEADS, GROUP, KEY_BLOCK, QUERY_TILE = 132, 4, 4, 128, 64  # the bench's 16 / 4 heads
OWNED_START_UP, KEY_BLOCK_START_UP = 2, 1  # steps a unit costs beyond its steps (a guess)


def query_tiles_from(n: int, key: int) -> int:
    """Query tiles of a causal document of n tokens that see key `key` or later keys."""
    return -(-n // QUERY_TILE) - key // QUERY_TILE


def owned_steps(n: int) -> int:
    """(key block, query tile) steps of a document of n tokens walked by one block, a head."""
    return sum(query_tiles_from(n, j) for j in range(0, n, KEY_BLOCK))


def makespan(costs) -> float:
    loads = [0.0] * BLOCKS
    for c in sorted(costs, reverse=True):
        heapq.heappush(loads, heapq.heappop(loads) + c)
    return max(loads)


def units(documents, limit) -> list:
    costs = []
    for n in documents:
        if n <= limit:
            costs += [GROUP * owned_steps(n) + OWNED_START_UP] * KV_HEADS
        else:
            for j in range(0, n, KEY_BLOCK):
                costs += [GROUP * query_tiles_from(n, j) + KEY_BLOCK_START_UP] * KV_HEADS
    return costs


def main():
    for layout in packed.LAYOUTS:
        documents = [n for row in packed.document_lengths(layout, 4, 16384) for n in row]
        for limit in (float("inf"), 512, 1024, 2048):
            costs = units(documents, limit)
            owned = sum(n for n in documents if n <= limit) / sum(documents)
            print(f"{layout:10s} L={limit:>6}: tokens in owned documents {owned:.2f}, "
                  f"makespan {makespan(costs) / (sum(costs) / BLOCKS):.3f} of the ideal")


if __name__ == "__main__":
    main()
