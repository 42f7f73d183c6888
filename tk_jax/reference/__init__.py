"""Pure-JAX implementations of the kernels' math: the CPU backend and the test oracle."""
from tk_jax.reference.attention import attention_backward, attention_forward
from tk_jax.reference.based import based_decode_step_reference, based_forward, taylor_feature_map

__all__ = ["attention_forward", "attention_backward", "based_forward", "based_decode_step_reference",
           "taylor_feature_map"]
