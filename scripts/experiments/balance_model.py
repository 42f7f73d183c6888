"""A list-scheduling model of how evenly a causal attention grid's blocks finish.

Each of `sms` SMs runs one block at a time; blocks start in launch order on the SM that frees
first; a block's time is its key tiles (the band it sees) plus a fixed start-up and write-out.
Prints, per shape, the last SM's finish over the mean (1.00 = perfectly even) and the time
against the first order for three ways of running the forward's query blocks:
- pair after pair: the plain grid, each (batch, head) pair's heaviest query block first
  (the forward's order for pairs with more than sms/2 query blocks);
- groups of pairs, position-major inside a group (the backward's block_order; timed for the
  forward and not kept there);
- paired items: half as many blocks as query blocks, each a query block and its mirror, whose
  second item costs --second-overhead tiles on top of its tiles (the forward's order under a
  band with more than 4096 keys and at most sms/2 query blocks a pair; measured at causal 8k:
  D=256 +6.4% against the model's +7.7..+9.3%, D=128 +0.5% against +2.1..+5.1%, D=64 -1.1%
  against +0.5..+1.9%):

    python3 scripts/experiments/balance_model.py --d 128 --t 8k

With --backward it models the causal backward's grid instead: key blocks of 128 keys (at
D=256 clusters of two 64-key blocks, on sms/2 pairs of SMs), each as long as the 64-row query
tiles it walks, pair after pair or in the launcher's L2-sized groups of pairs (the D=256
causal 8k and 16k grids end within 0.1% of even).

The model ignores L2, clocks and how wgmma work overlaps; docs/DESIGN.md compares it with
measurements (a per-block trace agrees with it at D=128 causal 8k)."""
import argparse
import heapq
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))  # the checkout's bench/
from bench import parse_int_list
from bench.attention import make_configs


def grouped(runs, pairs, group):
    """(position, pair) in launch order: pairs in groups, position-major inside a group."""
    order = []
    for first in range(0, pairs, group):
        size = min(group, pairs - first)
        order += [(i // size, first + i % size) for i in range(runs * size)]
    return order


def makespan(works, sms):
    finish = [0.0] * sms
    for w in works:
        heapq.heappush(finish, heapq.heappop(finish) + w)
    return max(finish)


def report(orders, sms):
    """One line per (name, block works) in `orders`: the last SM's finish over the mean, and the
    time against the first order's."""
    base = makespan(orders[0][1], sms)
    width = max(len(name) for name, _ in orders)
    for name, w in orders:
        span = makespan(w, sms)
        print(f"  {name:{width}s} last SM / mean {span / (sum(w) / sms):.3f}, time {span / base:.3f}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--d", type=int, default=128)
    parser.add_argument("--t", type=parse_int_list, default=[8192])
    parser.add_argument("--sms", type=int, default=132)
    parser.add_argument("--overhead", type=float, default=3.0,
                        help="a block's fixed cost, in key tiles (D=128 traced: 3.1)")
    parser.add_argument("--second-overhead", type=float, default=2.0,
                        help="the fixed cost of a paired block's second item, in key tiles")
    parser.add_argument("--backward", action="store_true", help="model the backward's key blocks")
    args = parser.parse_args()
    configs = make_configs(args.t[:1], (args.d,), (True,), (False,))  # the bench grid's shapes
    assert configs, f"T={args.t[0]}, D={args.d} is not a bench grid shape"
    t, batch, heads = configs[0].t, configs[0].batch, configs[0].heads
    if args.backward:
        return backward(args, t, batch, heads)
    q_rows = 192 if args.d == 64 and t > 2048 else 128  # the launcher's consumers (forward_consumers)
    kv = 64 if args.d == 256 else 128
    runs, pairs = -(-t // q_rows), batch * heads

    def tiles(pos):  # position 0 is the heaviest query block (the last one under a causal mask)
        return min(t, (runs - pos) * q_rows) / kv

    def works(group):
        return [tiles(pos) + args.overhead for pos, _ in grouped(runs, pairs, group)]

    def paired_works():  # block b: items b and items - 1 - b of the pair-major, heaviest-first list
        items = grouped(runs, pairs, 1)
        half = (len(items) + 1) // 2
        return [tiles(items[b][0]) + args.overhead
                + (tiles(items[-1 - b][0]) + args.second_overhead if len(items) - 1 - b > b else 0)
                for b in range(half)]

    group = 1
    while group < pairs and group * runs < 2 * args.sms:
        group *= 2
    print(f"D={args.d} T={t} B={batch} H={heads}: {runs} query blocks a pair, {pairs} pairs")
    report([("pair after pair", works(1)), (f"groups of {group} pairs", works(group)),
            ("paired items", paired_works())], args.sms)


def backward(args, t, batch, heads):
    """The causal backward (launch_backward, launch_split_backward): a unit of 128 keys walks
    the 64-row query tiles that see them; pairs go one after another or in groups whose Q,
    dO and dQ accumulator fit BACKWARD_GROUP_L2_BYTES (32 MB), position-major inside.
    --overhead counts query-tile steps here."""
    units = args.sms // 2 if args.d == 256 else args.sms  # D=256: clusters of two blocks
    runs, pairs = -(-t // 128), batch * heads
    pair_bytes = t * args.d * (2 * 2 + 4)  # Q and dO in bf16, the fp32 accumulator (MHA)
    l2_group = max(1, min(pairs, (32 << 20) // pair_bytes))

    def works(order):
        return [t // 64 - 2 * pos + args.overhead for pos, _ in order]

    print(f"backward D={args.d} T={t} B={batch} H={heads}: {runs} key units a pair, {pairs} pairs, "
          f"{units} SMs{' (pairs)' if args.d == 256 else ''}")
    every = works(grouped(runs, pairs, 1))
    report([("pair after pair", every), (f"L2 groups of {l2_group} pairs", works(grouped(runs, pairs, l2_group))),
            ("longest first (LPT)", sorted(every, reverse=True))], units)


if __name__ == "__main__":
    main()
