"""Flax NNX layers in tk_jax.nn: shapes, causality, finite gradients (CPU, reference backend);
tk_jax.nn.attention_fn in flax.nnx.MultiHeadAttention against Flax's default attention_fn."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tk_jax.nn import (BasedConfig, BasedLinearAttention, BasedLM, GatedShortConv,
                       SlidingWindowAttention, SwiGLU, attention_fn, based_layer_pattern,
                       causal_depthwise_conv)

B, T, D_MODEL = 2, 24, 32


def random_x(seed=0, seq_len=T):
    return jax.random.normal(jax.random.key(seed), (B, seq_len, D_MODEL))


def make_layer(name, rngs):
    if name == "based":
        return BasedLinearAttention(D_MODEL, 2, rngs=rngs)
    if name == "based_rmsnorm":
        return BasedLinearAttention(D_MODEL, 2, output_norm="rmsnorm", rngs=rngs)
    if name == "swa":
        return SlidingWindowAttention(D_MODEL, 4, window=5, rngs=rngs)
    if name == "conv":
        return GatedShortConv(D_MODEL, kernel_size=3, rngs=rngs)
    return SwiGLU(D_MODEL, 48, rngs=rngs)


LAYERS = ["based", "based_rmsnorm", "swa", "conv", "swiglu"]


def assert_causal(fn, x, t):
    """Changing token t changes no output before t (and does change output t)."""
    y = np.asarray(fn(x))
    x2 = x.at[:, t].add(1.0)
    y2 = np.asarray(fn(x2))
    np.testing.assert_allclose(y2[:, :t], y[:, :t], rtol=1e-5, atol=1e-5)
    assert np.abs(y2[:, t] - y[:, t]).max() > 1e-4


@pytest.mark.parametrize("name", LAYERS)
def test_layer_shape_causality_and_gradient(name):
    layer = make_layer(name, nnx.Rngs(0))
    graphdef, params = nnx.split(layer, nnx.Param)
    apply = jax.jit(lambda params, x: nnx.merge(graphdef, params)(x))
    x = random_x()
    y = apply(params, x)
    assert y.shape == x.shape and y.dtype == x.dtype
    assert_causal(lambda x: apply(params, x), x, t=T // 2)
    grads = jax.jit(jax.grad(lambda p, x: (apply(p, x) ** 2).mean()))(params, x)
    leaves = jax.tree.leaves(grads)
    assert leaves and all(np.isfinite(np.asarray(g)).all() for g in leaves)
    assert any(np.abs(np.asarray(g)).max() > 0 for g in leaves)


def test_sliding_window_forgets_tokens_outside_window():
    layer = SlidingWindowAttention(D_MODEL, 4, window=5, rngs=nnx.Rngs(1))
    graphdef, params = nnx.split(layer, nnx.Param)
    apply = jax.jit(lambda x: nnx.merge(graphdef, params)(x))
    x = random_x(1)
    y, y2 = apply(x), apply(x.at[:, 3].add(1.0))
    # Token 3 is seen by queries 3..7 (window 5) and by nobody after.
    assert np.abs(np.asarray(y2[:, 7] - y[:, 7])).max() > 1e-4
    np.testing.assert_allclose(np.asarray(y2[:, 8:]), np.asarray(y[:, 8:]), rtol=1e-5, atol=1e-5)


def test_causal_depthwise_conv_matches_loop():
    rng = np.random.default_rng()
    x = rng.standard_normal((2, 9, 5))
    w = rng.standard_normal((3, 5))
    b = rng.standard_normal(5)
    expected = np.tile(b, (2, 9, 1))
    for t in range(9):
        for i in range(3):
            if t - i >= 0:
                expected[:, t] += w[i] * x[:, t - i]
    got = causal_depthwise_conv(jnp.asarray(x, jnp.float32), jnp.asarray(w, jnp.float32),
                                jnp.asarray(b, jnp.float32))
    np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-5, atol=1e-5)


def test_layer_pattern_is_mostly_based():
    assert based_layer_pattern(2) == ("conv", "based")
    pattern = based_layer_pattern(16)
    assert pattern.count("based") > len(pattern) / 2
    assert 0 < pattern.count("swa") < pattern.count("conv")


def test_based_lm_shapes_causality_gradient():
    config = BasedConfig(vocab_size=40, d_model=D_MODEL, num_layers=4,
                         layer_pattern=("conv", "based", "swa", "based"), based_heads=2,
                         based_output_norm="rmsnorm", swa_heads=2, swa_window=6,
                         mlp_hidden_dim=48, tie_embeddings=False, backend="reference")
    model = BasedLM(config, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model, nnx.Param)
    apply = jax.jit(lambda params, tokens: nnx.merge(graphdef, params)(tokens))
    tokens = jax.random.randint(jax.random.key(2), (B, T), 0, 40)
    logits = apply(params, tokens)
    assert logits.shape == (B, T, 40) and logits.dtype == jnp.float32
    # Causality through the whole stack: change token 10, logits before 10 stay put.
    logits2 = apply(params, tokens.at[:, 10].set((tokens[:, 10] + 1) % 40))
    np.testing.assert_allclose(np.asarray(logits2[:, :10]), np.asarray(logits[:, :10]),
                               rtol=1e-5, atol=1e-5)
    assert np.abs(np.asarray(logits2[:, 10] - logits[:, 10])).max() > 1e-4

    def loss(params):
        log_probs = jax.nn.log_softmax(apply(params, tokens))
        return -jnp.take_along_axis(log_probs[:, :-1], tokens[:, 1:, None], axis=-1).mean()

    grads = jax.jit(jax.grad(loss))(params)
    leaves = jax.tree.leaves(grads)
    assert len(leaves) == len(jax.tree.leaves(params)) and "lm_head" in grads
    assert all(np.isfinite(np.asarray(g)).all() for g in leaves)


def test_bf16_model_with_tied_embeddings_runs():
    config = BasedConfig(vocab_size=30, d_model=D_MODEL, num_layers=2, dtype=jnp.bfloat16)
    model = BasedLM(config, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model, nnx.Param)
    assert "lm_head" not in params
    logits = jax.jit(lambda p, t: nnx.merge(graphdef, p)(t))(params, jnp.zeros((B, 9), jnp.int32))
    assert logits.shape == (B, 9, 30) and logits.dtype == jnp.float32
    assert np.isfinite(np.asarray(logits)).all()


def test_bad_layer_options_are_refused():
    with pytest.raises(ValueError, match="output_norm"):
        BasedLinearAttention(D_MODEL, 2, output_norm="layernorm", rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="window"):
        SlidingWindowAttention(D_MODEL, 2, window=0, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="layer_pattern"):
        BasedLM(BasedConfig(vocab_size=10, num_layers=2, layer_pattern=("based", "mamba")),
                rngs=nnx.Rngs(0))


# ----------------------------------------------------------------------------------------------
# tk_jax.nn.attention_fn in flax.nnx.MultiHeadAttention, against Flax's default attention_fn.


def attention_pair(**options):
    """Two MultiHeadAttention layers with the same parameters: Flax's default attention_fn
    and tk_jax.nn.attention_fn."""
    import inspect
    gqa = "num_kv_heads" in inspect.signature(nnx.MultiHeadAttention).parameters
    config = dict(num_heads=4, in_features=D_MODEL, qkv_features=32, decode=False,
                  **({"num_kv_heads": 2} if gqa else {}), **options)
    default = nnx.MultiHeadAttention(**config, rngs=nnx.Rngs(0))
    ours = nnx.MultiHeadAttention(**config, attention_fn=attention_fn, rngs=nnx.Rngs(0))
    return default, ours


def test_attention_fn_matches_flax_default():
    """Outputs and parameter gradients of a causal layer, with two batch dims (folded and
    unfolded like Flax). (Without is_causal the same path runs with no mask: the fallback test
    below covers it.)"""
    is_causal = True
    default, ours = attention_pair()
    x = jax.random.normal(jax.random.key(3), (2, 2, 9, D_MODEL))

    def output_and_grads(layer):
        graphdef, params = nnx.split(layer, nnx.Param)

        def loss(params):
            y = nnx.merge(graphdef, params)(x, is_causal=is_causal)
            return jnp.sum(y * jnp.cos(y)), y

        (_, y), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
        return y, jax.tree.leaves(grads)

    y_ref, grads_ref = output_and_grads(default)
    y, grads = output_and_grads(ours)
    np.testing.assert_allclose(np.asarray(y), np.asarray(y_ref), rtol=1e-4, atol=1e-5)
    assert len(grads) == len(grads_ref)
    for g, g_ref in zip(grads, grads_ref):
        np.testing.assert_allclose(np.asarray(g), np.asarray(g_ref), rtol=1e-4, atol=1e-5)


def test_attention_fn_falls_back_for_masks_and_dropout(monkeypatch):
    """A dense mask runs jax.nn's XLA path, dropout runs Flax's default (deterministic=True
    would not: no dropout then); each warns once and gives Flax's result."""
    from tk_jax import jax_nn_compat
    monkeypatch.setattr(jax_nn_compat, "_warned", set())
    x = jax.random.normal(jax.random.key(4), (B, 7, D_MODEL))
    mask = nnx.make_causal_mask(jnp.ones((B, 7)))
    default, ours = attention_pair()
    with pytest.warns(UserWarning, match="dense mask"):
        y = ours(x, mask=mask)
    np.testing.assert_allclose(np.asarray(y), np.asarray(default(x, mask=mask)), rtol=1e-5,
                               atol=1e-6)
    default, ours = attention_pair(dropout_rate=0.5)
    with pytest.warns(UserWarning, match="dropout"):
        y = ours(x, deterministic=False)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(default(x, deterministic=False)))


@pytest.mark.gpu
def test_attention_fn_runs_the_kernel_on_gpu(hopper, monkeypatch):
    """bf16, head_dim 64: MultiHeadAttention with tk_jax.nn.attention_fn calls the kernel (the
    reference is switched off) and matches Flax's default within bf16 accuracy, forward and
    backward."""
    from tk_jax import attention as tk_attention

    def no_reference(*args, **kwargs):
        raise AssertionError("the reference ran where the kernel should")

    monkeypatch.setattr(tk_attention.reference_attention, "attention_forward", no_reference)
    config = dict(num_heads=2, in_features=128, decode=False, dtype=jnp.bfloat16)
    default = nnx.MultiHeadAttention(**config, rngs=nnx.Rngs(0))
    ours = nnx.MultiHeadAttention(**config, attention_fn=attention_fn, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(5), (2, 300, 128), jnp.bfloat16)

    def output_and_input_grad(layer):
        graphdef, params = nnx.split(layer, nnx.Param)
        run = lambda x: nnx.merge(graphdef, params)(x, is_causal=True).astype(jnp.float32)
        return jax.jit(lambda x: (run(x), jax.grad(lambda x: jnp.sum(run(x) ** 2))(x)))(x)

    (y, dx), (y_ref, dx_ref) = output_and_input_grad(ours), output_and_input_grad(default)
    for actual, expected in ((y, y_ref), (dx, dx_ref)):
        actual = np.asarray(jnp.asarray(actual, jnp.float32), np.float64)
        expected = np.asarray(jnp.asarray(expected, jnp.float32), np.float64)
        assert np.linalg.norm(actual - expected) / np.linalg.norm(expected) < 2e-2
