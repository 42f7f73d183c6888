"""examples/gpt.py and examples/train_gpt.py: document positions and cuDNN's packed layout against
NumPy, RoPE against tk_jax.nn's, the packed data, packing that changes nothing (a document's
logits in a packed row equal its logits alone), the attention choices agreeing, and a tiny
training run whose loss falls. The GPU test compares every attention on the device."""
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tk_jax
from example_util import load_example


@pytest.fixture(scope="module")
def gpt():
    return load_example("gpt")


@pytest.fixture(scope="module")
def train_gpt():
    return load_example("train_gpt")


TK_HAS_SEGMENTS = "q_segment_ids" in inspect.signature(tk_jax.flash_attention).parameters
needs_tk_segments = pytest.mark.skipif(
    not TK_HAS_SEGMENTS, reason="tk_jax.flash_attention takes no segment ids in this tree")


def random_segment_ids(rng, batch, seq_len, *, max_docs=6):
    """[B, T] int32 rows of contiguous documents (random lengths, one-token ones included) with
    arbitrary increasing ids; returns (ids, list of per-row document lengths)."""
    ids, lengths = np.empty((batch, seq_len), np.int32), []
    for row in range(batch):
        cuts = np.sort(rng.choice(np.arange(1, seq_len), rng.integers(0, max_docs), replace=False))
        sizes = np.diff(np.concatenate([[0], cuts, [seq_len]]))
        labels = np.cumsum(rng.integers(1, 4, len(sizes)))       # gaps in the ids are fine
        ids[row] = np.repeat(labels, sizes)
        lengths.append(sizes)
    return ids, lengths


def tiny_config(gpt, **overrides):
    options = dict(vocab_size=37, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2,
                   dtype=jnp.float32, attention="xla")
    options.update(overrides)
    return gpt.GPTConfig(**options)


# ------------------------------------------------------------------------- pure functions

def test_positions_restart_at_each_document(gpt, rng):
    ids, lengths = random_segment_ids(rng, 3, 29)
    positions = np.asarray(gpt.positions_in_document(jnp.asarray(ids)))
    for row, sizes in enumerate(lengths):
        expected = np.concatenate([np.arange(n) for n in sizes])
        np.testing.assert_array_equal(positions[row], expected)


def test_packed_layout_lists_each_document(gpt, rng):
    ids, lengths = random_segment_ids(rng, 4, 31)
    max_documents = max(len(sizes) for sizes in lengths) + 2
    got_lengths, got_offsets = map(np.asarray, gpt.packed_layout(jnp.asarray(ids), max_documents))
    assert got_lengths.shape == (4, max_documents) and got_offsets.shape == (4, max_documents + 1)
    for row, sizes in enumerate(lengths):
        n = len(sizes)
        np.testing.assert_array_equal(got_lengths[row, :n], sizes)
        np.testing.assert_array_equal(got_offsets[row, :n], np.cumsum(sizes) - sizes)
        assert (got_lengths[row, n:] == -1).all() and (got_offsets[row, n:] == -1).all()


def test_rope_with_positions_0_to_t_is_tk_jax_nn_rotary(gpt, rng):
    from tk_jax.nn.rotary import apply_rotary

    x = jnp.asarray(rng.standard_normal((2, 13, 3, 8)), jnp.float32)
    positions = jnp.broadcast_to(jnp.arange(13), (2, 13))
    np.testing.assert_allclose(gpt.rope(x, positions), apply_rotary(x), rtol=1e-6, atol=1e-6)
    # A rotation: norms kept, and q.k depends on positions only through their difference.
    q, k = x[:, :1], x[:, 1:2]
    dot = lambda a, b: jnp.sum(gpt.rope(q, jnp.full((2, 1), a)) * gpt.rope(k, jnp.full((2, 1), b)))
    np.testing.assert_allclose(dot(5, 2), dot(13, 10), rtol=1e-5, atol=1e-5)  # a sum near 0


def test_config_rejects_bad_choices(gpt):
    with pytest.raises(ValueError, match="attention='flash' is not one of"):
        gpt.GPTConfig(attention="flash")
    with pytest.raises(ValueError, match="num_heads=6 must be a multiple of num_kv_heads=4"):
        gpt.GPTConfig(num_heads=6, num_kv_heads=4)
    x = jnp.zeros((1, 8, 2, 16), jnp.bfloat16)
    with pytest.raises(ValueError, match="needs GPTConfig.max_documents"):
        gpt.causal_attention(x, x, x, jnp.zeros((1, 8), jnp.int32),
                             tiny_config(gpt, attention="cudnn"))


def test_cudnn_packed_call_passes_jax_checks(gpt, monkeypatch):
    """The packed-layout call as jax's cuDNN wrapper receives it (its cuDNN call stubbed out,
    so this runs on CPU): lengths [B, M], offsets [B, M + 1], causal within documents, GQA."""
    cudnn = pytest.importorskip("jax._src.cudnn.fused_attention_stablehlo")
    seen = {}

    def fused_attention_stub(query, key, value, bias, q_seqlen, kv_seqlen, q_offsets, kv_offsets,
                             *args, **kwargs):
        seen.update(lengths=q_seqlen, offsets=q_offsets, args=args)
        return jnp.zeros_like(query)

    monkeypatch.setattr(cudnn, "check_cudnn_version", lambda: 90800)
    monkeypatch.setattr(cudnn, "_dot_product_attention", fused_attention_stub)
    q = jnp.zeros((2, 48, 8, 64), jnp.bfloat16)
    k = jnp.zeros((2, 48, 2, 64), jnp.bfloat16)
    ids = jnp.asarray(np.repeat([[0, 1, 2], [0, 0, 1]], 16, axis=1), jnp.int32)
    assert gpt.cudnn_packed_attention(q, k, k, ids, 4).shape == q.shape
    np.testing.assert_array_equal(seen["lengths"], [[16, 16, 16, -1], [32, 16, -1, -1]])
    np.testing.assert_array_equal(seen["offsets"], [[0, 16, 32, -1, -1], [0, 32, -1, -1, -1]])
    assert cudnn.MaskType.PADDING_CAUSAL in seen["args"]


# ------------------------------------------------------------------------------ the data

def test_packed_documents_are_whole_copy_task_documents(train_gpt, rng):
    data = train_gpt.PackedDocuments(rng, vocab_size=50, seq_len=200, mean_doc_len=30,
                                     min_doc_len=6)
    tokens, segment_ids = data.batch(5)
    assert tokens.shape == segment_ids.shape == (5, 200) and tokens.dtype == np.int32
    for row_tokens, row_ids in zip(tokens, segment_ids):
        assert row_ids[0] == 0 and set(np.diff(row_ids)) <= {0, 1}       # 0, 1, 2, ... runs
        sizes = np.bincount(row_ids)
        assert sizes.min() >= 6 and len(sizes) <= data.max_documents
        for doc in np.split(row_tokens, np.cumsum(sizes)[:-1]):
            assert doc[0] == train_gpt.BOS and (doc[1:] != train_gpt.BOS).all()
            half = len(doc) // 2
            np.testing.assert_array_equal(doc[1 + half:], doc[1:len(doc) - half])  # the copy
            # The first half walks the chain: each token is a successor of the one before.
            for a, b in zip(doc[1:half], doc[2:half + 1]):
                assert b in data.chain.successors[a]

    targets, weights = map(np.asarray, train_gpt.next_token_targets(jnp.asarray(tokens),
                                                                    jnp.asarray(segment_ids)))
    same = np.zeros_like(weights, bool)
    same[:, :-1] = segment_ids[:, 1:] == segment_ids[:, :-1]
    np.testing.assert_array_equal(weights, same)
    np.testing.assert_array_equal(targets[:, :-1][same[:, :-1]], tokens[:, 1:][same[:, :-1]])


# ------------------------------------------------------------------------ the model

def _packed_batch(gpt, rng, config, batch=2, seq_len=40):
    ids, lengths = random_segment_ids(rng, batch, seq_len)
    tokens = rng.integers(0, config.vocab_size, (batch, seq_len)).astype(np.int32)
    return jnp.asarray(tokens), jnp.asarray(ids), lengths


@pytest.mark.parametrize("attention", ["xla", pytest.param("tk", marks=needs_tk_segments)])
def test_a_packed_document_gets_its_logits_alone(gpt, rng, attention):
    """Packing changes nothing: attention stays within a document and RoPE restarts there."""
    from flax import nnx

    config = tiny_config(gpt, attention=attention)
    model = gpt.GPT(config, rngs=nnx.Rngs(int(rng.integers(1000))))
    forward = nnx.jit(lambda model, *args: model(*args))
    tokens, ids, lengths = _packed_batch(gpt, rng, config)
    packed = np.asarray(forward(model, tokens, ids))
    # Each document alone: at the start of its own row (no segment ids), the rest of the row
    # random tokens, which causal attention keeps from reaching it.
    starts = [(row, start, n) for row, sizes in enumerate(lengths)
              for start, n in zip(np.cumsum(sizes) - sizes, sizes)]
    alone = rng.integers(0, config.vocab_size, (len(starts), tokens.shape[1])).astype(np.int32)
    for i, (row, start, n) in enumerate(starts):
        alone[i, :n] = tokens[row, start:start + n]
    alone_logits = np.asarray(forward(model, jnp.asarray(alone)))
    for i, (row, start, n) in enumerate(starts):
        np.testing.assert_allclose(packed[row, start:start + n], alone_logits[i, :n],
                                   rtol=2e-4, atol=2e-4)


@needs_tk_segments
@pytest.mark.parametrize("dtype, tol", [(jnp.float32, 1e-4), (jnp.bfloat16, 8e-2)])
def test_tk_and_xla_give_the_same_logits_on_a_packed_batch(gpt, rng, dtype, tol):
    """Position by position (relative L2 over the vocabulary): in bf16 the two attentions'
    roundings move a position's logits by up to ~3% (41 seeds) and single logits by up to 0.07,
    so an element-wise bound is either loose or flaky; float32 agrees to better than 5e-5."""
    from flax import nnx

    seed = int(rng.integers(1000))
    tk_model = gpt.GPT(tiny_config(gpt, attention="tk", dtype=dtype), rngs=nnx.Rngs(seed))
    xla_model = gpt.GPT(tiny_config(gpt, attention="xla", dtype=dtype), rngs=nnx.Rngs(seed))
    tokens, ids, _ = _packed_batch(gpt, rng, tk_model.config, batch=3, seq_len=45)
    forward = nnx.jit(lambda model, *args: model(*args))
    tk_logits = np.asarray(forward(tk_model, tokens, ids))
    xla_logits = np.asarray(forward(xla_model, tokens, ids))
    assert np.isfinite(tk_logits).all()
    tk_logits, xla_logits = tk_logits.astype(np.float64), xla_logits.astype(np.float64)
    err = np.linalg.norm(tk_logits - xla_logits, axis=-1) / np.linalg.norm(xla_logits, axis=-1)
    assert err.max() < tol, f"position {np.unravel_index(err.argmax(), err.shape)}: {err.max():.3g}"


# --------------------------------------------------------------------------- training

def test_tiny_training_reduces_the_loss_the_same_with_tk_and_xla(train_gpt, capsys):
    losses = {}
    for attention in ("xla", "tk") if TK_HAS_SEGMENTS else ("xla",):
        result = train_gpt.main(["--tiny", "--attention", attention, "--steps", "40",
                                 "--log-every", "5", "--seed", "3"])
        losses[attention] = np.asarray(result["losses"])
        assert len(losses[attention]) == 40 and np.isfinite(losses[attention]).all()
        last = capsys.readouterr().out.strip().splitlines()[-1]
        assert last.startswith(f"final: attention {attention}, ") and " tokens/s " in last
        assert f"last loss {losses[attention][-1]:.4f}" in last and result["tokens_per_s"] > 0
    xla = losses["xla"]
    # Starts near log(64) = 4.16; learning the chain's transitions takes it well below.
    assert xla[:3].mean() > 3.5 and xla[-5:].mean() < xla[:3].mean() - 1.0, xla
    if "tk" in losses:  # same data and weights, float32: the same curve
        np.testing.assert_allclose(losses["tk"], xla, rtol=2e-3, atol=2e-3)


def test_cli_flags_override_tiny(train_gpt):
    cfg = train_gpt.parse_args(["--tiny", "--seq-len", "64", "--kv-heads", "1", "--attention",
                                "cudnn", "--mean-doc-len", "20"])
    assert (cfg.seq_len, cfg.kv_heads, cfg.attention, cfg.mean_doc_len) == (64, 1, "cudnn", 20.0)
    assert cfg.d_model == train_gpt.TINY["d_model"]
    assert train_gpt.parse_args([]).seq_len == 4096


# -------------------------------------------------------------------------------- GPU

@pytest.mark.gpu
@pytest.mark.parametrize("attention", ["tk", "cudnn", "cudnn-mask"])
def test_gpu_attention_matches_xla_on_a_packed_batch(gpt, train_gpt, hopper, rng, attention):
    """Every attention choice on the device, bf16, against XLA's: forward and gradients."""
    from flax import nnx

    data = train_gpt.PackedDocuments(rng, vocab_size=256, seq_len=1024, mean_doc_len=200,
                                     min_doc_len=16)
    tokens, ids = map(jnp.asarray, data.batch(2))
    seed = int(rng.integers(1000))
    options = dict(vocab_size=256, d_model=256, num_layers=2, num_heads=8, num_kv_heads=2,
                   head_dim=64, dtype=jnp.bfloat16, max_documents=data.max_documents)
    models = {name: gpt.GPT(gpt.GPTConfig(attention=name, **options), rngs=nnx.Rngs(seed))
              for name in (attention, "xla")}

    def loss_and_grads(model):
        graphdef, params = nnx.split(model, nnx.Param)
        loss = lambda p: jnp.mean(nnx.merge(graphdef, p)(tokens, ids) ** 2)
        return jax.jit(jax.value_and_grad(loss))(params)

    (loss, grads), (ref_loss, ref_grads) = map(loss_and_grads, models.values())
    np.testing.assert_allclose(loss, ref_loss, rtol=2e-2)
    for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
        g, r = np.asarray(g, np.float32), np.asarray(r, np.float32)
        assert np.isfinite(g).all()
        assert np.linalg.norm(g - r) <= 5e-2 * np.linalg.norm(r) + 1e-6
