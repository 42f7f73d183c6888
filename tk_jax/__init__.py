"""tk_jax: Hopper attention and Based linear-attention kernels for JAX.

Public API:
    flash_attention, based_linear_attention, based_decode_step   the ops
    dot_product_attention                                          jax.nn's signature, tk's kernels
    flash_attention_with_kvcache                                   decode against a KV cache
    ring_attention, to_load_balanced, from_load_balanced          sequence parallelism
    info                                                          what is installed
"""
from tk_jax._info import info
from tk_jax.attention import flash_attention
from tk_jax.jax_nn_compat import dot_product_attention
from tk_jax.kvcache import flash_attention_with_kvcache
from tk_jax.linear_attention import based_decode_step, based_linear_attention
from tk_jax.ring import from_load_balanced, ring_attention, to_load_balanced

# Kept equal to pyproject.toml's version (tests/test_package.py checks it). A literal rather
# than importlib.metadata: a source checkout run with `python -m pytest` (no install, or another
# checkout installed) must report the version of the code it runs.
__version__ = "0.1.0"

__all__ = ["flash_attention", "dot_product_attention", "flash_attention_with_kvcache",
           "ring_attention", "based_linear_attention", "based_decode_step", "to_load_balanced",
           "from_load_balanced", "info"]
