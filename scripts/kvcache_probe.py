"""Speed of the KV-cache attention kernel: K/V bytes read per second for a few decode shapes,
contiguous and paged, beside the card's copy bandwidth (read + write of a large array).

    python3 scripts/kvcache_probe.py [--splits 1,16,64] [--page-size 64] [--tq 1,4] [--d 128]
                                     [--shapes 8x32k:32/1,1x128k:32/8] [--steps 8]

Each shape is timed per decode step (--steps of them in one jitted call, so that the host's
dispatch of a call does not show in small calls), with the kernel's own split count and with
each count given by --splits.
bf16, every row's cache full (seqlens = S), causal; paged caches get a shuffled page table
(--page-order sequential: pages in the buffer's order).
TB/s = (K and V bytes of the valid keys) / time; a ceiling is the copy rate.
"""
import argparse
import math
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
# As the bench: memory on demand, so that ncu's kernel replay backs up only what the probe
# allocated (with XLA's preallocation it failed).
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench.timing import JaxClock, Runner, measure  # noqa: E402
from tk_jax import _ext, _kernels  # noqa: E402

# (batch, cache length, heads_q, heads_kv)
SHAPES = [(1, 131072, 32, 8), (16, 32768, 32, 8), (64, 4096, 32, 8), (8, 32768, 32, 32)]


def parse_shapes(text):
    """'8x32k:32/1,1x128k:32/8' -> [(8, 32768, 32, 1), (1, 131072, 32, 8)]."""
    def count(x):
        return int(x[:-1]) * 1024 if x.endswith("k") else int(x)
    shapes = []
    for item in text.split(","):
        rows, heads = item.split(":")
        b, s = rows.split("x")
        hq, hkv = heads.split("/")
        shapes.append((count(b), count(s), int(hq), int(hkv)))
    return shapes


def copy_bandwidth(n_bytes=1 << 30):
    x = jnp.ones((n_bytes // 4,), jnp.float32)
    compiled = jax.jit(lambda a: a + 1.0).lower(x).compile()
    t = measure(Runner(call=lambda i: compiled(x), n_sets=1, clock=JaxClock()), reps=10)
    return 2 * n_bytes / t.median_s


def caches(key, b, s, hkv, d, page_size, shuffled=True):
    """k, v [B, S, Hkv, D] bf16 and, with a page size, their paged form and a shuffled table
    (or, with shuffled=False, the table that reads the pages in the buffer's order)."""
    kk, kv, kp = jax.random.split(key, 3)
    k = jax.random.normal(kk, (b, s, hkv, d), jnp.bfloat16)
    v = jax.random.normal(kv, (b, s, hkv, d), jnp.bfloat16)
    if not page_size:
        return k, v, None
    pages = b * s // page_size
    # logical page i lives in physical page perm[i]
    perm = jax.random.permutation(kp, pages) if shuffled else jnp.arange(pages)
    inverse = jnp.argsort(perm)
    k = k.reshape(pages, page_size, hkv, d)[inverse]
    v = v.reshape(pages, page_size, hkv, d)[inverse]
    return k, v, perm.astype(jnp.int32).reshape(b, s // page_size)


def time_call(qs, k, v, seqlens, table, splits):
    """Seconds per decode step: one jitted call runs one step per query in `qs` (unrolled), so
    that the host's dispatch of a call is spread over several steps."""
    def step(q, k, v, s, t):
        return _kernels.attention_kvcache(q, k, v, s, t, scale=1 / math.sqrt(q.shape[-1]), window_left=-1,
                                          window_right=0, num_splits=splits)

    fn = jax.jit(lambda qs, k, v, s, t: [step(q, k, v, s, t) for q in qs])
    compiled = fn.lower(qs, k, v, seqlens, table).compile()
    return measure(Runner(call=lambda i: compiled(qs, k, v, seqlens, table), n_sets=1, clock=JaxClock()),
                   reps=10).median_s / len(qs)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--splits", default="", help="extra split counts to time, e.g. 1,16,64")
    parser.add_argument("--page-size", type=int, default=64)
    parser.add_argument("--tq", default="1,4")
    parser.add_argument("--d", type=int, default=128)
    parser.add_argument("--steps", type=int, default=1,
                        help="decode steps per jitted call (the host's dispatch is spread over them)")
    parser.add_argument("--shapes", type=parse_shapes, default=SHAPES,
                        help="BxS:Hq/Hkv list, e.g. 8x32k:32/1,1x128k:32/8")
    parser.add_argument("--page-sizes", default=None,
                        help="cache layouts to time: 0 (contiguous) and page sizes (default 0 and --page-size)")
    parser.add_argument("--page-order", choices=["shuffled", "sequential"], default="shuffled",
                        help="page tables: a random permutation of the pages, or the buffer's order")
    args = parser.parse_args()
    ok, why = _ext.kernels_available()
    assert ok, why
    extra = [int(x) for x in args.splits.split(",") if x]
    print(f"device: {jax.devices()[0].device_kind}, {_kernels.multiprocessor_count()} SMs")
    print(f"copy (read + write): {copy_bandwidth() / 1e12:.2f} TB/s")
    print(f"{'B':>3} {'S':>7} {'Hq/Hkv':>7} {'D':>4} {'Tq':>3} {'cache':>10} {'splits':>7} {'us':>9} {'TB/s':>6}")
    key = jax.random.PRNGKey(0)
    d = args.d
    layouts = ([int(x) for x in args.page_sizes.split(",")] if args.page_sizes is not None
               else [0, args.page_size])
    for b, s, hq, hkv in args.shapes:
        kv_bytes = 2 * b * s * hkv * d * 2
        for page_size in layouts:
            k, v, table = caches(key, b, s, hkv, d, page_size, args.page_order == "shuffled")
            seqlens = jnp.full((b,), s, jnp.int32)
            for tq in [int(x) for x in args.tq.split(",")]:
                qs = [jax.random.normal(jax.random.fold_in(key, i), (b, tq, hq, d), jnp.bfloat16)
                      for i in range(args.steps)]
                q = qs[0]
                auto = _kernels.kvcache_num_splits(q, k, table)
                for n in [0] + [x for x in extra if x != auto]:
                    seconds = time_call(qs, k, v, seqlens, table, n)
                    label = f"paged {page_size}" if page_size else "contiguous"
                    used = auto if n == 0 else _kernels.kvcache_num_splits(q, k, table, n)
                    print(f"{b:>3} {s:>7} {hq:>3}/{hkv:<3} {d:>4} {tq:>3} {label:>10} "
                          f"{str(used) + ('*' if n == 0 else ''):>7} {seconds * 1e6:>9.1f} "
                          f"{kv_bytes / seconds / 1e12:>6.2f}", flush=True)
            del k, v, table
    print("* the kernel's own split count")


if __name__ == "__main__":
    main()
