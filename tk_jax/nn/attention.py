"""An `attention_fn` for Flax's attention modules: `flax.nnx.MultiHeadAttention(...,
attention_fn=tk_jax.nn.attention_fn)` runs tk_jax's kernels.

It takes the arguments of flax.nnx.dot_product_attention (Flax's default attention_fn) and
does what that does, through tk_jax.dot_product_attention: Flax's default calls
jax.nn.dot_product_attention whenever no dropout and no weight sowing are asked for, so the
semantics are jax.nn's (see tk_jax/jax_nn_compat.py, including its one difference: rows that
see no key give 0). Dropout on the attention weights and sowing the weights need the weights
themselves, which the kernels never form: those calls run Flax's default, with a warning once.
Flax imports lazily, only for that fallback and for dtype promotion.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from tk_jax.jax_nn_compat import dot_product_attention, warn_once


def attention_fn(query: jax.Array, key: jax.Array, value: jax.Array,
                 bias: jax.Array | None = None, mask: jax.Array | None = None,
                 broadcast_dropout: bool = True, dropout_rng: jax.Array | None = None,
                 dropout_rate: float = 0.0, deterministic: bool = False, dtype=None,
                 precision=None, module=None, promote_dtype=None, is_causal: bool = False, *,
                 implementation: str | None = None,
                 local_window_size: int | tuple[int, int] | None = None) -> jax.Array:
    """flax.nnx.dot_product_attention's signature, computed by tk_jax.dot_product_attention.

    query [batch..., T, N, H], key and value [batch..., S, K, H] (N a multiple of K; any
    number of batch dims, or none); bias and mask broadcastable to [batch..., N, T, S] (either
    one runs jax.nn's XLA path, with a warning once: pass is_causal=True rather than a causal
    mask). `precision` is not used (the kernels accumulate in float32, as Flax's default path
    through jax.nn does). Keyword-only extras, e.g. through functools.partial:
    implementation (as in tk_jax.dot_product_attention: None, "tk", "xla", "cudnn") and
    local_window_size (a sliding window, top-left aligned like is_causal).
    """
    if promote_dtype is None:
        from flax.nnx.nn import dtypes as flax_dtypes
        promote_dtype = flax_dtypes.promote_dtype
    query, key, value = promote_dtype((query, key, value), dtype=dtype)

    needs_weights = None
    if dropout_rate > 0.0 and not deterministic:
        needs_weights = ("dropout", "dropout on the attention weights")
    elif module is not None:
        needs_weights = ("sow", "sowing the attention weights (sow_weights=True)")
    if needs_weights is not None:
        from flax import nnx
        warn_once(f"flax-{needs_weights[0]}",
                  f"tk_jax.nn.attention_fn: {needs_weights[1]} needs the weights, which the "
                  "kernels never form; running flax.nnx.dot_product_attention instead (this "
                  "warning is shown once)")
        # (is_causal passed only when set: Flax versions before it took no such argument.)
        return nnx.dot_product_attention(
            query, key, value, bias, mask, broadcast_dropout, dropout_rng, dropout_rate,
            deterministic, dtype, precision, module, **({"is_causal": True} if is_causal else {}))

    # dot_product_attention takes [B, T, N, H] or [T, N, H]: fold extra batch dims (and those
    # of bias and mask, as Flax's default does).
    batch_shape = query.shape[:-3]
    fold = len(batch_shape) > 1

    def to_4d(x):
        if x is None or not fold:
            return x
        return jnp.reshape(x, (math.prod(x.shape[:-3]),) + x.shape[-3:])

    if mask is not None:
        mask = jnp.asarray(mask).astype(jnp.bool_)
    out = dot_product_attention(to_4d(query), to_4d(key), to_4d(value), to_4d(bias),
                                to_4d(mask), is_causal=is_causal,
                                local_window_size=local_window_size,
                                implementation=implementation)
    return jnp.reshape(out, query.shape[:-1] + value.shape[-1:]) if fold else out
