"""Train a small Based model on multi-query associative recall (MQAR).

MQAR (Arora et al., "Zoology", 2023) tests whether a sequence mixer can recall: a sequence
starts with key-value token pairs  k1 v1 k2 v2 ...  and later shows each key again; at that
query position the model must predict the value that followed the key earlier. Only query
positions are scored. Attention solves it exactly; fixed-state recurrent models must fit all
pairs in their state, which is what Based's 273-feature Taylor state is built for.

    python examples/train_based_mqar.py --tiny            # CPU, well under 2 minutes
    python examples/train_based_mqar.py                   # seq 256, 16 pairs, d_model 128 (GPU)
    python examples/train_based_mqar.py --time-backends   # kernel vs reference step time
    python examples/train_based_mqar.py --data-parallel   # batch split over all local devices
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
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from tqdm import tqdm

from tk_jax.nn import BasedConfig, BasedLM

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from config_flags import add_field_flags, add_tiny_flag, config_from_args  # noqa: E402


# --------------------------------------------------------------------------------- data

def make_mqar_batch(rng: np.random.Generator, *, batch_size: int, seq_len: int,
                    num_kv_pairs: int, vocab_size: int, power_a: float = 0.01):
    """One MQAR batch: (tokens [B, T] int32, targets [B, T] int32, is_query [B, T] bool).

    Keys come from [1, vocab/2), values from [vocab/2, vocab); each example draws distinct keys.
    Layout: 2 * num_kv_pairs tokens of pairs, then every key queried once at an even offset
    of the remainder, offsets drawn without replacement with probability ~ offset^(power_a - 1)
    (most queries close to the pairs, as in Zoology). Other positions hold random tokens.
    targets[t] is the value to predict at query position t (0 elsewhere, masked by is_query).
    """
    context = 2 * num_kv_pairs
    slots = (seq_len - context) // 2          # candidate query offsets 0, 2, 4, ... after context
    key_range = vocab_size // 2
    if num_kv_pairs >= key_range or slots < num_kv_pairs:
        raise ValueError(f"MQAR: {num_kv_pairs} pairs need vocab_size > {2 * num_kv_pairs + 1} "
                         f"and seq_len >= {4 * num_kv_pairs}; got vocab_size={vocab_size}, "
                         f"seq_len={seq_len}")

    def distinct(low, high):
        # num_kv_pairs distinct tokens per row from [low, high).
        return np.stack([rng.choice(np.arange(low, high), num_kv_pairs, replace=False)
                         for _ in range(batch_size)])

    keys, values = distinct(1, key_range), distinct(key_range, vocab_size)

    # Weighted sampling without replacement (Gumbel top-k): the num_kv_pairs largest
    # log(p) + Gumbel noise pick offsets with the power-law preference above.
    log_p = (power_a - 1.0) * np.log(np.arange(1, slots + 1))
    scores = log_p + rng.gumbel(size=(batch_size, slots))
    offsets = np.argsort(-scores, axis=1)[:, :num_kv_pairs]
    query_pos = context + 2 * offsets

    tokens = rng.integers(0, vocab_size, size=(batch_size, seq_len))
    tokens[:, 0:context:2] = keys
    tokens[:, 1:context:2] = values
    rows = np.arange(batch_size)[:, None]
    tokens[rows, query_pos] = keys
    targets = np.zeros((batch_size, seq_len), np.int64)
    targets[rows, query_pos] = values
    is_query = np.zeros((batch_size, seq_len), bool)
    is_query[rows, query_pos] = True
    return tokens.astype(np.int32), targets.astype(np.int32), is_query


# --------------------------------------------------------------------------- data parallel
# One mesh axis "data" over all local devices: each batch is split along its examples, the
# parameters and optimizer state are replicated, and jit inserts the gradient all-reduce.

def data_parallel_mesh(batch_size: int) -> Mesh:
    """A 1-D mesh, axis "data", over jax.local_devices(); the batch must split evenly."""
    devices = jax.local_devices()
    if batch_size % len(devices):
        raise ValueError(f"--data-parallel: batch_size={batch_size} is not divisible by the "
                         f"{len(devices)} local devices; use a multiple of {len(devices)}")
    return Mesh(np.array(devices), ("data",))


def replicated(mesh: Mesh) -> NamedSharding:
    """A full copy on every device of the mesh."""
    return NamedSharding(mesh, PartitionSpec())


def split_batch(mesh: Mesh) -> NamedSharding:
    """Axis 0 (examples) split over the mesh's "data" axis."""
    return NamedSharding(mesh, PartitionSpec("data"))


# --------------------------------------------------------------------------------- training

@dataclasses.dataclass
class TrainConfig:
    seq_len: int = 256
    num_kv_pairs: int = 16
    vocab_size: int = 8192
    d_model: int = 128
    # Head dim of the Based and sliding-window layers (d_model / head_dim heads each); the
    # kernels take 64 or 128.
    head_dim: int = 64
    layers: int = 2
    steps: int = 10000
    batch_size: int = 64
    lr: float = 2e-3
    warmup_steps: int = 200
    weight_decay: float = 0.1
    eval_every: int = 200
    eval_examples: int = 1024
    target_acc: float | None = 0.99    # stop early once reached (None: run all steps)
    backend: str = "auto"
    seed: int = 0
    dtype: str = "float32"
    # "rmsnorm" learns MQAR several times faster than the normaliser here (CPU runs).
    based_norm: str = "rmsnorm"
    # Split each batch over all local devices (parameters and optimizer state replicated).
    data_parallel: bool = False


TINY = dict(seq_len=64, num_kv_pairs=4, vocab_size=128, d_model=64, layers=2, steps=500,
            batch_size=32, lr=5e-3, weight_decay=0.0, warmup_steps=50, eval_every=100,
            eval_examples=256)


def build_model(cfg: TrainConfig, backend: str) -> BasedLM:
    model_cfg = BasedConfig(
        vocab_size=cfg.vocab_size, d_model=cfg.d_model, num_layers=cfg.layers,
        based_heads=cfg.d_model // cfg.head_dim, based_output_norm=cfg.based_norm,
        swa_heads=cfg.d_model // cfg.head_dim, swa_window=32,
        mlp_hidden_dim=2 * cfg.d_model,
        dtype=jnp.dtype(cfg.dtype), backend=backend)
    return BasedLM(model_cfg, rngs=nnx.Rngs(cfg.seed))


def query_loss_and_accuracy(logits, targets, is_query):
    """Mean cross-entropy and accuracy over query positions only."""
    weights = is_query.astype(jnp.float32)
    count = jnp.maximum(weights.sum(), 1.0)
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    correct = (logits.argmax(-1) == targets).astype(jnp.float32)
    return (losses * weights).sum() / count, (correct * weights).sum() / count


def make_train_step(model: BasedLM, optimizer: optax.GradientTransformation,
                    mesh: Mesh | None = None):
    """A jitted pure function (params, opt_state, batch) -> (params, opt_state, loss, acc).

    With a mesh, the batch arrays are split along axis 0 over its "data" axis and everything
    else is replicated; the loss is still the mean over the whole global batch, so XLA
    all-reduces the gradients and every device applies the same update.
    """
    graphdef, _ = nnx.split(model, nnx.Param)

    def loss_fn(params, tokens, targets, is_query):
        logits = nnx.merge(graphdef, params)(tokens)
        return query_loss_and_accuracy(logits, targets, is_query)

    jit_train = jax.jit
    if mesh is not None:
        # One sharding per argument/result also covers a whole tree (params, opt_state).
        copy, split = replicated(mesh), split_batch(mesh)
        jit_train = functools.partial(jax.jit, in_shardings=(copy, copy, split, split, split),
                                      out_shardings=(copy, copy, copy, copy))

    @jit_train
    def train_step(params, opt_state, tokens, targets, is_query):
        (loss, acc), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            params, tokens, targets, is_query)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, acc

    @jax.jit  # follows the shardings its inputs already have
    def eval_step(params, tokens, targets, is_query):
        return loss_fn(params, tokens, targets, is_query)

    return train_step, eval_step


def make_optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=cfg.lr, warmup_steps=min(cfg.warmup_steps, cfg.steps),
        decay_steps=max(cfg.steps, cfg.warmup_steps + 1), end_value=cfg.lr * 0.1)
    # No weight decay on vectors (norm scales, conv bias).
    decay_mask = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)
    return optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.adamw(schedule, b1=0.9, b2=0.98, weight_decay=cfg.weight_decay, mask=decay_mask))


def train(cfg: TrainConfig, *, progress: bool = True) -> dict:
    """Train on fresh MQAR batches; returns {"losses", "accs", "eval_accs", "steps", "params"}
    ("params": the final parameters, an nnx.State)."""
    mesh = data_parallel_mesh(cfg.batch_size) if cfg.data_parallel else None
    if mesh is not None and progress:
        print(f"data parallel over {mesh.size} {jax.local_devices()[0].platform} device(s): "
              f"global batch {cfg.batch_size}, {cfg.batch_size // mesh.size} per device")
    rng = np.random.default_rng(cfg.seed)
    data = dict(seq_len=cfg.seq_len, num_kv_pairs=cfg.num_kv_pairs, vocab_size=cfg.vocab_size)
    eval_batch = make_mqar_batch(np.random.default_rng(cfg.seed + 1),
                                 batch_size=cfg.eval_examples, **data)

    model = build_model(cfg, cfg.backend)
    optimizer = make_optimizer(cfg)
    params = nnx.state(model, nnx.Param)
    opt_state = optimizer.init(params)
    if mesh is not None:
        params, opt_state = jax.device_put((params, opt_state), replicated(mesh))
        # The eval batch is split too when it divides evenly, else copied to every device.
        divides = cfg.eval_examples % mesh.size == 0
        eval_batch = jax.device_put(eval_batch, split_batch(mesh) if divides else replicated(mesh))
    train_step, eval_step = make_train_step(model, optimizer, mesh)

    history = {"losses": [], "accs": [], "eval_accs": [], "steps": 0}
    bar = tqdm(range(cfg.steps), disable=not progress, desc="MQAR", dynamic_ncols=True)
    for step in bar:
        # Host numpy batch; with a mesh, jit's in_shardings split it over the devices. The
        # float() below waits for every step, which also keeps XLA:CPU host devices from
        # queueing many multi-device programs (they can deadlock there; see bench/scale.py).
        batch = make_mqar_batch(rng, batch_size=cfg.batch_size, **data)
        params, opt_state, loss, acc = train_step(params, opt_state, *batch)
        history["losses"].append(float(loss))
        history["accs"].append(float(acc))
        history["steps"] = step + 1
        if (step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps:
            _, eval_acc = eval_step(params, *eval_batch)
            history["eval_accs"].append((step + 1, float(eval_acc)))
            bar.set_postfix(loss=f"{float(loss):.3f}", acc=f"{float(acc):.3f}",
                            eval_acc=f"{float(eval_acc):.3f}")
            if progress:
                bar.write(f"step {step + 1}: loss {float(loss):.4f}, eval query accuracy "
                          f"{float(eval_acc):.4f}")
            if cfg.target_acc is not None and eval_acc >= cfg.target_acc:
                bar.write(f"reached query accuracy {float(eval_acc):.4f} >= {cfg.target_acc} "
                          f"at step {step + 1}")
                break
        elif step % 10 == 0:
            bar.set_postfix(loss=f"{float(loss):.3f}", acc=f"{float(acc):.3f}")
    bar.close()
    history["params"] = params
    return history


def time_backends(cfg: TrainConfig, *, repeats: int = 20) -> None:
    """Median train-step time with the kernel and with the reference (same model and data)."""
    batch = make_mqar_batch(np.random.default_rng(cfg.seed), batch_size=cfg.batch_size,
                            seq_len=cfg.seq_len, num_kv_pairs=cfg.num_kv_pairs,
                            vocab_size=cfg.vocab_size)
    mesh = data_parallel_mesh(cfg.batch_size) if cfg.data_parallel else None
    print(f"train step, batch {cfg.batch_size}, seq {cfg.seq_len}, d_model {cfg.d_model}, "
          f"{cfg.layers} layers, {cfg.dtype}, device {jax.devices()[0].device_kind}"
          + (f", data parallel over {mesh.size} device(s)" if mesh is not None else ""))
    for backend in ("kernel", "reference"):
        model = build_model(cfg, backend)
        optimizer = make_optimizer(cfg)
        params = nnx.state(model, nnx.Param)
        opt_state = optimizer.init(params)
        if mesh is not None:
            params, opt_state = jax.device_put((params, opt_state), replicated(mesh))
        train_step, _ = make_train_step(model, optimizer, mesh)
        try:
            # The first call compiles; backend="kernel" raises a ValueError here when the
            # kernel cannot run on this machine or these shapes.
            params, opt_state, loss, _ = train_step(params, opt_state, *batch)
        except ValueError as err:
            print(f"  {backend:9s}: not available ({err})")
            continue
        first_loss = float(loss)  # same model, same batch: the backends must agree here
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            params, opt_state, loss, _ = train_step(params, opt_state, *batch)
            jax.block_until_ready((params, loss))
            times.append(time.perf_counter() - start)
        print(f"  {backend:9s}: {1e3 * float(np.median(times)):8.2f} ms/step "
              f"(median of {repeats}), first-step loss {first_loss:.5f}")


# --------------------------------------------------------------------------------- CLI

def parse_args(argv=None) -> tuple[TrainConfig, argparse.Namespace]:
    defaults = TrainConfig()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_field_flags(p, defaults, {
        "seq_len": (int, "sequence length"), "num_kv_pairs": (int, "key-value pairs"),
        "vocab_size": (int, "vocabulary"), "d_model": (int, "model width"),
        "head_dim": (int, "head dim of the Based and attention layers"),
        "layers": (int, "layers"), "steps": (int, "training steps"),
        "batch_size": (int, "batch size"), "lr": (float, "peak learning rate"),
        "backend": (("auto", "kernel", "reference"), "tk_jax backend"),
        "dtype": (("float32", "bfloat16"), "activation dtype"),
        "based_norm": (("rmsnorm", "denominator"), "Based output normalisation"),
        "seed": (int, "random seed"),
    })
    p.add_argument("--target-acc", type=float,
                   help=f"stop once eval query accuracy reaches this ({defaults.target_acc}; "
                        f"the tiny run ignores it unless given)")
    add_tiny_flag(p, "small CPU configuration: ", TINY)
    p.add_argument("--time-backends", action="store_true",
                   help="time the train step with backend kernel vs reference, then exit")
    p.add_argument("--data-parallel", action="store_true", default=None,
                   help="split each batch over all local devices (jax.local_devices()), "
                        "parameters replicated; the batch size must be divisible by the "
                        "device count")
    args = p.parse_args(argv)

    cfg = config_from_args(defaults, args, dict(TINY, target_acc=None))
    if cfg.d_model % cfg.head_dim:
        p.error(f"--d-model ({cfg.d_model}) must be a multiple of --head-dim ({cfg.head_dim})")
    return cfg, args


def main(argv=None) -> None:
    cfg, args = parse_args(argv)
    if args.time_backends:
        time_backends(cfg)
        return
    print(f"MQAR: seq {cfg.seq_len}, {cfg.num_kv_pairs} pairs, vocab {cfg.vocab_size}; "
          f"BasedLM d_model {cfg.d_model}, {cfg.layers} layers, backend {cfg.backend}; "
          f"chance accuracy {1 / (cfg.vocab_size - cfg.vocab_size // 2):.4f}")
    start = time.perf_counter()
    history = train(cfg)
    final_step, final_acc = history["eval_accs"][-1]
    print(f"step {final_step}: eval query accuracy {final_acc:.4f}, "
          f"last train loss {history['losses'][-1]:.4f} ({time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
