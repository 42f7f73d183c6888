"""GQA fwd+bwd TFLOP/s of tk (and, with --peers, cuDNN and FA3 for JAX) on a few shapes, for
A/Bs of the backward's head split (run once per build variant; rows print as they finish).

    python3 scripts/experiments/gqa_probe.py --peers --label main
"""
import argparse
import functools
import math
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import jax  # noqa: E402

from bench import random_normal_sets  # noqa: E402
from bench.timing import compiled_jax_runner, measure  # noqa: E402

SHAPES = [  # B, T, Hq, Hkv, D, causal
    (4, 4096, 32, 32, 128, True), (4, 4096, 32, 8, 128, True), (4, 4096, 32, 4, 128, True),
    (2, 4096, 64, 8, 128, True), (1, 8192, 64, 8, 128, True), (2, 2048, 48, 1, 128, True),
    (16, 1024, 32, 2, 128, True), (1, 16384, 32, 4, 128, False), (4, 4096, 64, 4, 64, True),
    (8, 2048, 16, 1, 256, True), (1, 16384, 16, 2, 256, False),
]


def attenders(peers):
    import tk_jax
    out = {"tk": lambda causal: functools.partial(tk_jax.flash_attention, causal=causal, backend="kernel")}
    if peers:
        out["cudnn"] = lambda causal: functools.partial(jax.nn.dot_product_attention, is_causal=causal,
                                                        implementation="cudnn")
        try:
            import flash_attn3_jax
            out["fa3"] = lambda causal: functools.partial(flash_attn3_jax.flash_mha, is_causal=causal)
        except ImportError:
            pass
    return out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--peers", action="store_true")
    parser.add_argument("--label", default="tk")
    args = parser.parse_args()
    for b, t, hq, hkv, d, causal in SHAPES:
        flops = 4.0 * b * hq * t * t * d * (0.5 if causal else 1) * 3.5
        row = []
        for name, make in attenders(args.peers).items():
            if name == "fa3" and d > 128:
                row.append(f"{name} -")
                continue
            shapes = [(b, t, hq, d), (b, t, hkv, d), (b, t, hkv, d), (b, t, hq, d)]
            try:
                runner = compiled_jax_runner(make(causal), random_normal_sets(shapes, 2), backward=True)
                ms = measure(runner, reps=5, warmup=2).median_s * 1e3
                row.append(f"{name} {flops / ms / 1e9:.0f}")
            except Exception as err:  # a peer that cannot run this shape
                row.append(f"{name} err({str(err)[:40]})")
        mask = "causal" if causal else "full"
        print(f"{args.label} B{b} T{t} {hq}/{hkv} D{d} {mask}: " + "  ".join(row), flush=True)


if __name__ == "__main__":
    main()
