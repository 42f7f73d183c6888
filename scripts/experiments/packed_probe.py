"""Where packed rows lose time: tk with segment ids, and FA3 varlen, on the bench's packed
layout and on documents of one length (aligned to the tiles, or shifted off them), beside the
same documents as a dense batch without segment ids. TFLOP/s over each document's own causal
triangle; rows print as they finish.

    python3 scripts/experiments/packed_probe.py --peers [--backward] [--d 128]
"""
import argparse
import functools
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench import packed, random_normal_sets  # noqa: E402
from bench.timing import compiled_jax_runner, measure  # noqa: E402

ROWS, ROW_TOKENS, HQ, HKV = 4, 16384, 16, 4


def layouts():
    """name -> per row, its document lengths."""
    out = {"bench mean512": packed.document_lengths("mean512", ROWS, ROW_TOKENS)}
    for length in (512, 2048):
        out[f"uniform {length}"] = ((length,) * (ROW_TOKENS // length),) * ROWS
        out[f"uniform {length} +64"] = ((64,) + (length,) * (ROW_TOKENS // length - 1) + (length - 64,),) * ROWS
    return out


def flops(lengths, d, backward):
    return sum(4.0 * HQ * d * n * n / 2 for row in lengths for n in row) * (3.5 if backward else 1.0)


def timed(attend, shapes, backward, constants=()):
    sets = random_normal_sets(shapes + ([shapes[0]] if backward else []), 2)
    runner = compiled_jax_runner(attend, sets, backward=backward, constants=constants)
    return measure(runner, reps=5, warmup=2).median_s


def main():
    import tk_jax

    parser = argparse.ArgumentParser()
    parser.add_argument("--peers", action="store_true")
    parser.add_argument("--backward", action="store_true")
    parser.add_argument("--d", type=int, default=128)
    parser.add_argument("--label", default="tk")
    args = parser.parse_args()
    d, bwd = args.d, args.backward
    fa3 = None
    if args.peers:
        try:
            import flash_attn3_jax as fa3
        except ImportError:
            pass
    for name, lengths in layouts().items():
        f = flops(lengths, d, bwd)
        ids = jnp.asarray(np.stack([np.repeat(np.arange(len(r), dtype=np.int32), r) for r in lengths]))
        row = []

        def seg(q, k, v, ids):
            return tk_jax.flash_attention(q, k, v, causal=True, q_segment_ids=ids, kv_segment_ids=ids,
                                          backend="kernel")
        s = timed(seg, [(ROWS, ROW_TOKENS, HQ, d), (ROWS, ROW_TOKENS, HKV, d), (ROWS, ROW_TOKENS, HKV, d)],
                  bwd, (ids,))
        row.append(f"tk-seg {f / s / 1e12:.0f}")
        if fa3 is not None and d <= 128:
            cu = jnp.asarray(np.concatenate([[0], np.cumsum([n for r in lengths for n in r])]).astype(np.int32))
            longest = max(n for r in lengths for n in r)
            var = functools.partial(fa3.flash_mha_varlen, max_seqlen_q=longest, max_seqlen_k=longest,
                                    is_causal=True)
            s = timed(lambda q, k, v, cu: var(q, k, v, cu, cu),
                      [(ROWS * ROW_TOKENS, HQ, d), (ROWS * ROW_TOKENS, HKV, d), (ROWS * ROW_TOKENS, HKV, d)],
                      bwd, (cu,))
            row.append(f"fa3-varlen {f / s / 1e12:.0f}")
        if name.startswith("uniform") and "+" not in name:  # the same documents as a dense batch
            n = lengths[0][0]
            b = ROWS * ROW_TOKENS // n
            shapes = [(b, n, HQ, d), (b, n, HKV, d), (b, n, HKV, d)]
            s = timed(functools.partial(tk_jax.flash_attention, causal=True, backend="kernel"), shapes, bwd)
            row.append(f"tk-batch {f / s / 1e12:.0f}")
            if fa3 is not None and d <= 128:
                s = timed(functools.partial(fa3.flash_mha, is_causal=True), shapes, bwd)
                row.append(f"fa3-batch {f / s / 1e12:.0f}")
        print(f"{args.label} {name} D{d} {'fwd+bwd' if bwd else 'fwd'}: " + "  ".join(row), flush=True)


if __name__ == "__main__":
    main()
