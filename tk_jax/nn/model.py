"""BasedLM: a small causal language model in the Based layer pattern (Flax NNX).

Token mixers, one per layer (each followed by a SwiGLU MLP, both pre-norm residual):
  "based": Based linear attention (global, fixed-size recurrent state),
  "conv":  gated short causal convolution (local, the last few tokens),
  "swa":   sliding-window softmax attention (exact, within a window).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx
from jax.typing import DTypeLike

from tk_jax.nn.based import BasedLinearAttention
from tk_jax.nn.mlp import SwiGLU
from tk_jax.nn.short_conv import GatedShortConv
from tk_jax.nn.sliding_window import SlidingWindowAttention

LAYER_KINDS = ("based", "conv", "swa")

# Python lists of modules must be wrapped for NNX 0.12 (nnx.List); older flax takes plain lists.
_ModuleList = getattr(nnx, "List", list)


def based_layer_pattern(num_layers: int) -> tuple[str, ...]:
    """Default mixer per layer: mostly Based, a short conv opening every group of 4 layers,
    sliding-window attention closing every group of 8.

    2 -> conv based;  4 -> conv based based based;
    8 -> conv based based based conv based based swa.
    """
    def kind(i):
        if i % 4 == 0:
            return "conv"
        if i % 8 == 7:
            return "swa"
        return "based"
    return tuple(kind(i) for i in range(num_layers))


@dataclasses.dataclass(frozen=True)
class BasedConfig:
    vocab_size: int
    d_model: int = 128
    num_layers: int = 4
    layer_pattern: tuple[str, ...] | None = None  # None: based_layer_pattern(num_layers)
    # Based linear attention
    based_heads: int = 1
    based_head_dim: int | None = None              # None: d_model // based_heads
    based_output_norm: str = "denominator"         # or "rmsnorm"
    # gated short convolution
    conv_kernel_size: int = 4
    # sliding-window attention
    swa_heads: int = 4
    swa_window: int = 64
    # MLP
    mlp_hidden_dim: int | None = None               # None: 4 * d_model
    tie_embeddings: bool = True
    dtype: DTypeLike = jnp.float32                  # activations; parameters stay float32
    backend: str = "auto"                           # passed to the tk_jax kernel calls

    def pattern(self) -> tuple[str, ...]:
        pattern = tuple(self.layer_pattern or based_layer_pattern(self.num_layers))
        if len(pattern) != self.num_layers or any(k not in LAYER_KINDS for k in pattern):
            raise ValueError(f"BasedConfig: layer_pattern must list {self.num_layers} of "
                             f"{LAYER_KINDS}, got {pattern}")
        return pattern


def make_mixer(kind: str, config: BasedConfig, rngs: nnx.Rngs) -> nnx.Module:
    c = config
    if kind == "based":
        return BasedLinearAttention(c.d_model, c.based_heads, head_dim=c.based_head_dim,
                                    output_norm=c.based_output_norm, dtype=c.dtype,
                                    backend=c.backend, rngs=rngs)
    if kind == "conv":
        return GatedShortConv(c.d_model, kernel_size=c.conv_kernel_size, dtype=c.dtype,
                              rngs=rngs)
    if kind == "swa":
        return SlidingWindowAttention(c.d_model, c.swa_heads, c.swa_window, dtype=c.dtype,
                                      backend=c.backend, rngs=rngs)
    raise ValueError(f"unknown layer kind {kind!r}, expected one of {LAYER_KINDS}")


class Block(nnx.Module):
    """x + mixer(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, kind: str, config: BasedConfig, *, rngs: nnx.Rngs):
        c = config
        self.kind = kind
        self.mixer_norm = nnx.RMSNorm(c.d_model, dtype=c.dtype, rngs=rngs)
        self.mixer = make_mixer(kind, c, rngs)
        self.mlp_norm = nnx.RMSNorm(c.d_model, dtype=c.dtype, rngs=rngs)
        self.mlp = SwiGLU(c.d_model, c.mlp_hidden_dim or 4 * c.d_model, dtype=c.dtype, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + self.mixer(self.mixer_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class BasedLM(nnx.Module):
    """tokens [B, T] int -> logits [B, T, vocab_size] float32 (causal)."""

    def __init__(self, config: BasedConfig, *, rngs: nnx.Rngs):
        c = self.config = config
        self.embed = nnx.Embed(c.vocab_size, c.d_model, dtype=c.dtype,
                               embedding_init=nnx.initializers.normal(0.02), rngs=rngs)
        self.blocks = _ModuleList([Block(kind, c, rngs=rngs) for kind in c.pattern()])
        self.final_norm = nnx.RMSNorm(c.d_model, dtype=c.dtype, rngs=rngs)
        if not c.tie_embeddings:
            self.lm_head = nnx.Linear(c.d_model, c.vocab_size, use_bias=False, dtype=c.dtype,
                                      rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        x = self.final_norm(x)
        logits = self.embed.attend(x) if self.config.tie_embeddings else self.lm_head(x)
        return logits.astype(jnp.float32)
