"""A small Llama-style decoder (Flax NNX) whose attention is chosen by name.

RoPE, grouped-query attention, SwiGLU, RMSNorm; parameters in float32, compute in `dtype`
(bfloat16 by default). Training rows may pack several documents, told apart by segment ids
[B, T]: a token attends only to earlier tokens of its own document, and its rotary position
counts from the start of that document.

Attention implementations (GPTConfig.attention):
  "tk":         tk_jax.flash_attention(causal=True, q_segment_ids=..., kv_segment_ids=...).
  "cudnn":      cuDNN's fused attention with its packed-sequence layout (each document given by
                its offset and length, so work between documents is skipped). jax.nn does not
                expose that layout; it lives in jax._src.cudnn, which this imports. Rows must be
                filled by whole documents (each a contiguous run of equal ids, no padding), at
                most `max_documents` per row.
  "cudnn-mask": jax.nn.dot_product_attention(implementation="cudnn") with the same-document
                mask, the public route: jax turns the mask into a dense [B, 1, T, T] bias.
  "xla":        jax.nn.dot_product_attention(implementation="xla") with the same mask.

Generation runs the same model against a key/value cache (GPT.forward_with_cache): contiguous
[B, S, Hkv, D] or paged [num_pages, page_size, Hkv, D] with a page table [B, max_pages]. A
prefill runs the attention above and writes the cache; each decode step of "tk" appends to the
cache and reads it with tk_jax.flash_attention_with_kvcache, the jax.nn implementations append
with a scatter and read a contiguous view with key_value_seq_lengths.
"""
from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.typing import DTypeLike

import tk_jax
from tk_jax.nn import SwiGLU

ATTENTIONS = ("tk", "cudnn", "cudnn-mask", "xla")

# Python lists of modules must be wrapped for NNX 0.12 (nnx.List); older flax takes plain lists.
_ModuleList = getattr(nnx, "List", list)


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 1024
    d_model: int = 512
    num_layers: int = 4
    num_heads: int = 8
    num_kv_heads: int = 2
    head_dim: int | None = None            # None: d_model // num_heads
    mlp_hidden_dim: int | None = None      # None: 8/3 d_model rounded up to a multiple of 64
    rope_base: float = 10000.0
    norm_eps: float = 1e-5
    dtype: DTypeLike = jnp.bfloat16        # activations and matmuls
    param_dtype: DTypeLike = jnp.float32
    attention: str = "tk"                  # one of ATTENTIONS
    backend: str = "auto"                  # tk_jax backend for attention "tk"
    max_documents: int | None = None       # "cudnn" with segment ids: most documents in a row

    def __post_init__(self):
        if self.attention not in ATTENTIONS:
            raise ValueError(f"GPTConfig: attention={self.attention!r} is not one of "
                             f"{ATTENTIONS}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"GPTConfig: num_heads={self.num_heads} must be a multiple of "
                             f"num_kv_heads={self.num_kv_heads}")
        if self.head_dim is None and self.d_model % self.num_heads:
            raise ValueError(f"GPTConfig: d_model={self.d_model} is not divisible by "
                             f"num_heads={self.num_heads}; give head_dim")
        if self.dims_per_head % 2:
            raise ValueError(f"GPTConfig: head_dim must be even for RoPE, got "
                             f"{self.dims_per_head}")

    @property
    def dims_per_head(self) -> int:
        return self.head_dim or self.d_model // self.num_heads

    @property
    def hidden_dim(self) -> int:
        return self.mlp_hidden_dim or 64 * math.ceil(8 * self.d_model / 3 / 64)


# ------------------------------------------------------------------- documents and positions

def document_starts(segment_ids: jax.Array) -> jax.Array:
    """[B, T] bool: True where a document begins (the row's first token, or a change of id)."""
    first = jnp.ones_like(segment_ids[:, :1], dtype=bool)
    return jnp.concatenate([first, segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1)


def positions_in_document(segment_ids: jax.Array) -> jax.Array:
    """[B, T] int32: each token's offset from the start of its document (RoPE restarts)."""
    t = jnp.arange(segment_ids.shape[1], dtype=jnp.int32)
    start = jax.lax.cummax(jnp.where(document_starts(segment_ids), t, 0), axis=1)
    return t - start


def same_document_mask(segment_ids: jax.Array) -> jax.Array:
    """[B, 1, T, T] bool: query i and key j share a segment id (jax.nn's mask layout)."""
    return (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None]


def packed_layout(segment_ids: jax.Array, max_documents: int) -> tuple[jax.Array, jax.Array]:
    """cuDNN's packed-sequence descriptors of rows of whole documents.

    Returns (lengths [B, M], offsets [B, M + 1]) int32 with M = max_documents: document d of
    row b starts at offsets[b, d] and holds lengths[b, d] tokens; entries past the row's last
    document are -1 (jax._src.cudnn's convention). A row with more than M documents would lose
    the extra ones, so M must bound them.
    """
    batch = segment_ids.shape[0]
    starts = document_starts(segment_ids)
    document = jnp.cumsum(starts, axis=1, dtype=jnp.int32) - 1          # [B, T] 0, 0, 1, ...
    rows = jnp.arange(batch)[:, None]
    counts = jnp.zeros((batch, max_documents), jnp.int32).at[rows, document].add(1, mode="drop")
    present = counts > 0
    first = jnp.cumsum(counts, axis=1) - counts                          # exclusive prefix sum
    lengths = jnp.where(present, counts, -1)
    offsets = jnp.where(present, first, -1)
    offsets = jnp.concatenate([offsets, jnp.full((batch, 1), -1, jnp.int32)], axis=1)
    return lengths, offsets


def rope(x: jax.Array, positions: jax.Array, *, base: float = 10000.0) -> jax.Array:
    """Rotate feature pairs (i, i + D/2) of x [B, T, H, D] by positions[b, t] * base^(-2i/D).

    The convention of tk_jax.nn.rotary.apply_rotary (the same result with positions 0..T-1),
    with explicit positions so that they can restart per document or continue a cache.
    """
    half = x.shape[-1] // 2
    inv_freq = base ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angles = positions.astype(jnp.float32)[..., None] * inv_freq          # [B, T, D/2]
    cos, sin = jnp.cos(angles)[:, :, None, :], jnp.sin(angles)[:, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1).astype(x.dtype)


# ----------------------------------------------------------------------------- attention

def _jax_nn_implementation(attention: str) -> str:
    return "xla" if attention == "xla" else "cudnn"


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array,
                     segment_ids: jax.Array | None, config: GPTConfig) -> jax.Array:
    """Causal attention within documents. q [B, T, Hq, D], k/v [B, T, Hkv, D] -> [B, T, Hq, D]."""
    c = config
    if c.attention == "tk":
        if segment_ids is None:
            return tk_jax.flash_attention(q, k, v, causal=True, backend=c.backend)
        return tk_jax.flash_attention(q, k, v, causal=True, q_segment_ids=segment_ids,
                                      kv_segment_ids=segment_ids, backend=c.backend)
    if c.attention == "cudnn" and segment_ids is not None:
        return cudnn_packed_attention(q, k, v, segment_ids, c.max_documents)
    mask = None if segment_ids is None else same_document_mask(segment_ids)
    return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=True,
                                        implementation=_jax_nn_implementation(c.attention))


def cudnn_packed_attention(q, k, v, segment_ids, max_documents: int | None) -> jax.Array:
    """Causal attention within documents through cuDNN's packed layout (see packed_layout)."""
    if max_documents is None:
        raise ValueError("attention 'cudnn' with segment ids needs GPTConfig.max_documents (the "
                         "most documents one row holds, a static bound); got None")
    try:
        from jax._src.cudnn import fused_attention_stablehlo as cudnn
    except ImportError as err:  # a private module: say what to use instead if it moved
        raise ImportError("attention 'cudnn' needs jax._src.cudnn.fused_attention_stablehlo "
                          "(cuDNN's packed layout); use 'cudnn-mask' with this jax") from err
    lengths, offsets = packed_layout(segment_ids, max_documents)
    return cudnn.dot_product_attention(
        q, k, v, q_seqlen=lengths, kv_seqlen=lengths, q_offsets=offsets, kv_offsets=offsets,
        scale=1.0 / math.sqrt(q.shape[-1]), mask_type=cudnn.MaskType.PADDING_CAUSAL)


# ------------------------------------------------------------------------------ KV cache

class KVCache(NamedTuple):
    """Keys and values of every layer for generation (a pytree: pass it through jit/loops).

    k, v: one array per layer, contiguous [B, S, Hkv, D] or paged [num_pages, page_size, Hkv, D].
    lengths: [B] int32, tokens already in the cache (the next one goes at this position).
    page_table: [B, max_pages] int32 (page p of row b holds its positions p*page_size ...),
      or None for a contiguous cache.
    """
    k: tuple
    v: tuple
    lengths: jax.Array
    page_table: jax.Array | None = None


def init_cache(config: GPTConfig, batch: int, max_len: int, *, page_size: int | None = None,
               page_table: jax.Array | None = None) -> KVCache:
    """An empty cache for `batch` sequences of up to max_len tokens.

    page_size None: contiguous. Otherwise a pool of B * ceil(max_len / page_size) pages and
    page_table [B, ceil(max_len / page_size)], any arrangement of them (default: in order).
    """
    c = config
    tail = (c.num_kv_heads, c.dims_per_head)
    if page_size is None:
        shape = (batch, max_len) + tail
    else:
        pages_per_row = -(-max_len // page_size)
        if page_table is None:
            page_table = jnp.arange(batch * pages_per_row, dtype=jnp.int32).reshape(batch, -1)
        page_table = jnp.asarray(page_table, jnp.int32)
        if page_table.shape != (batch, pages_per_row):
            raise ValueError(f"init_cache: page_table must be [{batch}, {pages_per_row}], got "
                             f"{page_table.shape}")
        shape = (batch * pages_per_row, page_size) + tail
    zeros = lambda: tuple(jnp.zeros(shape, c.dtype) for _ in range(c.num_layers))
    return KVCache(zeros(), zeros(), jnp.zeros((batch,), jnp.int32), page_table)


def write_cache(cache: jax.Array, new: jax.Array, lengths: jax.Array,
                page_table: jax.Array | None) -> jax.Array:
    """Store new [B, Tn, Hkv, D] at positions lengths[b] + 0..Tn-1 of each row."""
    batch, num_new = new.shape[:2]
    position = lengths[:, None] + jnp.arange(num_new, dtype=jnp.int32)     # [B, Tn]
    if page_table is None:
        return cache.at[jnp.arange(batch)[:, None], position].set(new, mode="drop")
    page_size = cache.shape[1]
    page = jnp.take_along_axis(page_table, position // page_size, axis=1)
    return cache.at[page, position % page_size].set(new, mode="drop")


def contiguous_view(cache: jax.Array, page_table: jax.Array | None) -> jax.Array:
    """[B, S, Hkv, D]: the cache itself, or its pages gathered in each row's order (a copy)."""
    if page_table is None:
        return cache
    pages = cache[page_table]                                  # [B, max_pages, page, Hkv, D]
    return pages.reshape(pages.shape[0], -1, *pages.shape[3:])


def cached_attention(q, k, v, k_cache, v_cache, lengths, page_table, config: GPTConfig):
    """Attention of new tokens (q [B, Tn, Hq, D], k/v [B, Tn, Hkv, D], at positions lengths + i)
    over the cache and themselves, causally; returns (o, k_cache, v_cache) with k/v appended.

    Tn > 1 is a prefill and must start from an empty cache: it attends to the new tokens only
    (causal_attention, the training path) and writes them to the cache. Tn == 1 is a decode
    step: "tk" appends and attends in one tk_jax.flash_attention_with_kvcache call; the jax.nn
    implementations append with a scatter, then read a contiguous view of the cache with
    key_value_seq_lengths.
    """
    c = config
    if q.shape[1] > 1:
        o = causal_attention(q, k, v, None, c)
        return (o, write_cache(k_cache, k, lengths, page_table),
                write_cache(v_cache, v, lengths, page_table))
    if c.attention == "tk":
        return tk_jax.flash_attention_with_kvcache(
            q, k_cache, v_cache, lengths, k_new=k, v_new=v, page_table=page_table,
            causal=True, backend=c.backend)
    k_cache = write_cache(k_cache, k, lengths, page_table)
    v_cache = write_cache(v_cache, v, lengths, page_table)
    o = jax.nn.dot_product_attention(
        q, contiguous_view(k_cache, page_table), contiguous_view(v_cache, page_table),
        key_value_seq_lengths=lengths + 1, implementation=_jax_nn_implementation(c.attention))
    return o, k_cache, v_cache


# -------------------------------------------------------------------------------- modules

class Attention(nnx.Module):
    """Grouped-query self-attention with RoPE: x [B, T, d_model] -> [B, T, d_model]."""

    def __init__(self, config: GPTConfig, *, rngs: nnx.Rngs):
        c = self.config = config
        d = c.dims_per_head

        def linear(d_in, d_out):
            return nnx.Linear(d_in, d_out, use_bias=False, dtype=c.dtype,
                              param_dtype=c.param_dtype, rngs=rngs)

        self.q_proj = linear(c.d_model, c.num_heads * d)
        self.k_proj = linear(c.d_model, c.num_kv_heads * d)
        self.v_proj = linear(c.d_model, c.num_kv_heads * d)
        self.o_proj = linear(c.num_heads * d, c.d_model)

    def _project(self, x, positions):
        c = self.config
        heads = lambda t, h: t.reshape(*x.shape[:2], h, c.dims_per_head)
        q = rope(heads(self.q_proj(x), c.num_heads), positions, base=c.rope_base)
        k = rope(heads(self.k_proj(x), c.num_kv_heads), positions, base=c.rope_base)
        return q, k, heads(self.v_proj(x), c.num_kv_heads)

    def _output(self, o):
        return self.o_proj(o.reshape(*o.shape[:2], -1))

    def __call__(self, x, positions, segment_ids=None):
        q, k, v = self._project(x, positions)
        return self._output(causal_attention(q, k, v, segment_ids, self.config))

    def with_cache(self, x, positions, k_cache, v_cache, lengths, page_table):
        q, k, v = self._project(x, positions)
        o, k_cache, v_cache = cached_attention(q, k, v, k_cache, v_cache, lengths, page_table,
                                               self.config)
        return self._output(o), k_cache, v_cache


class DecoderBlock(nnx.Module):
    """x + attention(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, config: GPTConfig, *, rngs: nnx.Rngs):
        c = config
        norm = lambda: nnx.RMSNorm(c.d_model, epsilon=c.norm_eps, dtype=c.dtype,
                                   param_dtype=c.param_dtype, rngs=rngs)
        self.attention_norm = norm()
        self.attention = Attention(c, rngs=rngs)
        self.mlp_norm = norm()
        self.mlp = SwiGLU(c.d_model, c.hidden_dim, dtype=c.dtype, rngs=rngs)

    def __call__(self, x, positions, segment_ids=None):
        x = x + self.attention(self.attention_norm(x), positions, segment_ids)
        return x + self.mlp(self.mlp_norm(x))

    def with_cache(self, x, positions, k_cache, v_cache, lengths, page_table):
        y, k_cache, v_cache = self.attention.with_cache(
            self.attention_norm(x), positions, k_cache, v_cache, lengths, page_table)
        x = x + y
        return x + self.mlp(self.mlp_norm(x)), k_cache, v_cache


class GPT(nnx.Module):
    """tokens [B, T] int -> logits [B, T, vocab_size] float32."""

    def __init__(self, config: GPTConfig, *, rngs: nnx.Rngs):
        c = self.config = config
        self.embed = nnx.Embed(c.vocab_size, c.d_model, dtype=c.dtype, param_dtype=c.param_dtype,
                               embedding_init=nnx.initializers.normal(0.02), rngs=rngs)
        self.blocks = _ModuleList([DecoderBlock(c, rngs=rngs) for _ in range(c.num_layers)])
        self.final_norm = nnx.RMSNorm(c.d_model, epsilon=c.norm_eps, dtype=c.dtype,
                                      param_dtype=c.param_dtype, rngs=rngs)
        self.lm_head = nnx.Linear(c.d_model, c.vocab_size, use_bias=False, dtype=c.dtype,
                                  param_dtype=c.param_dtype, rngs=rngs)

    def _logits(self, x):
        return self.lm_head(self.final_norm(x)).astype(jnp.float32)

    def __call__(self, tokens: jax.Array, segment_ids: jax.Array | None = None) -> jax.Array:
        """Causal logits; with segment ids [B, T], within each document (positions restart)."""
        if segment_ids is None:
            positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32),
                                         tokens.shape)
        else:
            positions = positions_in_document(segment_ids)
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, positions, segment_ids)
        return self._logits(x)

    def forward_with_cache(self, tokens: jax.Array, cache: KVCache, *,
                           last_only: bool = False) -> tuple[jax.Array, KVCache]:
        """Logits of tokens [B, Tn] continuing each row at position cache.lengths, and the cache
        with their keys and values appended (a prefill with Tn > 1, a decode step with 1).
        last_only: logits of the last token only, [B, 1, V] (a long prompt's [B, Tn, V] float32
        logits can outweigh the whole cache)."""
        positions = cache.lengths[:, None] + jnp.arange(tokens.shape[1], dtype=jnp.int32)
        x = self.embed(tokens)
        ks, vs = [], []
        for block, k_cache, v_cache in zip(self.blocks, cache.k, cache.v):
            x, k_cache, v_cache = block.with_cache(x, positions, k_cache, v_cache, cache.lengths,
                                                   cache.page_table)
            ks.append(k_cache)
            vs.append(v_cache)
        new_cache = cache._replace(k=tuple(ks), v=tuple(vs),
                                   lengths=cache.lengths + tokens.shape[1])
        return self._logits(x[:, -1:] if last_only else x), new_cache
