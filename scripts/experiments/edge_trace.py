"""Where the streamed-items forward waits at an item's edge: clock stamps that consumer warp 0
of each warpgroup takes between one item's last softmax and the next item's first, from a
scratch tree with both patches applied (its lse rows carry the stamps; its results are wrong).

    git apply scripts/experiments/streamed_items.patch scripts/experiments/streamed_items_stamps.patch
    pip install -e .   (on the device)
    python3 scripts/experiments/edge_trace.py

Prints the mean, median and p90 cycles of each phase (dense D=128, 16 heads, 16k tokens).
"""
import sys, numpy as np, jax, jax.numpy as jnp, tk_jax
PH = ("acquire next Q", "acquire K0 + issue S0", "last PV lands", "write-out", "S0 lands + softmax0")
def trace(batch, t, h, d, causal):
    ks = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(ks[0], (batch, t, h, d), jnp.bfloat16)
    k, v = (jax.random.normal(x, (batch, t, h, d), jnp.bfloat16) for x in ks[1:])
    f = jax.jit(lambda q, k, v: tk_jax.flash_attention(q, k, v, causal=causal, return_lse=True, backend="kernel")[1])
    for _ in range(3): lse = jax.block_until_ready(f(q, k, v))
    st = np.asarray(lse).view(np.uint32).astype(np.int64)
    rows = []
    for qb in range(t // 128):
        for g in range(2):
            r = st[:, :, qb * 128 + 64 * g: qb * 128 + 64 * g + 8].reshape(-1, 8)
            rows.append(r)
    r = np.concatenate(rows)
    d_ = np.diff(r[:, :6], axis=1) % (1 << 32)
    ok = (r[:, 6] < 132) & (r[:, 7] >= 1) & (r[:, 7] <= t // 128) & np.all(d_ < 200000, axis=1)
    d_ = d_[ok]
    print(f"B{batch} T{t} H{h} D{d} {'causal' if causal else 'full'}: {ok.sum()} item edges stamped of {len(r)}")
    for i, name in enumerate(PH):
        x = d_[:, i]
        print(f"  {name:22s} mean {x.mean():7.0f}  median {np.median(x):7.0f}  p90 {np.percentile(x, 90):7.0f}")
for causal in (False, True):
    trace(16, 1024, 16, 128, causal)
trace(8, 2048, 16, 128, True)
