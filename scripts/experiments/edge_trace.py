"""Where the streamed-items forward waits at an item's edge: clock stamps that consumer warp 0
of each warpgroup takes between one item's last softmax and the next item's first, from a
scratch tree with both patches applied (its lse rows carry the stamps; its results are wrong).

    git apply scripts/experiments/streamed_items.patch scripts/experiments/streamed_items_stamps.patch
    pip install -e .   (on the device)
    python3 scripts/experiments/edge_trace.py

Prints the mean, median and p90 cycles of each phase (dense D=128, 16 heads, 16k tokens).
"""
import jax
import jax.numpy as jnp
import numpy as np

import tk_jax

PHASES = ("acquire next Q", "acquire K0 + issue S0", "last PV lands", "write-out",
          "S0 lands + softmax0")
SMS = 132  # stamps whose SM id is out of range were never written (an item with no next)


def trace(batch, t, heads, d, causal):
    keys = jax.random.split(jax.random.key(0), 3)
    q, k, v = (jax.random.normal(key, (batch, t, heads, d), jnp.bfloat16) for key in keys)
    f = jax.jit(lambda q, k, v: tk_jax.flash_attention(q, k, v, causal=causal, return_lse=True,
                                                       backend="kernel")[1])
    for _ in range(3):
        lse = jax.block_until_ready(f(q, k, v))
    stamps = np.asarray(lse).view(np.uint32).astype(np.int64)  # [B, H, T]
    # Warp 0 of warpgroup g writes its 8 stamps into rows 64 g .. 64 g + 7 of each 128-row item:
    # six clocks, the SM id, the item's key tiles.
    rows = np.concatenate([stamps[:, :, q0 + 64 * g:q0 + 64 * g + 8].reshape(-1, 8)
                           for q0 in range(0, t, 128) for g in range(2)])
    phases = np.diff(rows[:, :6], axis=1) % (1 << 32)  # the clocks wrap at 32 bits
    stamped = ((rows[:, 6] < SMS) & (rows[:, 7] >= 1) & (rows[:, 7] <= t // 128)
               & np.all(phases < 200_000, axis=1))
    phases = phases[stamped]
    mask = "causal" if causal else "full"
    print(f"B{batch} T{t} H{heads} D{d} {mask}: {stamped.sum()} item edges stamped of {len(rows)}")
    for name, cycles in zip(PHASES, phases.T):
        print(f"  {name:22s} mean {cycles.mean():7.0f}  median {np.median(cycles):7.0f}"
              f"  p90 {np.percentile(cycles, 90):7.0f}")


if __name__ == "__main__":
    for causal in (False, True):
        trace(16, 1024, 16, 128, causal)
    trace(8, 2048, 16, 128, True)
