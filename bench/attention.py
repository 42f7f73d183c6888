"""Flash attention benchmark: tk_jax's kernel against cuDNN, FlashAttention-3 and XLA.

The grid is the standard one: a fixed number of tokens per batch (B*T = 16384) and a fixed
model width (H*D = 2048), so q, k and v have the same size at every point and only the
sequence length and head dim change. Inputs are bf16 in the [B, T, H, D] layout that every
contender reads directly.
"""
from __future__ import annotations

import dataclasses
import functools
import math

from bench import (BASELINE, OURS, PEER, Contender, Outcome, Skipped, Unsupported,
                   distribution_version, module_unavailable, pass_name, random_normal_sets)
from bench.timing import Runner, compiled_jax_runner, input_sets_needed

TOKENS = 16384
MODEL_WIDTH = 2048
T_GRID = (512, 1024, 2048, 4096, 8192, 16384)
D_GRID = (64, 128, 256)
QUICK_T = (1024, 4096)
QUICK_D = (128,)
TINY_TOKENS, TINY_WIDTH, TINY_T, TINY_D = 256, 128, (64, 128), (32,)  # CPU smoke test
XLA_MAX_T = 4096         # XLA materialises the T x T scores: keep memory sane
FA3_MAX_HEAD_DIM = 128   # the published flash_attn3_jax wheel ships hdim128 kernels only
BACKWARD_FLOP_FACTOR = 2.5  # backward = 2.5 x forward, so forward+backward = 3.5 x forward
CAUSAL_CHOICES = {"both": (False, True), "yes": (True,), "no": (False,)}  # --causal


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
    t: int
    d: int
    causal: bool
    backward: bool  # False: forward only; True: forward + backward
    batch: int
    heads: int

    def label(self) -> str:
        mask = "causal" if self.causal else "full"
        return (f"D={self.d} T={self.t} {mask} {pass_name(self.backward)} "
                f"(B={self.batch} H={self.heads})")


def make_configs(t_values, d_values, causal_values, backward_values, *, tokens=TOKENS,
                 width=MODEL_WIDTH) -> list[AttentionConfig]:
    """The grid, ordered pass, D, mask, T (the order of the report). Points where T does not
    divide `tokens` or D does not divide `width` are left out."""
    configs = []
    for backward in backward_values:
        for d in d_values:
            for causal in causal_values:
                for t in t_values:
                    if tokens % t or width % d:
                        continue
                    configs.append(AttentionConfig(t=t, d=d, causal=causal, backward=backward,
                                                   batch=tokens // t, heads=width // d))
    return configs


def attention_flops(config: AttentionConfig) -> float:
    """Matmul FLOPs: forward 4*B*H*T*T*D (QK^T and PV), half of it when causal;
    forward+backward counts 3.5x the forward."""
    flops = 4.0 * config.batch * config.heads * config.t * config.t * config.d
    if config.causal:
        flops /= 2
    if config.backward:
        flops *= 1 + BACKWARD_FLOP_FACTOR
    return flops


def add_metrics(config: AttentionConfig, outcome: Outcome) -> None:
    outcome.metrics["tflops"] = attention_flops(config) / (outcome.median_ms * 1e-3) / 1e12


# ---------------------------------------------------------------------------------------------
# Running a JAX attention function on one configuration.

def jax_attention_runner(attend, config: AttentionConfig) -> Runner:
    """Compile `attend(q, k, v) -> o` (forward) or its VJP (forward + backward) for `config`.

    Errors raised while tracing (argument checks) surface here, before any timing.
    """
    shape = (config.batch, config.t, config.heads, config.d)
    shapes = [shape] * (4 if config.backward else 3)  # q, k, v (and the output cotangent)
    bytes_per_set = len(shapes) * math.prod(shape) * 2  # bf16
    sets = random_normal_sets(shapes, input_sets_needed(bytes_per_set))
    return compiled_jax_runner(attend, sets, backward=config.backward)


# ---------------------------------------------------------------------------------------------
# Contenders.

def tk_contender(backend: str, runner=jax_attention_runner) -> Contender:
    """tk_jax.flash_attention; `runner(attend, config)` builds the inputs of a configuration
    (this suite's, or another suite's with the same t, d and causal fields)."""
    def prepare(config) -> Runner:
        import tk_jax

        attend = functools.partial(tk_jax.flash_attention, causal=config.causal, backend=backend)
        try:
            return runner(attend, config)
        except ValueError as err:  # backend="kernel" declines what it cannot run
            raise Unsupported(str(err)) from None

    return Contender(
        name="tk" if backend == "kernel" else f"tk_{backend}",
        description=f'tk_jax.flash_attention(backend="{backend}")',
        role=OURS if backend == "kernel" else BASELINE,
        unavailable=lambda: module_unavailable("tk_jax"),
        prepare=prepare,
        version=lambda: distribution_version("tk_jax"))


def jax_nn_contender(implementation: str, max_t: int | None, runner=jax_attention_runner) -> Contender:
    def prepare(config) -> Runner:
        import jax

        if max_t is not None and config.t > max_t:
            raise Skipped(f"T > {max_t}: the {implementation} path materialises T x T scores")
        attend = functools.partial(jax.nn.dot_product_attention, is_causal=config.causal,
                                   implementation=implementation)
        return runner(attend, config)

    return Contender(
        name=implementation,
        description=f'jax.nn.dot_product_attention(implementation="{implementation}")',
        role=PEER,
        unavailable=lambda: None,
        prepare=prepare,
        version=lambda: distribution_version("jax"))


def fa3_contender(runner=jax_attention_runner) -> Contender:
    # flash_attn3_jax.flash_mha(q, k, v, softmax_scale=None, is_causal=False,
    # window_size=(-1, -1)): [B, T, H, D] bf16/fp16, returns o; custom_vjp gives the backward.
    def prepare(config) -> Runner:
        if config.d > FA3_MAX_HEAD_DIM:
            # Checked here rather than discovered: an unsupported head dim fails inside the
            # C++ extension, which we do not want to risk taking the process down.
            raise Unsupported(f"the flash_attn3_jax wheel supports head dim <= "
                              f"{FA3_MAX_HEAD_DIM}, got {config.d}")
        import flash_attn3_jax

        attend = functools.partial(flash_attn3_jax.flash_mha, is_causal=config.causal)
        return runner(attend, config)

    return Contender(
        name="fa3",
        description="flash_attn3_jax.flash_mha (FlashAttention-3 for JAX)",
        role=PEER,
        unavailable=lambda: module_unavailable("flash_attn3_jax"),
        prepare=prepare,
        version=lambda: distribution_version("flash_attn3_jax"))


def contenders(tk_backend: str = "kernel") -> list[Contender]:
    """All attention contenders in report column order."""
    return [
        tk_contender(tk_backend),
        jax_nn_contender("cudnn", max_t=None),
        fa3_contender(),
        jax_nn_contender("xla", max_t=XLA_MAX_T),
    ]
