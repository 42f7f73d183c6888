"""Where a forward item's time goes, per consumer warpgroup: clock stamps from a scratch tree
with `item_stamps.patch` applied (its lse rows carry the stamps; its results are wrong).

    git apply scripts/experiments/item_stamps.patch && pip install -e . (on the device)
    python3 scripts/experiments/item_trace.py 128x512 32x2048      # B x T, causal, D=128, 16/4

For each item length (key tiles), the mean cycles of: S_0 issued to landed, the first
softmax, the loop over the other tiles, the last P V, the write-out, and the wait from the
write-out to the next item's start (its Q and item). Then the start offset of warpgroup 1
against warpgroup 0 on the same item.
"""
import collections
import sys

import jax
import jax.numpy as jnp
import numpy as np

import tk_jax

PHASES = ("S0 wait", "softmax0", "loop", "last PV", "write-out", "next item")


def trace(batch, t, hq=16, hkv=4, d=128):
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (batch, t, hq, d), jnp.bfloat16)
    k, v = (jax.random.normal(x, (batch, t, hkv, d), jnp.bfloat16) for x in keys[1:])
    f = jax.jit(lambda q, k, v: tk_jax.flash_attention(q, k, v, causal=True, return_lse=True,
                                                       backend="kernel")[1])
    for _ in range(3):
        lse = jax.block_until_ready(f(q, k, v))
    stamps = np.asarray(lse).view(np.uint32).astype(np.int64)  # [B, H, T]
    by_group = collections.defaultdict(list)  # (SM, warpgroup) -> its items' stamps
    for q_block in range(t // 128):
        for group in range(2):
            row = q_block * 128 + 64 * group
            for r in stamps[:, :, row:row + 8].reshape(-1, 8):
                by_group[(int(r[6]), group)].append(r)
    sums = collections.defaultdict(lambda: np.zeros(len(PHASES) + 1))
    starts, offsets = {}, []
    for (sm, group), items in sorted(by_group.items()):
        items.sort(key=lambda r: r[0])
        for j, r in enumerate(items):
            phases = [(r[i + 1] - r[i]) % 2**32 for i in range(5)]
            phases.append((r[0] - items[j - 1][5]) % 2**32 if j else 0)
            sums[int(r[7])] += np.array(phases + [1])
            if group == 0:
                starts[(sm, j)] = r[0]
            elif (sm, j) in starts:
                offsets.append(((r[0] - starts[(sm, j)] + 2**31) % 2**32) - 2**31)
    print(f"B{batch} T{t} {hq}/{hkv} D{d}: mean cycles per item and warpgroup")
    print("| tiles | items | " + " | ".join(PHASES) + " | total |")
    print("|---" * (len(PHASES) + 3) + "|")
    for tiles in sorted(sums):
        mean = sums[tiles][:-1] / sums[tiles][-1]
        print(f"| {tiles} | {int(sums[tiles][-1])} | " + " | ".join(f"{x:.0f}" for x in mean)
              + f" | {mean.sum():.0f} |")
    if offsets:
        print(f"warpgroup 1's start - warpgroup 0's: median {np.median(offsets):.0f} cycles, "
              f"p10 {np.percentile(offsets, 10):.0f}, p90 {np.percentile(offsets, 90):.0f}")


if __name__ == "__main__":
    for shape in sys.argv[1:] or ["128x512"]:
        batch, t = (int(x) for x in shape.split("x"))
        trace(batch, t)
