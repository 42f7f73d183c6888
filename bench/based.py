"""Based linear attention benchmark: tk_jax's kernel, tk_jax's plain-JAX reference, and fla's
Triton kernels; plus one decode step against its memory floor.

Shapes follow the Based paper's setting: B=16, H=16, feature dim 16 (q and k), value dim 64.
Inputs are bf16 in the [B, T, H, D] layout (fla's public functions take the same layout and
transpose internally).
"""
from __future__ import annotations

import dataclasses
import math

from bench import (BASELINE, OURS, PEER, Contender, Outcome, Unsupported,
                   distribution_version, module_unavailable, pass_name, random_normal_sets)
from bench.timing import (JaxClock, Runner, TorchCudaClock, compiled_jax_runner,
                          input_sets_needed, measure)

BATCH, HEADS, FEATURE, VALUE_DIM = 16, 16, 16, 64
T_GRID = (1024, 2048, 4096, 8192, 16384, 32768)
QUICK_T = (1024, 8192)
TINY_BATCH, TINY_HEADS, TINY_T = 2, 2, (64, 128)  # CPU smoke test
DECODE_BATCH = 64
DECODE_PROMPT = 64   # tokens run through the reference to produce a realistic state
DECODE_NAME = "tk_decode"  # selectable with --contenders like the other contenders
DECODE_STEPS = 32          # decode steps per timed call (a generation loop)


@dataclasses.dataclass(frozen=True)
class BasedConfig:
    t: int
    backward: bool
    batch: int = BATCH
    heads: int = HEADS
    feature: int = FEATURE
    value_dim: int = VALUE_DIM

    def label(self) -> str:
        return f"T={self.t} {pass_name(self.backward)} (B={self.batch} H={self.heads})"


def make_configs(t_values, backward_values, *, batch=BATCH, heads=HEADS) -> list[BasedConfig]:
    return [BasedConfig(t=t, backward=backward, batch=batch, heads=heads)
            for backward in backward_values for t in t_values]


def add_metrics(config: BasedConfig, outcome: Outcome) -> None:
    """Based is reported in milliseconds; tokens per second is added for scale."""
    outcome.metrics["mtokens_per_s"] = config.batch * config.t / (outcome.median_ms * 1e-3) / 1e6


def _shapes(config: BasedConfig) -> list[tuple[int, ...]]:
    """q, k, v [B, T, H, D], and the output cotangent for fwd+bwd."""
    qk_shape = (config.batch, config.t, config.heads, config.feature)
    v_shape = (config.batch, config.t, config.heads, config.value_dim)
    return [qk_shape, qk_shape, v_shape] + ([v_shape] if config.backward else [])


def _input_sets(config: BasedConfig) -> int:
    return input_sets_needed(2 * sum(math.prod(shape) for shape in _shapes(config)))  # bf16


# ---------------------------------------------------------------------------------------------
# tk_jax contenders (JAX).


def _tk_contender(backend: str) -> Contender:
    def prepare(config: BasedConfig) -> Runner:
        import tk_jax

        def attend(q, k, v):
            return tk_jax.based_linear_attention(q, k, v, backend=backend)

        sets = random_normal_sets(_shapes(config), _input_sets(config))
        try:
            return compiled_jax_runner(attend, sets, backward=config.backward)
        except ValueError as err:
            if backend == "kernel":  # the kernel declines what it cannot run
                raise Unsupported(str(err)) from None
            raise

    ours = backend == "kernel"
    return Contender(
        name="tk" if ours else f"tk_{backend}",
        description=f'tk_jax.based_linear_attention(backend="{backend}")'
                    + (" (plain-JAX chunked)" if backend == "reference" else ""),
        role=OURS if ours else BASELINE,
        unavailable=lambda: module_unavailable("tk_jax"),
        prepare=prepare,
        version=lambda: distribution_version("tk_jax"))


# ---------------------------------------------------------------------------------------------
# fla contenders (PyTorch + Triton).
#
# fla.ops.based.fused_chunk_based / parallel_based (q, k, v, scale=None, use_norm=True):
# q, k [B, T, H, F], v [B, T, H, V] on CUDA; returns o [B, T, H, V] in q's dtype. scale
# defaults to F ** -0.5; fused_chunk needs F <= 16, parallel F <= 128. Gradients through
# torch.autograd.

def _fla_unavailable() -> str | None:
    try:
        import torch
    except Exception as err:
        return f"cannot import torch: {type(err).__name__}: {err}"
    if not torch.cuda.is_available():
        return "torch sees no CUDA device"
    return module_unavailable("fla.ops.based")


def _fla_version() -> str:
    parts = [f"fla-core {distribution_version('fla-core') or '?'}"]
    for name in ("torch", "triton"):
        parts.append(f"{name} {distribution_version(name) or '?'}")
    return ", ".join(parts)


def _torch_inputs(config: BasedConfig, n_sets: int, seed: int = 0):
    import torch

    generator = torch.Generator(device="cuda").manual_seed(seed)

    def normal(*shape):
        return torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=generator,
                           requires_grad=config.backward)

    sets = []
    for _ in range(n_sets):
        q = normal(config.batch, config.t, config.heads, config.feature)
        k = normal(config.batch, config.t, config.heads, config.feature)
        v = normal(config.batch, config.t, config.heads, config.value_dim)
        cotangent = normal(config.batch, config.t, config.heads, config.value_dim).detach()
        sets.append((q, k, v, cotangent))
    return sets


def _fla_contender(function_name: str) -> Contender:
    def prepare(config: BasedConfig) -> Runner:
        import torch
        from fla.ops import based as fla_based

        attend = getattr(fla_based, function_name)
        sets = _torch_inputs(config, _input_sets(config))

        if config.backward:
            def call(i):
                q, k, v, cotangent = sets[i]
                o = attend(q, k, v)
                # autograd.grad returns fresh gradients (no accumulation into .grad).
                return torch.autograd.grad(o, (q, k, v), cotangent)
        else:
            def call(i):
                q, k, v, _ = sets[i]
                return attend(q, k, v)
        return Runner(call=call, n_sets=len(sets), clock=TorchCudaClock(),
                      release=torch.cuda.empty_cache)

    return Contender(
        name=f"fla_{function_name.removesuffix('_based')}",
        description=f"fla.ops.based.{function_name} (Triton)",
        role=PEER,
        unavailable=_fla_unavailable,
        prepare=prepare,
        version=_fla_version)


def contenders(tk_backend: str = "kernel") -> list[Contender]:
    """All Based contenders in report column order."""
    listed = [_tk_contender(tk_backend)]
    if tk_backend != "reference":
        listed.append(_tk_contender("reference"))
    listed += [_fla_contender("fused_chunk_based"), _fla_contender("parallel_based")]
    return listed


# ---------------------------------------------------------------------------------------------
# Decode: one token step that reads and writes the recurrent state.

def decode_floor_bytes(batch: int, heads: int, feature: int = FEATURE,
                       value_dim: int = VALUE_DIM) -> int:
    """Bytes a decode step must move: the fp32 state (kv of (1 + F + F^2) x Dv plus the
    normaliser of 1 + F + F^2) read once and written once, per batch and head."""
    features = 1 + feature + feature * feature  # 273 for F = 16
    return (features * value_dim + features) * 4 * batch * heads * 2


def copy_bandwidth_bytes_per_s(reps: int, n_bytes: int = 512 * 2**20) -> float:
    """Achieved read+write bandwidth of an elementwise pass over a large fp32 array: the
    practical ceiling a memory-bound step can reach on this card."""
    import jax

    (x,) = random_normal_sets([(n_bytes // 4,)], 1, dtype="float32")[0]
    compiled = jax.jit(lambda a: a + 1.0).lower(x).compile()
    timing = measure(Runner(call=lambda i: compiled(x), n_sets=1, clock=JaxClock()), reps=reps)
    return 2 * n_bytes / timing.median_s


def _prefilled_state(batch: int, heads: int):
    """The state (S, z) that the reference returns after a short random prompt."""
    import jax
    import tk_jax

    prompt = BasedConfig(t=DECODE_PROMPT, backward=False, batch=batch, heads=heads)
    q, k, v = random_normal_sets(_shapes(prompt), 1)[0]
    return jax.jit(lambda q, k, v: tk_jax.based_linear_attention(
        q, k, v, return_state=True, backend="reference")[1])(q, k, v)


def decode_contender(batch: int, heads: int) -> Contender:
    """A jitted generation loop of DECODE_STEPS steps carrying the state (as a model samples),
    so that the state can be updated in place; run_decode reports the time per step."""
    def prepare(_config) -> Runner:
        import jax
        import jax.numpy as jnp
        import tk_jax

        state = _prefilled_state(batch, heads)
        tokens = random_normal_sets([(DECODE_STEPS, batch, heads, FEATURE),
                                     (DECODE_STEPS, batch, heads, FEATURE),
                                     (DECODE_STEPS, batch, heads, VALUE_DIM)], 1, seed=2)[0]

        def generate(state, qs, ks, vs):
            def step(i, carry):
                state, total = carry
                y, state = tk_jax.based_decode_step(qs[i], ks[i], vs[i], state)
                return state, total + jnp.sum(y[:, 0, 0].astype(jnp.float32))  # y is used
            return jax.lax.fori_loop(0, DECODE_STEPS, step, (state, jnp.float32(0)))

        compiled = jax.jit(generate).lower(state, *tokens).compile()
        return Runner(call=lambda i: compiled(state, *tokens), n_sets=1, clock=JaxClock())

    return Contender(
        name=DECODE_NAME,
        description=(f"tk_jax.based_decode_step (one token, q_t/k_t [B, H, F], v_t [B, H, Dv]), "
                     f"a jitted loop of {DECODE_STEPS} steps"),
        role=OURS,
        unavailable=lambda: module_unavailable("tk_jax"),
        prepare=prepare,
        version=lambda: distribution_version("tk_jax"))
