"""tk_jax: Hopper attention and Based linear-attention kernels for JAX.

Public API:
    flash_attention, ring_attention, based_linear_attention, based_decode_step, info
"""
from tk_jax.attention import flash_attention
from tk_jax.linear_attention import based_decode_step, based_linear_attention
from tk_jax.sharding import ring_attention
from tk_jax._info import info

__all__ = ["flash_attention", "ring_attention", "based_linear_attention", "based_decode_step", "info"]
