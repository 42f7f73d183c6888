"""Flax NNX layers and a small language model built on tk_jax's kernels (needs flax), and
attention_fn: an attention function for flax.nnx.MultiHeadAttention that runs the kernels."""
from tk_jax.nn.attention import attention_fn
from tk_jax.nn.based import BasedLinearAttention
from tk_jax.nn.mlp import SwiGLU
from tk_jax.nn.model import BasedConfig, BasedLM, Block, based_layer_pattern
from tk_jax.nn.short_conv import GatedShortConv, causal_depthwise_conv
from tk_jax.nn.sliding_window import SlidingWindowAttention

__all__ = ["attention_fn", "BasedLinearAttention", "SlidingWindowAttention", "GatedShortConv",
           "SwiGLU", "BasedConfig", "BasedLM", "Block", "based_layer_pattern",
           "causal_depthwise_conv"]
