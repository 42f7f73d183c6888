"""examples/generate.py: the GPT's jitted prefill + decode loop over a shuffled paged cache (and a
contiguous one) and the BasedLM's loop over its recurrent state generate what the full forward
predicts at every step; the tiny CLI run works."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from example_util import load_example


@pytest.fixture(scope="module")
def gpt():
    return load_example("gpt")


@pytest.fixture(scope="module")
def generate():
    load_example("gpt")
    return load_example("generate")


def assert_greedy_continuation(full_logits_fn, prompt, generated, *, margin=1e-4):
    """Every generated token is the argmax of the full forward over everything before it
    (teacher-forced: one forward of prompt + generated), except where the top two logits lie
    within `margin` (a near-tie the cache's rounding may break either way)."""
    sequence = jnp.concatenate([prompt, generated], axis=1)
    logits = np.asarray(full_logits_fn(sequence))                    # [B, T, V]
    prompt_len = prompt.shape[1]
    predicted = logits[:, prompt_len - 1:-1]                         # predicts generated
    generated = np.asarray(generated)
    top2 = np.sort(predicted, axis=-1)[..., -2:]
    chosen = np.take_along_axis(predicted, generated[..., None], axis=-1)[..., 0]
    ok = (chosen == predicted.max(-1)) | (top2[..., 1] - chosen < margin)
    assert ok.all(), (np.argwhere(~ok), generated, predicted.argmax(-1))
    assert (generated == predicted.argmax(-1)).mean() > 0.9


# ------------------------------------------------------------------------------------ GPT

@pytest.mark.parametrize("attention, paged", [("tk", True), ("tk", False), ("xla", True),
                                              ("xla", False)])
def test_gpt_generation_with_a_cache_is_the_full_forward(gpt, generate, rng,
                                                         attention, paged):
    from flax import nnx

    batch, prompt_len, steps, page_size = 3, 7, 9, 4        # prompt and decode cross pages
    config = gpt.GPTConfig(vocab_size=41, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2,
                           dtype=jnp.float32, attention=attention)
    model = gpt.GPT(config, rngs=nnx.Rngs(int(rng.integers(1000))))
    prompt = jnp.asarray(rng.integers(0, 41, (batch, prompt_len)), jnp.int32)
    max_len = prompt_len + steps
    page_table = None
    if paged:
        page_table = generate.shuffled_page_table(rng, batch, max_len, page_size)
        assert sorted(page_table.ravel()) == list(range(page_table.size))
    cache = gpt.init_cache(config, batch, max_len, page_size=page_size if paged else None,
                           page_table=page_table)
    prefill, decode = generate.make_gpt_generate(model, num_steps=steps)
    params = nnx.state(model)
    first, cache = prefill(params, prompt, cache)
    tokens, cache = decode(params, first, cache, jax.random.key(0))
    generated = jnp.concatenate([first[:, None], tokens], axis=1)
    assert generated.shape == (batch, steps + 1)
    np.testing.assert_array_equal(cache.lengths, max_len)
    full = nnx.jit(lambda model, tokens: model(tokens))
    assert_greedy_continuation(lambda t: full(model, t), prompt, generated)

    # The cache holds each position's rotated keys where the page table says.
    sequence = jnp.concatenate([prompt, generated[:, :-1]], axis=1)
    block = model.blocks[0]
    _, keys, _ = block.attention._project(block.attention_norm(model.embed(sequence)),
                                          jnp.broadcast_to(jnp.arange(max_len), (batch, max_len)))
    stored = gpt.contiguous_view(cache.k[0], cache.page_table)[:, :max_len]
    np.testing.assert_allclose(stored, keys, rtol=1e-5, atol=1e-5)


def test_gpt_decode_step_attends_to_each_rows_own_length(gpt, rng):
    """Rows at different lengths: one decode step of forward_with_cache equals the full forward
    of each row's own prefix (tk through the cache op, paged, vs XLA without a cache)."""
    from flax import nnx

    config = gpt.GPTConfig(vocab_size=23, d_model=32, num_layers=2, num_heads=4, num_kv_heads=1,
                           dtype=jnp.float32, attention="tk")
    model = gpt.GPT(config, rngs=nnx.Rngs(int(rng.integers(1000))))
    lengths = [5, 1, 11]
    rows = [rng.integers(0, 23, n + 1).astype(np.int32) for n in lengths]
    cache = gpt.init_cache(config, 3, 16, page_size=4,
                           page_table=jnp.asarray(rng.permutation(12).reshape(3, 4)))
    # Fill each row's cache through single-token decode steps, rows of different lengths in
    # the same batch (a row whose prefix is done repeats its last step at a masked position).
    step = nnx.jit(lambda model, tokens, cache: model.forward_with_cache(tokens, cache))
    for t in range(max(lengths)):
        tokens = jnp.asarray([[r[min(t, n - 1)]] for r, n in zip(rows, lengths)], jnp.int32)
        active = jnp.asarray([t < n for n in lengths])
        _, new = step(model, tokens, cache)
        cache = new._replace(lengths=jnp.where(active, new.lengths, cache.lengths))
    np.testing.assert_array_equal(cache.lengths, lengths)
    last = jnp.asarray([[r[n]] for r, n in zip(rows, lengths)], jnp.int32)
    logits, _ = step(model, last, cache)
    # The full forward of each row's n + 1 tokens, in one call: rows padded at the end, which
    # causal attention keeps from reaching position n.
    padded = np.zeros((3, max(lengths) + 1), np.int32)
    for b, r in enumerate(rows):
        padded[b, :len(r)] = r
    full = nnx.jit(lambda model, tokens: model(tokens))(model, jnp.asarray(padded))
    for b, n in enumerate(lengths):
        np.testing.assert_allclose(logits[b, 0], full[b, n], rtol=2e-4, atol=2e-4)


# ---------------------------------------------------------------------------------- Based

def test_based_generation_with_its_state_is_the_full_forward(generate, rng):
    from flax import nnx
    from tk_jax.nn import BasedConfig, BasedLM

    # Every layer kind; a window of 4 so that the ring buffer wraps in the prompt and again
    # while decoding.
    config = BasedConfig(vocab_size=29, d_model=32, num_layers=4,
                         layer_pattern=("conv", "based", "swa", "based"), based_heads=2,
                         swa_heads=2, swa_window=4, conv_kernel_size=3,
                         based_output_norm="rmsnorm")
    model = BasedLM(config, rngs=nnx.Rngs(int(rng.integers(1000))))
    prompt = jnp.asarray(rng.integers(0, 29, (2, 6)), jnp.int32)
    steps = 8
    prefill, decode = generate.make_based_generate(model, num_steps=steps)
    params = nnx.state(model)
    first, states = prefill(params, prompt)
    tokens, states = decode(params, first, states, prompt.shape[1], jax.random.key(0))
    generated = jnp.concatenate([first[:, None], tokens], axis=1)
    full = nnx.jit(lambda model, tokens: model(tokens))
    assert_greedy_continuation(lambda t: full(model, t), prompt, generated)
    # Constant memory: the state after 6 + 8 tokens has the shapes of the state after 6.
    _, after_prompt = prefill(params, prompt)
    assert jax.tree.map(jnp.shape, states) == jax.tree.map(jnp.shape, after_prompt)


def test_based_prefill_logits_and_a_step_match_the_full_forward(generate, rng):
    """Logit level: the prefill's logits are the full forward's, and one step continues it."""
    from flax import nnx
    from tk_jax.nn import BasedConfig, BasedLM

    config = BasedConfig(vocab_size=19, d_model=32, num_layers=3,
                         layer_pattern=("swa", "conv", "based"), based_heads=1, swa_heads=4,
                         swa_window=3)
    model = BasedLM(config, rngs=nnx.Rngs(int(rng.integers(1000))))
    tokens = jnp.asarray(rng.integers(0, 19, (2, 9)), jnp.int32)
    full = nnx.jit(lambda model, tokens: model(tokens))(model, tokens)
    logits, states = nnx.jit(generate.based_prefill)(model, tokens[:, :-1])
    np.testing.assert_allclose(logits, full[:, :-1], rtol=2e-4, atol=2e-4)
    step_logits, _ = nnx.jit(generate.based_step)(model, tokens[:, -1], states, jnp.int32(8))
    np.testing.assert_allclose(step_logits, full[:, -1], rtol=2e-4, atol=2e-4)


# ------------------------------------------------------------------------------------ CLI

def test_tiny_run_prints_tokens_per_second_for_each(generate, capsys):
    results = generate.main(["--tiny", "--attention", "tk", "--cache", "both"])
    out = capsys.readouterr().out
    assert set(results) == {"tk-paged", "tk-contiguous", "based"}
    for name, tokens in results.items():
        assert tokens.shape == (2, 9)
    # Same weights, float32, greedy: both cache layouts generate the same tokens.
    np.testing.assert_array_equal(results["tk-contiguous"], results["tk-paged"])
    lines = [line for line in out.splitlines() if "decode 2 x 8" in line]
    assert [line.split()[:3] for line in lines] == [
        ["GPT", "tk", "(paged)"], ["GPT", "tk", "(contiguous)"],
        ["BasedLM", "conv/based", "prefill"]]
    assert all(line.count("tokens/s") == 2 for line in lines)
    assert ("tk-contiguous generated the same tokens as tk-paged: 100.0%; the first 9.0 of 9 "
            "on average before any differs") in out


def test_cli_flags(generate):
    cfg = generate.parse_args(["--tiny", "--attention", "cudnn", "--cache", "paged",
                               "--no-based", "--prompt-len", "30"])
    assert cfg.attention == ("cudnn",) and cfg.cache == "paged" and not cfg.based
    assert cfg.prompt_len == 30 and cfg.d_model == generate.TINY["d_model"]
    default = generate.parse_args([])
    assert default.attention is None and default.based and default.prompt_len == 16384


# ------------------------------------------------------------------------------------ GPU

@pytest.mark.gpu
def test_gpu_tk_and_cudnn_decode_agree(gpt, generate, hopper, rng):
    """On the device, bf16: the tk paged cache and cuDNN's contiguous one give the same decode
    logits as XLA, after the same prefill."""
    from flax import nnx

    batch, prompt_len, page_size = 4, 1000, 64
    prompt = jnp.asarray(rng.integers(0, 512, (batch, prompt_len)), jnp.int32)
    page_table = generate.shuffled_page_table(rng, batch, prompt_len + 1, page_size)
    logits = {}
    for attention, paged in (("tk", True), ("cudnn", False), ("xla", False)):
        config = gpt.GPTConfig(vocab_size=512, d_model=512, num_layers=2, num_heads=8,
                               num_kv_heads=2, head_dim=128, attention=attention)
        model = gpt.GPT(config, rngs=nnx.Rngs(7))
        cache = gpt.init_cache(config, batch, prompt_len + 1,
                               page_size=page_size if paged else None,
                               page_table=page_table if paged else None)
        step = nnx.jit(lambda model, tokens, cache: model.forward_with_cache(tokens, cache))
        _, cache = step(model, prompt[:, :-1], cache)
        logits[attention], _ = step(model, prompt[:, -1:], cache)
    for attention in ("tk", "cudnn"):
        diff = np.abs(np.asarray(logits[attention]) - np.asarray(logits["xla"])).max()
        assert np.isfinite(logits[attention]).all() and diff < 5e-2, (attention, diff)
