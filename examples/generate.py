"""Generate tokens with the GPT of examples/gpt.py over a KV cache, and with a BasedLM over its
recurrent state; print tokens/s for each.

GPT: a jitted prefill (the whole prompt in one call, writing the cache) and a jitted decode
loop (lax.fori_loop, one token per row per step, the cache donated so it is updated in place).
  tk:    tk_jax.flash_attention_with_kvcache over a paged cache (pages handed out in shuffled
         order through a page table) or a contiguous one (--cache).
  cudnn: the same loop, appending with a scatter and reading a contiguous cache with
         jax.nn.dot_product_attention(implementation="cudnn", key_value_seq_lengths=...).
  xla:   as cudnn with implementation="xla" (CPU).
BasedLM (tk_jax.nn): the prompt runs in parallel and leaves each layer's state (Based: the
273-feature linear-attention state; short conv: its last few inputs; sliding-window attention:
a ring buffer of its window); each decode step updates that state, whose size does not grow
with the sequence (tk_jax.based_decode_step for the Based layers).

Random weights: the point is speed, and that the loops compute what the full forward does
(tests/test_example_generate.py checks it).

    python examples/generate.py --tiny                  # CPU, seconds
    python examples/generate.py --attention tk cudnn    # H100
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import tk_jax
from tk_jax.nn import BasedConfig, BasedLM
from tk_jax.nn.short_conv import causal_depthwise_conv
from tk_jax.nn.rotary import apply_rotary

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from config_flags import add_field_flags, add_tiny_flag, config_from_args  # noqa: E402
from gpt import GPT, GPTConfig, init_cache, rope  # noqa: E402


# ------------------------------------------------------------------------------- sampling

def sample(logits: jax.Array, key: jax.Array, temperature: float) -> jax.Array:
    """[B, V] float32 -> [B] int32: greedy at temperature 0, else softmax(logits / temperature)."""
    if temperature == 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return jax.random.categorical(key, logits / temperature, axis=-1).astype(jnp.int32)


def cast_params(state, dtype):
    """Floating parameters in the compute dtype: decode reads every weight once per token, so
    reading float32 masters would double the bytes (training keeps float32)."""
    return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x,
                        state)


def shuffled_page_table(rng: np.random.Generator, batch: int, max_len: int,
                        page_size: int) -> np.ndarray:
    """[B, ceil(max_len / page_size)] int32: a random permutation of the pool's pages, so that
    no row's pages are contiguous or in order (as in a server that has been running a while)."""
    pages_per_row = -(-max_len // page_size)
    return rng.permutation(batch * pages_per_row).astype(np.int32).reshape(batch, pages_per_row)


# ------------------------------------------------------------------------------- GPT loops

def make_gpt_generate(model: GPT, *, num_steps: int, temperature: float = 0.0):
    """(prefill, decode), both jitted:

    prefill(params, prompt [B, P], cache) -> (first [B] int32, cache): the prompt's keys and
      values written, first = the token sampled after it (cache donated).
    decode(params, first, cache, key) -> (tokens [B, num_steps] int32, cache): each step feeds
      the last token and samples the next (tokens[:, i] follows first and tokens[:, :i]).
    """
    graphdef, _ = nnx.split(model)

    @functools.partial(jax.jit, donate_argnums=2)
    def prefill(params, prompt, cache):
        logits, cache = nnx.merge(graphdef, params).forward_with_cache(prompt, cache,
                                                                       last_only=True)
        return sample(logits[:, -1], jax.random.key(0), temperature), cache

    def decode(params, first, cache, key):
        model = nnx.merge(graphdef, params)

        def step(i, carry):
            token, cache, out = carry
            logits, cache = model.forward_with_cache(token[:, None], cache)
            token = sample(logits[:, -1], jax.random.fold_in(key, i), temperature)
            return token, cache, out.at[:, i].set(token)

        out = jnp.zeros((first.shape[0], num_steps), jnp.int32)
        _, cache, out = jax.lax.fori_loop(0, num_steps, step, (first, cache, out))
        return out, cache

    return prefill, jax.jit(decode, donate_argnums=2)


# ---------------------------------------------------------------------------- BasedLM loops
# Per-layer state, by layer kind:
#   "based": BasedState(S [B, H, 273, Dv], z [B, H, 273]) float32
#   "conv":  the last kernel_size - 1 inputs of the convolution [B, K - 1, d_model]
#   "swa":   (keys, values) [B, window, H, D]: position p in slot p % window

def _based_mixer_prefill(mixer, x):
    batch, seq_len, _ = x.shape
    heads = lambda t: t.reshape(batch, seq_len, mixer.num_heads, -1)
    q, k, v = heads(mixer.q_proj(x)), heads(mixer.k_proj(x)), heads(mixer.v_proj(x))
    y, state = tk_jax.based_linear_attention(q, k, v, normalize=mixer.output_norm == "denominator",
                                             eps=mixer.eps, return_state=True,
                                             backend=mixer.backend)
    if mixer.output_norm == "rmsnorm":
        y = mixer.head_norm(y)
    return mixer.out_proj(y.reshape(batch, seq_len, -1)), state


def _based_mixer_step(mixer, x_t, state):
    batch = x_t.shape[0]
    heads = lambda t: t.reshape(batch, mixer.num_heads, -1)
    q, k, v = heads(mixer.q_proj(x_t)), heads(mixer.k_proj(x_t)), heads(mixer.v_proj(x_t))
    y, state = tk_jax.based_decode_step(q, k, v, state, normalize=mixer.output_norm ==
                                        "denominator", eps=mixer.eps, backend=mixer.backend)
    if mixer.output_norm == "rmsnorm":
        y = mixer.head_norm(y)
    return mixer.out_proj(y.reshape(batch, -1)), state


def _conv_weights(mixer):
    return mixer.conv_weight[...].astype(mixer.dtype), mixer.conv_bias[...].astype(mixer.dtype)


def _conv_mixer_prefill(mixer, x):
    u, gate = jnp.split(mixer.in_proj(x), 2, axis=-1)
    weight, bias = _conv_weights(mixer)
    y = causal_depthwise_conv(u, weight, bias)
    keep = weight.shape[0] - 1
    tail = jnp.pad(u, ((0, 0), (keep, 0), (0, 0)))[:, u.shape[1]:]   # last K-1 inputs, 0-padded
    return mixer.out_proj(y * jax.nn.silu(gate)), tail


def _conv_mixer_step(mixer, x_t, tail):
    u, gate = jnp.split(mixer.in_proj(x_t), 2, axis=-1)
    weight, bias = _conv_weights(mixer)
    window = jnp.concatenate([tail, u[:, None]], axis=1)        # [B, K, C], oldest first
    y = bias + jnp.einsum("bkc,kc->bc", window, weight[::-1])   # weight[i] multiplies x_{t-i}
    return mixer.out_proj(y * jax.nn.silu(gate)), window[:, 1:]


def _swa_project(mixer, x):
    batch, seq_len, _ = x.shape
    heads = lambda t: t.reshape(batch, seq_len, mixer.num_heads, mixer.head_dim)
    return heads(mixer.q_proj(x)), heads(mixer.k_proj(x)), heads(mixer.v_proj(x))


def _swa_mixer_prefill(mixer, x):
    seq_len, window = x.shape[1], mixer.window
    q, k, v = _swa_project(mixer, x)
    q, k = apply_rotary(q, base=mixer.rope_base), apply_rotary(k, base=mixer.rope_base)
    o = tk_jax.flash_attention(q, k, v, causal=True, window_size=(window - 1, 0),
                               backend=mixer.backend)
    # Slot s holds the last prompt position p = s (mod window); slots no position reached yet
    # hold zeros (never read: the step masks positions < 0).
    slot = jnp.arange(window)
    position = (seq_len - 1) - (seq_len - 1 - slot) % window
    ring = lambda t: jnp.where((position >= 0)[None, :, None, None],
                               jnp.take(t, jnp.maximum(position, 0), axis=1), 0)
    out = mixer.out_proj(o.reshape(*x.shape[:2], -1))
    return out, (ring(k), ring(v))


def _swa_mixer_step(mixer, x_t, ring, position):
    window = mixer.window
    q, k, v = _swa_project(mixer, x_t[:, None])
    at = jnp.full((x_t.shape[0], 1), position, jnp.int32)
    q, k = rope(q, at, base=mixer.rope_base)[:, 0], rope(k, at, base=mixer.rope_base)[:, 0]
    slot = position % window
    keys = jax.lax.dynamic_update_index_in_dim(ring[0], k, slot, axis=1)
    values = jax.lax.dynamic_update_index_in_dim(ring[1], v[:, 0], slot, axis=1)
    # Slot s holds position position - ((position - s) mod window); negative: never written.
    held = position - (position - jnp.arange(window)) % window
    scores = jnp.einsum("bhd,bwhd->bhw", q.astype(jnp.float32), keys.astype(jnp.float32))
    scores = jnp.where(held >= 0, scores / np.sqrt(mixer.head_dim), -jnp.inf)
    o = jnp.einsum("bhw,bwhd->bhd", jax.nn.softmax(scores, axis=-1), values.astype(jnp.float32))
    return mixer.out_proj(o.reshape(x_t.shape[0], -1).astype(x_t.dtype)), (keys, values)


def based_prefill(model: BasedLM, tokens: jax.Array, *, last_only: bool = False):
    """Logits [B, T, V] of the prompt (last_only: [B, 1, V], of its last token) and the
    per-layer states after it."""
    x = model.embed(tokens)
    states = []
    for block in model.blocks:
        prefill = {"based": _based_mixer_prefill, "conv": _conv_mixer_prefill,
                   "swa": _swa_mixer_prefill}[block.kind]
        y, state = prefill(block.mixer, block.mixer_norm(x))
        x = x + y
        x = x + block.mlp(block.mlp_norm(x))
        states.append(state)
    return _based_logits(model, x[:, -1:] if last_only else x), tuple(states)


def based_step(model: BasedLM, token: jax.Array, states: tuple, position: jax.Array):
    """Logits [B, V] after token [B] at `position` (the same for every row), and the states."""
    x = model.embed(token)
    new_states = []
    for block, state in zip(model.blocks, states):
        h = block.mixer_norm(x)
        if block.kind == "based":
            y, state = _based_mixer_step(block.mixer, h, state)
        elif block.kind == "conv":
            y, state = _conv_mixer_step(block.mixer, h, state)
        else:
            y, state = _swa_mixer_step(block.mixer, h, state, position)
        x = x + y
        x = x + block.mlp(block.mlp_norm(x))
        new_states.append(state)
    return _based_logits(model, x), tuple(new_states)


def _based_logits(model, x):
    x = model.final_norm(x)
    logits = model.embed.attend(x) if model.config.tie_embeddings else model.lm_head(x)
    return logits.astype(jnp.float32)


def make_based_generate(model: BasedLM, *, num_steps: int, temperature: float = 0.0):
    """(prefill, decode) as make_gpt_generate's, with the recurrent states for a cache:
    prefill(params, prompt) -> (first, states); decode(params, first, states, key) -> (tokens,
    states), states donated."""
    graphdef, _ = nnx.split(model)

    @jax.jit
    def prefill(params, prompt):
        logits, states = based_prefill(nnx.merge(graphdef, params), prompt, last_only=True)
        return sample(logits[:, -1], jax.random.key(0), temperature), states

    def decode(params, first, states, prompt_len, key):
        model = nnx.merge(graphdef, params)

        def step(i, carry):
            token, states, out = carry
            logits, states = based_step(model, token, states, prompt_len + i)
            token = sample(logits, jax.random.fold_in(key, i), temperature)
            return token, states, out.at[:, i].set(token)

        out = jnp.zeros((first.shape[0], num_steps), jnp.int32)
        _, states, out = jax.lax.fori_loop(0, num_steps, step, (first, states, out))
        return out, states

    return prefill, jax.jit(decode, donate_argnums=2)


# ------------------------------------------------------------------------------- benchmark

@dataclasses.dataclass
class GenerateConfig:
    attention: tuple[str, ...] | None = None   # None: tk and cudnn on a GPU, tk and xla on CPU
    cache: str = "paged"                       # tk's cache: paged, contiguous or both
    vocab_size: int = 32000
    d_model: int = 1024
    layers: int = 8
    heads: int = 16
    kv_heads: int = 4
    head_dim: int = 128
    batch_size: int = 8
    prompt_len: int = 16384
    gen_len: int = 256
    page_size: int = 256
    dtype: str = "bfloat16"
    temperature: float = 0.0
    based: bool = True
    based_head_dim: int = 64                    # Based value dim per head (kernel: 64 or 128)
    based_batch_size: int | None = None         # None: batch_size
    backend: str = "auto"
    seed: int = 0


TINY = dict(vocab_size=64, d_model=64, layers=2, heads=4, kv_heads=2, head_dim=16, batch_size=2,
            prompt_len=12, gen_len=8, page_size=4, dtype="float32", based_head_dim=16,
            cache="both")


def _timed(fn, *args):
    start = time.perf_counter()
    out = jax.block_until_ready(fn(*args))
    return out, time.perf_counter() - start


def _size(num_bytes: float) -> str:
    for unit in ("B", "KiB", "MiB"):
        if num_bytes < 1024:
            return f"{num_bytes:,.1f} {unit}"
        num_bytes /= 1024
    return f"{num_bytes:,.2f} GiB"


def _report(name, batch, prompt_len, gen_len, prefill_s, decode_s, memory):
    print(f"{name:28s} prefill {batch} x {prompt_len} in {prefill_s * 1e3:8.1f} ms "
          f"({batch * prompt_len / prefill_s:12,.0f} tokens/s); decode {batch} x {gen_len} in "
          f"{decode_s * 1e3:8.1f} ms ({batch * gen_len / decode_s:10,.0f} tokens/s); {memory}",
          flush=True)


def gpt_config(cfg: GenerateConfig, attention: str) -> GPTConfig:
    return GPTConfig(vocab_size=cfg.vocab_size, d_model=cfg.d_model, num_layers=cfg.layers,
                     num_heads=cfg.heads, num_kv_heads=cfg.kv_heads, head_dim=cfg.head_dim,
                     dtype=jnp.dtype(cfg.dtype), attention=attention, backend=cfg.backend)


def run_gpt(cfg: GenerateConfig, attention: str, paged: bool, prompt):
    """Prefill + decode twice (the first compiles), timing the second. Returns the tokens.

    Every attention builds its model from the same seed: the same weights."""
    batch, prompt_len = prompt.shape
    # Capacity: whole pages, for the contiguous layout too (the same cache size either way).
    max_len = -(-(prompt_len + cfg.gen_len) // cfg.page_size) * cfg.page_size
    page_table = (shuffled_page_table(np.random.default_rng(cfg.seed), batch, max_len,
                                      cfg.page_size) if paged else None)
    model = GPT(gpt_config(cfg, attention), rngs=nnx.Rngs(cfg.seed))
    params = cast_params(nnx.state(model), jnp.dtype(cfg.dtype))
    prefill, decode = make_gpt_generate(model, num_steps=cfg.gen_len, temperature=cfg.temperature)
    key = jax.random.key(cfg.seed)

    def new_cache():
        return init_cache(model.config, batch, max_len,
                          page_size=cfg.page_size if paged else None, page_table=page_table)

    for _ in range(2):
        cache = new_cache()
        jax.block_until_ready(cache)
        (first, cache), prefill_s = _timed(prefill, params, prompt, cache)
        (tokens, cache), decode_s = _timed(decode, params, first, cache, key)
    per_row = sum(x.nbytes for x in cache.k + cache.v) / batch
    layout = f"paged, {cfg.page_size}-token pages" if paged else "contiguous"
    _report(f"GPT {attention} ({'paged' if paged else 'contiguous'})", batch, prompt_len,
            cfg.gen_len, prefill_s, decode_s,
            f"KV cache {_size(per_row)} per sequence ({layout})")
    return jnp.concatenate([first[:, None], tokens], axis=1)


def run_based(cfg: GenerateConfig, prompt):
    batch, prompt_len = prompt.shape
    based_heads = cfg.d_model // cfg.based_head_dim
    model = BasedLM(BasedConfig(vocab_size=cfg.vocab_size, d_model=cfg.d_model,
                                num_layers=cfg.layers, based_heads=based_heads,
                                swa_heads=cfg.d_model // cfg.head_dim, swa_window=128,
                                dtype=jnp.dtype(cfg.dtype), backend=cfg.backend),
                    rngs=nnx.Rngs(cfg.seed))
    params = cast_params(nnx.state(model), jnp.dtype(cfg.dtype))
    prefill, decode = make_based_generate(model, num_steps=cfg.gen_len,
                                          temperature=cfg.temperature)
    key = jax.random.key(cfg.seed)
    for _ in range(2):
        (first, states), prefill_s = _timed(prefill, params, prompt)
        (tokens, states), decode_s = _timed(decode, params, first, states, prompt_len, key)
    per_row = sum(x.nbytes for x in jax.tree.leaves(states)) / batch
    _report(f"BasedLM {'/'.join(model.config.pattern())}"[:28], batch, prompt_len, cfg.gen_len,
            prefill_s, decode_s, f"state {_size(per_row)} per sequence (any length)")
    return jnp.concatenate([first[:, None], tokens], axis=1)


def main(argv=None) -> dict:
    cfg = parse_args(argv)
    device = jax.devices()[0]
    attentions = cfg.attention or (("tk", "cudnn") if device.platform == "gpu" else ("tk", "xla"))
    print(f"GPT d_model {cfg.d_model}, {cfg.layers} layers, {cfg.heads}/{cfg.kv_heads} heads of "
          f"{cfg.head_dim}, vocab {cfg.vocab_size}, {cfg.dtype}; batch {cfg.batch_size}, prompt "
          f"{cfg.prompt_len}, {cfg.gen_len} new tokens; {device.platform} {device.device_kind}",
          flush=True)
    rng = np.random.default_rng(cfg.seed)
    prompt = jnp.asarray(rng.integers(0, cfg.vocab_size, (cfg.batch_size, cfg.prompt_len)),
                         jnp.int32)

    results = {}
    for attention in attentions:
        layouts = {"paged": (True,), "contiguous": (False,), "both": (True, False)}[cfg.cache]
        if attention != "tk":
            layouts = (False,)   # jax.nn takes no page table: it reads a contiguous cache
        for paged in layouts:
            name = f"{attention}-{'paged' if paged else 'contiguous'}"
            try:
                results[name] = run_gpt(cfg, attention, paged, prompt)
            except Exception as err:  # e.g. cuDNN refusing a shape: report it, run the rest
                print(f"GPT {name}: failed: {type(err).__name__}: {str(err).splitlines()[0]}",
                      flush=True)
    names = list(results)
    for name in names[1:]:
        same = float(jnp.mean(results[name] == results[names[0]]))
        # Once one token differs, a sequence continues from another prefix: count how long the
        # two agree from the start too.
        prefix = float(jnp.mean(jnp.cumprod(results[name] == results[names[0]], axis=1).sum(1)))
        print(f"  {name} generated the same tokens as {names[0]}: {same:.1%}; the first "
              f"{prefix:.1f} of {results[name].shape[1]} on average before any differs"
              + (" (greedy; bf16 rounding may flip near-ties, with random weights often)"
                 if cfg.temperature == 0 and cfg.dtype != "float32" else ""))
    if cfg.based:
        based_prompt = prompt[:cfg.based_batch_size or cfg.batch_size]
        results["based"] = run_based(cfg, based_prompt)
    return results


def parse_args(argv=None) -> GenerateConfig:
    defaults = GenerateConfig()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--attention", nargs="+", choices=("tk", "cudnn", "xla"),
                   help="GPT attention(s) to run (tk cudnn on a GPU, tk xla on CPU)")
    p.add_argument("--cache", choices=("paged", "contiguous", "both"),
                   help=f"tk's cache layout ({defaults.cache}); cudnn/xla read a contiguous one")
    add_field_flags(p, defaults, {
        "vocab_size": (int, "vocabulary"), "d_model": (int, "model width"),
        "layers": (int, "layers (GPT and BasedLM)"), "heads": (int, "query heads"),
        "kv_heads": (int, "key/value heads (GQA)"), "head_dim": (int, "head dim"),
        "batch_size": (int, "sequences"), "prompt_len": (int, "prompt tokens"),
        "gen_len": (int, "decode steps"), "page_size": (int, "tokens per cache page"),
        "temperature": (float, "0: greedy"),
        "based_head_dim": (int, "BasedLM value dim per head"),
        "based_batch_size": (int, "BasedLM sequences (batch size)"), "seed": (int, "seed"),
        "dtype": (("bfloat16", "float32"), "compute dtype"),
        "backend": (("auto", "kernel", "reference"), "tk_jax backend"),
    })
    p.add_argument("--no-based", dest="based", action="store_false", default=None,
                   help="skip the BasedLM")
    add_tiny_flag(p, "a CPU run of seconds: ", TINY)
    args = p.parse_args(argv)
    if args.attention is not None:
        args.attention = tuple(args.attention)   # argparse gives a list; the config holds a tuple
    return config_from_args(defaults, args, TINY)


if __name__ == "__main__":
    main()
