"""examples/train_based_mqar.py: the MQAR data is well formed, a short tiny run learns, and the
data-parallel run (8 host devices, see conftest.py) takes the same steps as one device."""
import dataclasses
import importlib.util
import pathlib
import sys

import numpy as np
import pytest

EXAMPLE = pathlib.Path(__file__).resolve().parents[1] / "examples" / "train_based_mqar.py"


@pytest.fixture(scope="module")
def mqar():
    spec = importlib.util.spec_from_file_location("train_based_mqar", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while being defined
    spec.loader.exec_module(module)
    return module


def test_mqar_batch_queries_recall_the_paired_value(mqar):
    rng = np.random.default_rng()
    num_pairs, vocab = 5, 40
    tokens, targets, is_query = mqar.make_mqar_batch(rng, batch_size=8, seq_len=48,
                                                     num_kv_pairs=num_pairs, vocab_size=vocab)
    assert tokens.shape == targets.shape == is_query.shape == (8, 48)
    for row_tokens, row_targets, row_query in zip(tokens, targets, is_query):
        keys, values = row_tokens[0:2 * num_pairs:2], row_tokens[1:2 * num_pairs:2]
        assert len(set(keys)) == num_pairs and all(1 <= k < vocab // 2 for k in keys)
        assert all(vocab // 2 <= v < vocab for v in values)
        positions = np.flatnonzero(row_query)
        assert len(positions) == num_pairs and positions.min() >= 2 * num_pairs
        answer = dict(zip(keys, values))
        # Every key is queried exactly once, and the target is the value paired with it.
        assert sorted(row_tokens[positions]) == sorted(keys)
        for t in positions:
            assert row_targets[t] == answer[row_tokens[t]]


def test_tiny_training_reduces_loss(mqar):
    cfg, _ = mqar.parse_args(["--tiny"])
    cfg = dataclasses.replace(cfg, steps=40, warmup_steps=5, eval_every=40, eval_examples=64)
    history = mqar.train(cfg, progress=False)
    losses = np.asarray(history["losses"])
    assert history["steps"] == 40 and np.isfinite(losses).all()
    # Starts near log(vocab) (uniform guess); even this short run moves a good way below it.
    assert losses[:5].mean() > losses[-5:].mean() + 0.3, losses


def test_data_parallel_matches_one_device(mqar, rng):
    import jax

    devices = jax.local_devices()
    assert len(devices) == 8, "conftest.py should give 8 host devices"
    cfg, _ = mqar.parse_args(["--tiny", "--data-parallel"])
    assert cfg.data_parallel and cfg.batch_size % len(devices) == 0
    cfg = dataclasses.replace(cfg, steps=12, warmup_steps=3, eval_every=12, eval_examples=64,
                              seed=int(rng.integers(2**31)))
    with pytest.raises(ValueError, match="batch_size=12 is not divisible by the 8"):
        mqar.train(dataclasses.replace(cfg, batch_size=12), progress=False)

    parallel = mqar.train(cfg, progress=False)
    single = mqar.train(dataclasses.replace(cfg, data_parallel=False), progress=False)

    losses = np.asarray(parallel["losses"])
    assert np.isfinite(losses).all() and losses[:3].mean() > losses[-3:].mean() + 0.1, losses
    # Same data and seed: the same global-batch loss, so the same updates up to the order of
    # float32 sums (the gradient all-reduce adds per-device partial sums).
    np.testing.assert_allclose(losses, single["losses"], rtol=1e-5, atol=1e-5)
    parallel_leaves = jax.tree.leaves(parallel["params"])
    single_leaves = jax.tree.leaves(single["params"])
    assert len(parallel_leaves) == len(single_leaves) > 0
    for p, s in zip(parallel_leaves, single_leaves):
        assert p.sharding.device_set == set(devices) and p.sharding.is_fully_replicated
        np.testing.assert_allclose(np.asarray(p), np.asarray(s), rtol=1e-4, atol=1e-5)


def test_cli_flags_override_tiny(mqar):
    cfg, args = mqar.parse_args(["--tiny", "--seq-len", "48", "--lr", "0.01", "--backend",
                                 "reference", "--target-acc", "0.9"])
    assert (cfg.seq_len, cfg.lr, cfg.backend, cfg.target_acc) == (48, 0.01, "reference", 0.9)
    assert cfg.d_model == mqar.TINY["d_model"] and not args.time_backends
    assert not cfg.data_parallel
