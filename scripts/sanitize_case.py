"""A small case of every attention kernel (forward variants and backward), for running under
compute-sanitizer: `compute-sanitizer --tool memcheck python3 scripts/sanitize_case.py`.
Odd lengths and GQA so that tails and masks are exercised."""
import math

import jax
import jax.numpy as jnp
import numpy as np

from tk_jax import _ext, _kernels

ok, why = _ext.kernels_available()
assert ok, why
rng = np.random.default_rng(0)
for d in (64, 128):
    q = jnp.asarray(rng.standard_normal((1, 77, 4, d)), jnp.bfloat16)
    k = jnp.asarray(rng.standard_normal((1, 130, 2, d)), jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((1, 130, 2, d)), jnp.bfloat16)
    kw = dict(scale=1 / math.sqrt(d), window_left=-1, window_right=0)
    for variant in _kernels.ATTENTION_VARIANTS:
        o, lse = _kernels.attention_fwd(q, k, v, variant=variant, **kw)
    dq, dk, dv = _kernels.attention_bwd(q, k, v, o, lse, jnp.ones_like(o), **kw)
    jax.block_until_ready((o, lse, dq, dk, dv))
print("sanitize case done")
