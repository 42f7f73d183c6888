"""Train a small Llama-style GPT (examples/gpt.py) on packed documents with segment ids.

Each training row of seq_len tokens is filled with whole documents of random lengths; segment
ids [B, T] tell them apart, so that a token attends only within its own document and its RoPE
position restarts there. The documents come from a synthetic language the model can learn:

    BOS x_1 ... x_h x_1 ... x_h'      x: a random Markov chain (each token has a few likely
                                      successors), then a copy of x (an induction task).

The loss starts near log(vocab), falls quickly to about the chain's entropy as the model learns
the transitions, and further once it learns to copy (the second half of each document is fully
predictable, but only by looking back within the document).

    python examples/train_gpt.py --tiny --attention xla   # CPU, a few seconds
    python examples/train_gpt.py --attention tk           # H100: d_model 1024, 8 layers, T 4096
    python examples/train_gpt.py --attention cudnn        # the same run on cuDNN

The last line gives the mean tokens/s after the warm-up steps and the last loss, so two runs
can be compared from their output.
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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from config_flags import add_field_flags, add_tiny_flag, config_from_args  # noqa: E402
from gpt import ATTENTIONS, GPT, GPTConfig  # noqa: E402

BOS = 0


# ------------------------------------------------------------------------------------ data

@dataclasses.dataclass(frozen=True)
class MarkovChain:
    """Token t is followed by successors[t, i] with probability p[t, i] (cdf = cumsum of p)."""
    successors: np.ndarray   # [vocab, branching] int, in [1, vocab)
    cdf: np.ndarray          # [vocab, branching] float

    @classmethod
    def random(cls, rng: np.random.Generator, vocab_size: int, branching: int = 4):
        successors = rng.integers(1, vocab_size, size=(vocab_size, branching))
        probs = rng.dirichlet(np.ones(branching), size=vocab_size)
        return cls(successors, np.cumsum(probs, axis=1))

    def sample(self, rng: np.random.Generator, num: int, length: int) -> np.ndarray:
        """[num, length] int32: num independent walks from uniformly random starts."""
        out = np.empty((num, length), np.int32)
        current = rng.integers(1, len(self.successors), size=num)
        last = self.successors.shape[1] - 1
        for t in range(length):
            out[:, t] = current
            choice = np.minimum((rng.random(num)[:, None] > self.cdf[current]).sum(1), last)
            current = self.successors[current, choice]
        return out


class PackedDocuments:
    """Batches of rows packed with copy-task documents (see the module docstring).

    Document lengths: min_doc_len + an exponential of mean (mean_doc_len - min_doc_len); the
    last document of a row is cut to fit, or stretched over a remainder shorter than
    min_doc_len, so every document has >= min_doc_len tokens and a row at most
    seq_len // min_doc_len of them (`max_documents`, what cuDNN's packed layout needs).
    """

    def __init__(self, rng: np.random.Generator, *, vocab_size: int, seq_len: int,
                 mean_doc_len: float, min_doc_len: int, branching: int = 4,
                 pool_walks: int = 256):
        if not 2 <= min_doc_len <= seq_len or mean_doc_len < min_doc_len:
            raise ValueError(f"PackedDocuments: need 2 <= min_doc_len <= seq_len and "
                             f"mean_doc_len >= min_doc_len; got min_doc_len={min_doc_len}, "
                             f"mean_doc_len={mean_doc_len}, seq_len={seq_len}")
        self.rng, self.seq_len = rng, seq_len
        self.mean_doc_len, self.min_doc_len = mean_doc_len, min_doc_len
        self.chain = MarkovChain.random(rng, vocab_size, branching)
        # Documents copy their text from this pool of walks (drawn once: drawing per batch
        # would be a Python loop over positions for every step).
        self.pool = self.chain.sample(rng, pool_walks, seq_len)

    @property
    def max_documents(self) -> int:
        return self.seq_len // self.min_doc_len

    def document_lengths(self) -> list[int]:
        lengths, left = [], self.seq_len
        while left:
            length = self.min_doc_len + int(self.rng.exponential(self.mean_doc_len
                                                                 - self.min_doc_len))
            if length >= left or left - length < self.min_doc_len:
                length = left
            lengths.append(length)
            left -= length
        return lengths

    def document(self, length: int) -> np.ndarray:
        """BOS, h tokens of a walk, then their first length - 1 - h again (h = half the rest)."""
        half = length // 2                   # = ceil((length - 1) / 2)
        walk, start = self.rng.integers(len(self.pool)), self.rng.integers(self.seq_len - half + 1)
        text = self.pool[walk, start:start + half]
        return np.concatenate([[BOS], text, text[:length - 1 - half]]).astype(np.int32)

    def batch(self, batch_size: int) -> tuple[np.ndarray, np.ndarray]:
        """(tokens [B, T] int32, segment_ids [B, T] int32: 0, 1, 2, ... per document)."""
        tokens = np.empty((batch_size, self.seq_len), np.int32)
        segment_ids = np.empty((batch_size, self.seq_len), np.int32)
        for row in range(batch_size):
            lengths = self.document_lengths()
            tokens[row] = np.concatenate([self.document(n) for n in lengths])
            segment_ids[row] = np.repeat(np.arange(len(lengths), dtype=np.int32), lengths)
        return tokens, segment_ids


def next_token_targets(tokens: jax.Array, segment_ids: jax.Array):
    """(targets [B, T], weights [B, T]): predict the next token of the same document; the last
    token of each document (whose successor starts another one) has weight 0."""
    targets = jnp.concatenate([tokens[:, 1:], jnp.zeros_like(tokens[:, :1])], axis=1)
    same = jnp.concatenate([segment_ids[:, 1:] == segment_ids[:, :-1],
                            jnp.zeros_like(segment_ids[:, :1], dtype=bool)], axis=1)
    return targets, same.astype(jnp.float32)


# --------------------------------------------------------------------------------- training

@dataclasses.dataclass
class TrainConfig:
    attention: str = "tk"
    vocab_size: int = 1024
    d_model: int = 1024
    layers: int = 8
    heads: int = 16
    kv_heads: int = 4
    head_dim: int = 64
    mlp_dim: int | None = None            # None: 8/3 d_model rounded up to a multiple of 64
    seq_len: int = 4096
    batch_size: int = 8
    mean_doc_len: float = 1024.0
    min_doc_len: int = 64
    steps: int = 300
    lr: float = 1e-3
    warmup_steps: int = 50
    weight_decay: float = 0.1
    dtype: str = "bfloat16"
    backend: str = "auto"                 # tk_jax backend for attention "tk"
    seed: int = 0
    log_every: int = 10                   # progress-bar updates (each waits for the device)
    timing_warmup: int = 20               # steps left out of the mean tokens/s (compilation)


TINY = dict(vocab_size=64, d_model=64, layers=2, heads=4, kv_heads=2, head_dim=16, seq_len=128,
            batch_size=4, mean_doc_len=32.0, min_doc_len=8, steps=60, lr=1e-2, warmup_steps=10,
            weight_decay=0.0, dtype="float32", log_every=10, timing_warmup=5)


def model_config(cfg: TrainConfig, max_documents: int | None = None) -> GPTConfig:
    return GPTConfig(vocab_size=cfg.vocab_size, d_model=cfg.d_model, num_layers=cfg.layers,
                     num_heads=cfg.heads, num_kv_heads=cfg.kv_heads, head_dim=cfg.head_dim,
                     mlp_hidden_dim=cfg.mlp_dim, dtype=jnp.dtype(cfg.dtype),
                     attention=cfg.attention, backend=cfg.backend, max_documents=max_documents)


def make_optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=cfg.lr, warmup_steps=min(cfg.warmup_steps, cfg.steps),
        decay_steps=max(cfg.steps, cfg.warmup_steps + 1), end_value=cfg.lr * 0.1)
    decay_mask = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)  # not norm scales
    return optax.chain(optax.clip_by_global_norm(1.0),
                       optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=cfg.weight_decay,
                                   mask=decay_mask))


def make_train_step(model: GPT, optimizer: optax.GradientTransformation):
    """A jitted (params, opt_state, tokens, segment_ids) -> (params, opt_state, loss)."""
    graphdef, _ = nnx.split(model, nnx.Param)

    def loss_fn(params, tokens, segment_ids):
        logits = nnx.merge(graphdef, params)(tokens, segment_ids)
        targets, weights = next_token_targets(tokens, segment_ids)
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
        return (losses * weights).sum() / jnp.maximum(weights.sum(), 1.0)

    @functools.partial(jax.jit, donate_argnums=(0, 1))   # updated in place
    def train_step(params, opt_state, tokens, segment_ids):
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens, segment_ids)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return train_step


class PlainProgress:
    """What the loop needs of a tqdm bar, as plain printed lines (when tqdm is missing)."""

    def __init__(self, total: int, desc: str):
        self.total, self.desc, self.n, self.postfix = total, desc, 0, ""

    def update(self, n: int) -> None:
        self.n += n
        print(f"{self.desc}: step {self.n}/{self.total} {self.postfix}", flush=True)

    def set_postfix_str(self, text: str) -> None:
        self.postfix = text

    def write(self, text: str) -> None:
        print(text, flush=True)

    def close(self) -> None:
        pass


def progress_bar(total: int, desc: str, enabled: bool):
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return PlainProgress(total, desc)
    return tqdm(total=total, desc=desc, dynamic_ncols=True)


def train(cfg: TrainConfig, *, progress: bool = True) -> dict:
    """Train on fresh packed batches. Returns {"losses": [steps] floats, "tokens_per_s": mean
    after cfg.timing_warmup steps (None if no step is left), "params": the final nnx.State}."""
    rng = np.random.default_rng(cfg.seed)
    data = PackedDocuments(rng, vocab_size=cfg.vocab_size, seq_len=cfg.seq_len,
                           mean_doc_len=cfg.mean_doc_len, min_doc_len=cfg.min_doc_len)
    model = GPT(model_config(cfg, data.max_documents), rngs=nnx.Rngs(cfg.seed))
    optimizer = make_optimizer(cfg)
    params = nnx.state(model, nnx.Param)
    opt_state = optimizer.init(params)
    train_step = make_train_step(model, optimizer)

    tokens_per_step = cfg.batch_size * cfg.seq_len
    losses = []                                   # device scalars: reading one waits for it
    bar = progress_bar(cfg.steps, f"train {cfg.attention}", progress)
    timed_from = None                             # (step, time) once the warm-up is over
    window_start, window_step = time.perf_counter(), 0
    curve_every = cfg.log_every * max(cfg.steps // (10 * cfg.log_every), 1)  # ~10 lines
    for step in range(1, cfg.steps + 1):
        tokens, segment_ids = data.batch(cfg.batch_size)
        params, opt_state, loss = train_step(params, opt_state, tokens, segment_ids)
        losses.append(loss)
        at_warmup_end = step == cfg.timing_warmup
        if step % cfg.log_every and step != cfg.steps and not at_warmup_end:
            continue
        last = float(loss)                        # waits for this step
        now = time.perf_counter()
        if at_warmup_end:
            timed_from = (step, now)
        if bar is not None:
            rate = (step - window_step) * tokens_per_step / (now - window_start)
            bar.set_postfix_str(f"loss {last:.4f}, {rate:,.0f} tokens/s")
            bar.update(step - bar.n)
            if step % curve_every == 0:
                bar.write(f"step {step}: loss {last:.4f}")
        window_start, window_step = now, step
    if bar is not None:
        bar.close()

    tokens_per_s = None
    if timed_from is not None and cfg.steps > timed_from[0]:
        steps_timed = cfg.steps - timed_from[0]
        tokens_per_s = steps_timed * tokens_per_step / (window_start - timed_from[1])
    return {"losses": [float(x) for x in losses], "tokens_per_s": tokens_per_s,
            "params": params}


# ------------------------------------------------------------------------------------- CLI

def parse_args(argv=None) -> TrainConfig:
    defaults = TrainConfig()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_field_flags(p, defaults, {
        "attention": (ATTENTIONS, "attention implementation"),
        "vocab_size": (int, "vocabulary"), "d_model": (int, "model width"),
        "layers": (int, "decoder blocks"), "heads": (int, "query heads"),
        "kv_heads": (int, "key/value heads (GQA)"), "head_dim": (int, "head dim"),
        "mlp_dim": (int, "SwiGLU hidden width (8/3 d_model)"),
        "seq_len": (int, "tokens per row"), "batch_size": (int, "rows per step"),
        "mean_doc_len": (float, "mean document length"),
        "min_doc_len": (int, "shortest document"), "steps": (int, "training steps"),
        "lr": (float, "peak learning rate"), "warmup_steps": (int, "learning-rate warm-up"),
        "weight_decay": (float, "AdamW weight decay"), "seed": (int, "random seed"),
        "log_every": (int, "steps between progress updates"),
        "timing_warmup": (int, "steps left out of the mean tokens/s"),
        "dtype": (("bfloat16", "float32"), "compute dtype; parameters stay float32"),
        "backend": (("auto", "kernel", "reference"), "tk_jax backend for --attention tk"),
    })
    add_tiny_flag(p, "a CPU run of a few seconds: ", TINY)
    return config_from_args(defaults, p.parse_args(argv), TINY)


def main(argv=None) -> dict:
    cfg = parse_args(argv)
    device = jax.devices()[0]
    print(f"GPT d_model {cfg.d_model}, {cfg.layers} layers, {cfg.heads}/{cfg.kv_heads} heads of "
          f"{cfg.head_dim}, {cfg.dtype}; {cfg.batch_size} x {cfg.seq_len} tokens per step, "
          f"documents of mean {cfg.mean_doc_len:g} (>= {cfg.min_doc_len}); attention "
          f"{cfg.attention}; {device.platform} {device.device_kind}", flush=True)
    result = train(cfg)
    losses = result["losses"]
    tail = losses[-min(10, len(losses)):]
    rate = result["tokens_per_s"]
    rate_text = (f"{rate:,.0f} tokens/s (mean over steps {cfg.timing_warmup + 1}-{cfg.steps})"
                 if rate is not None else "tokens/s n/a (no step after the warm-up)")
    print(f"final: attention {cfg.attention}, {rate_text}, last loss {losses[-1]:.4f} "
          f"(mean of last {len(tail)}: {np.mean(tail):.4f}, first {losses[0]:.4f})", flush=True)
    return result


if __name__ == "__main__":
    main()
