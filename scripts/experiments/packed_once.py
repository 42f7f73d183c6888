"""Three calls of tk's forward (with a third argument `bwd`: its gradient) on 4 rows of 16k
tokens packed with documents of one length (optionally after a first short one, which shifts
them off the tiles), for ncu to time the segment-id prologue and the kernels:

    ncu --metrics gpu__time_duration.sum -k regex:"chunk|tiles|hulls|forward" \
        python3 scripts/experiments/packed_once.py 512 64 [bwd]     # length, shift
"""
import sys, numpy as np, jax, jax.numpy as jnp
import tk_jax
L = int(sys.argv[1]); shift = int(sys.argv[2]) if len(sys.argv) > 2 else 0
backward = len(sys.argv) > 3 and sys.argv[3] == "bwd"
T, B, H, HKV, D = 16384, 4, 16, 4, 128
lens = ([shift] if shift else []) + [L] * ((T - shift) // L)
lens[-1] += T - sum(lens)
ids = jnp.asarray(np.stack([np.repeat(np.arange(len(lens), dtype=np.int32), lens)] * B))
ks = jax.random.split(jax.random.key(0), 3)
q = jax.random.normal(ks[0], (B, T, H, D), jnp.bfloat16)
k = jax.random.normal(ks[1], (B, T, HKV, D), jnp.bfloat16)
v = jax.random.normal(ks[2], (B, T, HKV, D), jnp.bfloat16)
def attend(q, k, v, ids):
    return tk_jax.flash_attention(q, k, v, causal=True, q_segment_ids=ids, kv_segment_ids=ids, backend="kernel")
if backward:
    f = jax.jit(jax.grad(lambda q, k, v, ids: attend(q, k, v, ids).astype(jnp.float32).sum(), argnums=(0, 1, 2)))
else:
    f = jax.jit(attend)
for _ in range(3): jax.block_until_ready(f(q, k, v, ids))
