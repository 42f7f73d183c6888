"""A list-scheduling model of how evenly a causal attention grid's blocks finish.

Each of `sms` SMs runs one block at a time; blocks start in launch order on the SM that frees
first; a block's time is its key tiles (the band it sees) plus a fixed start-up and write-out.
Prints, per shape, the last SM's finish over the mean (1.00 = perfectly even) for the plain
forward grid in the pair-after-pair order (main's) and in groups of pairs, position-major inside
a group (the backward's key_block_of order; branch exp/forward-plain-groups gives it to the
forward, with the group rule below):

    python3 scripts/balance_model.py --d 128 --t 8k

The model ignores L2, clocks and how wgmma work overlaps; bench/NOTES.md compares it with
measurements (sessions 20 and 21; a per-block trace in s21-10 agrees at D=128 causal 8k)."""
import argparse
import heapq

from tk_jax.bench.__main__ import parse_int_list
from tk_jax.bench.attention import make_configs


def grouped(runs, pairs, group):
    """(position, pair) in launch order: pairs in groups, position-major inside a group."""
    order = []
    for first in range(0, pairs, group):
        size = min(group, pairs - first)
        order += [(i // size, first + i % size) for i in range(runs * size)]
    return order


def makespan_over_mean(works, sms):
    finish = [0.0] * sms
    for w in works:
        heapq.heappush(finish, heapq.heappop(finish) + w)
    return max(finish) / (sum(works) / sms)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--d", type=int, default=128)
    parser.add_argument("--t", type=parse_int_list, default=[8192])
    parser.add_argument("--sms", type=int, default=132)
    parser.add_argument("--overhead", type=float, default=3.0,
                        help="a block's fixed cost, in key tiles (D=128 traced: 3.1, s21-10)")
    args = parser.parse_args()
    configs = make_configs(args.t[:1], (args.d,), (True,), (False,))  # the bench grid's shapes
    assert configs, f"T={args.t[0]}, D={args.d} is not a bench grid shape"
    t, batch, heads = configs[0].t, configs[0].batch, configs[0].heads
    q_rows = 192 if args.d == 64 and t > 2048 else 128  # the launcher's consumers (forward_consumers)
    kv = 64 if args.d == 256 else 128
    runs, pairs = -(-t // q_rows), batch * heads

    def works(group):  # position 0 is the heaviest query block (the last one under a causal mask)
        return [min(t, (runs - pos) * q_rows) / kv + args.overhead for pos, _ in grouped(runs, pairs, group)]

    group = 1
    while group < pairs and group * runs < 2 * args.sms:
        group *= 2
    print(f"D={args.d} T={t} B={batch} H={heads}: {runs} query blocks a pair, {pairs} pairs")
    print(f"  pair after pair:         {makespan_over_mean(works(1), args.sms):.3f}")
    print(f"  groups of {group:3d} (the rule): {makespan_over_mean(works(group), args.sms):.3f}")


if __name__ == "__main__":
    main()
