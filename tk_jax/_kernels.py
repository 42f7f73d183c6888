"""Thin jax.ffi.ffi_call wrappers around the compiled kernels. Inputs are already validated
and in the kernels' layout ([batch, seq, heads, dim], contiguous); these only build the call."""
from __future__ import annotations

import functools
import importlib
import math
import types

import jax
import jax.numpy as jnp
import numpy as np

KERNEL_DTYPES = (jnp.bfloat16, jnp.float16)

try:  # the compiled extension: it also tells the facts of the kernels that the calls need
    _tk = importlib.import_module("tk_jax._tk")
except ImportError as err:
    _tk, _TK_IMPORT_ERROR = None, str(err)


def attention_kernel_unsupported(q, k, v) -> str | None:
    """None when the attention kernels handle these inputs, else why not."""
    if q.dtype not in [jnp.dtype(d) for d in KERNEL_DTYPES]:
        return f"the kernel takes bf16 or fp16 inputs, got {q.dtype}"
    if _tk is None:
        return f"the kernel extension tk_jax._tk cannot be imported: {_TK_IMPORT_ERROR}"
    head_dims = tuple(_tk.attention_head_dims)
    if q.shape[-1] not in head_dims:
        return f"the kernel supports head_dim in {head_dims}, got {q.shape[-1]}"
    return None


def _mask_operands(q, k, q_segment_ids, kv_segment_ids, q_seq_lengths, kv_seq_lengths,
                   bottom_right):
    """The mask operands and attributes both attention calls take: the four int32 arrays (a
    one-element placeholder for an absent pair; the attribute says which pairs are real) and
    the mask workspace's size. Segment ids come both or neither; a missing length of a given
    pair is the whole sequence."""
    *lead, seq_q = q.shape[:-2]
    seq_k = k.shape[-3]
    batch = math.prod(lead)
    has_segment_ids = q_segment_ids is not None or kv_segment_ids is not None
    if has_segment_ids and (q_segment_ids is None or kv_segment_ids is None):
        raise ValueError("q_segment_ids and kv_segment_ids come together: pass both or neither")
    has_seq_lengths = q_seq_lengths is not None or kv_seq_lengths is not None
    placeholder = jnp.zeros((1,), jnp.int32)
    if has_segment_ids:
        segment_ids = (jnp.asarray(q_segment_ids, jnp.int32), jnp.asarray(kv_segment_ids, jnp.int32))
    else:
        segment_ids = (placeholder, placeholder)
    if has_seq_lengths:
        lengths = tuple(jnp.full(tuple(lead), full, jnp.int32) if x is None else jnp.asarray(x, jnp.int32)
                        for x, full in ((q_seq_lengths, seq_q), (kv_seq_lengths, seq_k)))
    else:
        lengths = (placeholder, placeholder)
    workspace_bytes = _tk.attention_mask_workspace_bytes(batch, seq_q, seq_k, has_segment_ids)
    attrs = dict(has_segment_ids=np.bool_(has_segment_ids), has_seq_lengths=np.bool_(has_seq_lengths),
                 bottom_right=np.bool_(bottom_right))
    return (*segment_ids, *lengths), jax.ShapeDtypeStruct((workspace_bytes,), jnp.uint8), attrs


def attention_fwd(q, k, v, *, scale: float, window_left: int, window_right: int,
                  q_segment_ids=None, kv_segment_ids=None, q_seq_lengths=None, kv_seq_lengths=None,
                  bottom_right: bool = True):
    """(o, lse) from the forward kernel. q [B, Tq, Hq, D], k/v [B, Tk, Hkv, D];
    lse [B, Hq, Tq] float32. Masks (cpp/kernels/attention/attention.h, MaskParams): segment ids
    [B, Tq] / [B, Tk] int32, both or neither; lengths [B] int32 (a missing one of the pair is the
    whole sequence; the kernel clamps them to [0, T]); bottom_right aligns the causal / window
    diagonal at kv_len - q_len, else at 0 (jax.nn's top-left). Under vmap, extra leading axes
    fold into the batch in C++, the masks' with q's."""
    *lead, seq_q, heads_q, _ = q.shape
    masks, mask_workspace, mask_attrs = _mask_operands(
        q, k, q_segment_ids, kv_segment_ids, q_seq_lengths, kv_seq_lengths, bottom_right)
    out_types = (
        jax.ShapeDtypeStruct(q.shape, q.dtype),
        jax.ShapeDtypeStruct((*lead, heads_q, seq_q), jnp.float32),
        mask_workspace,
    )
    call = jax.ffi.ffi_call("tk_attention_fwd", out_types, vmap_method="broadcast_all")
    o, lse, _ = call(q, k, v, *masks, scale=np.float32(scale), window_left=np.int64(window_left),
                     window_right=np.int64(window_right), **mask_attrs)
    return o, lse


def _backward_workspaces(batch: int, heads_q: int, heads_kv: int, dq_rows: int, seq_k: int,
                         head_dim: int) -> tuple:
    """The backward's two scratch outputs: the dQ state (its dQ accumulator and row
    statistics, for dq_rows query rows) and the key workspace (GQA's dK / dV accumulators), of
    the sizes the extension says (linear in the batch, which folds vmap's leading axes)."""
    state = _tk.attention_backward_dq_state_bytes(batch, heads_q, dq_rows, head_dim)
    keys = _tk.attention_backward_key_workspace_bytes(batch, heads_q, heads_kv, seq_k, head_dim)
    return (jax.ShapeDtypeStruct((state,), jnp.uint8), jax.ShapeDtypeStruct((keys,), jnp.uint8))


def attention_bwd(q, k, v, o, lse, do, dlse=None, *, scale: float, window_left: int, window_right: int,
                  q_segment_ids=None, kv_segment_ids=None, q_seq_lengths=None, kv_seq_lengths=None,
                  bottom_right: bool = True):
    """(dq, dk, dv) from the backward kernel, in the dtypes of q, k, v.

    q, o, do [B, Tq, Hq, D], k, v [B, Tk, Hkv, D], lse [B, Hq, Tq] as attention_fwd returns it,
    dlse the cotangent of lse or None, the masks as attention_fwd takes them. For dlse None the
    call gets zeros: the handler keeps one fixed list of buffers, at a cost of 8 bytes a query
    row (written, then read) next to the 4 D bytes of do and o it reads anyway. The kernels'
    scratch memory is three more outputs of the call, of the sizes the extension says. Under
    vmap, extra leading axes fold into the batch in C++ (the workspaces' sizes are linear in the
    batch).
    """
    *lead, seq_q, heads_q, head_dim = q.shape
    seq_k, heads_kv = k.shape[-3], k.shape[-2]
    masks, mask_workspace, mask_attrs = _mask_operands(
        q, k, q_segment_ids, kv_segment_ids, q_seq_lengths, kv_seq_lengths, bottom_right)
    out_types = (
        jax.ShapeDtypeStruct(q.shape, q.dtype),
        jax.ShapeDtypeStruct(k.shape, k.dtype),
        jax.ShapeDtypeStruct(v.shape, v.dtype),
        *_backward_workspaces(math.prod(lead), heads_q, heads_kv, seq_q, seq_k, head_dim),
        mask_workspace,
    )
    if dlse is None:
        dlse = jnp.zeros_like(lse)
    call = jax.ffi.ffi_call("tk_attention_bwd", out_types, vmap_method="broadcast_all")
    dq, dk, dv, *_ = call(q, k, v, o.astype(q.dtype), do.astype(q.dtype), lse, dlse.astype(jnp.float32),
                          *masks, scale=np.float32(scale), window_left=np.int64(window_left),
                          window_right=np.int64(window_right), **mask_attrs)
    return dq, dk, dv


# The backward in three calls, for a caller that sums dQ over several calls with different keys
# (context parallelism: one call per block of keys). The dQ state is opaque bytes: its layout is
# the kernels' (cpp/kernels/attention/backward_workspace.cuh). No vmap: these run on local
# blocks inside the ring, where the batch is folded already.


def attention_bwd_row_stats(o, lse, do, dlse=None, *, scale: float):
    """A new dQ state for the rows of o [B, T, Hq, D]: their row statistics (from o, lse, do
    and dlse, or zeros) and a zeroed dQ accumulator."""
    batch, seq_q, heads_q, head_dim = o.shape
    state = jax.ShapeDtypeStruct(
        (_tk.attention_backward_dq_state_bytes(batch, heads_q, seq_q, head_dim),), jnp.uint8)
    if dlse is None:
        dlse = jnp.zeros_like(lse)
    call = jax.ffi.ffi_call("tk_attention_bwd_row_stats", state)
    return call(o, do.astype(o.dtype), lse, dlse.astype(jnp.float32), scale=np.float32(scale))


def attention_bwd_keys(state, q, k, v, do, *, dq_rows: int, dq_row_shift: int, scale: float,
                       window_left: int, window_right: int, q_segment_ids=None,
                       kv_segment_ids=None, q_seq_lengths=None, kv_seq_lengths=None,
                       bottom_right: bool = True):
    """(state, dk, dv): the backward of the queries q (with their do) against k, v, as
    attention_bwd computes it, with dq added into the dQ state (of dq_rows rows; row i of q is
    row (i + dq_row_shift) mod dq_rows there) instead of returned. A call on part of the rows
    needs Tq, dq_rows and dq_row_shift multiples of 64."""
    batch, seq_q, heads_q, head_dim = q.shape
    seq_k, heads_kv = k.shape[1], k.shape[2]
    masks, mask_workspace, mask_attrs = _mask_operands(
        q, k, q_segment_ids, kv_segment_ids, q_seq_lengths, kv_seq_lengths, bottom_right)
    state_type, key_workspace = _backward_workspaces(batch, heads_q, heads_kv, dq_rows, seq_k, head_dim)
    out_types = (jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype),
                 state_type, key_workspace, mask_workspace)
    state_index = 4 + len(masks)  # q, k, v, do, the masks, then the state
    call = jax.ffi.ffi_call("tk_attention_bwd_keys", out_types,
                            input_output_aliases={state_index: 2})
    dk, dv, state, _, _ = call(q, k, v, do.astype(q.dtype), *masks, state, scale=np.float32(scale),
                               window_left=np.int64(window_left), window_right=np.int64(window_right),
                               dq_rows=np.int64(dq_rows), dq_row_shift=np.int64(dq_row_shift), **mask_attrs)
    return state, dk, dv


def attention_bwd_dq(state, like):
    """dq shaped and typed like `like` (a [B, T, Hq, D] array or ShapeDtypeStruct) out of the
    dQ state."""
    call = jax.ffi.ffi_call("tk_attention_bwd_dq", jax.ShapeDtypeStruct(like.shape, like.dtype))
    return call(state)


@functools.lru_cache(maxsize=None)
def based_conventions() -> types.MappingProxyType | None:
    """The Based kernels' conventions as cpp/kernels/based/based.h defines them, read from the
    extension (None where it is not built): feature_dim, num_features, chunk (tokens per step
    of the kernels' sweep), column_block (value columns per thread block; dq and dk come in
    partial sums per block), value_dims, max_batch, max_heads."""
    if _tk is None:
        return None
    return types.MappingProxyType(dict(_tk.based_conventions()))


@functools.lru_cache(maxsize=None)
def multiprocessor_count() -> int:
    """SMs of the first local device, which the kernels run on, from the CUDA runtime
    (cudaDeviceGetAttribute in the extension)."""
    return int(_tk.multiprocessor_count(jax.local_devices()[0].local_hardware_id))


def based_kernel_unsupported(q, k, v) -> str | None:
    """None when the Based forward kernel handles these rank-4 inputs, else why not."""
    c = based_conventions()
    if c is None:
        return "the Based kernels are not built (no tk_jax._tk)"
    if q.dtype not in [jnp.dtype(d) for d in KERNEL_DTYPES]:
        return f"the Based kernel takes bf16 or fp16 inputs, got {q.dtype}"
    if q.shape[-1] != c["feature_dim"] or k.shape[-1] != c["feature_dim"]:
        return f"the Based kernel needs feature dim {c['feature_dim']}, got {q.shape[-1]}"
    if v.shape[-1] not in c["value_dims"]:
        return (f"the Based kernel supports value dim (v's last axis) in {c['value_dims']}, "
                f"got {v.shape[-1]}")
    batch, seq_len, heads = q.shape[0], q.shape[1], q.shape[2]
    if seq_len < 1:
        return "the Based kernel needs at least one token"
    if batch > c["max_batch"] or heads > c["max_heads"]:
        return (f"the Based kernel supports batch up to {c['max_batch']} and heads up to "
                f"{c['max_heads']}, got {batch} and {heads}")
    return None


def based_fwd(q, k, v, s0, z0, *, normalize: bool, eps: float):
    """(y, S, z, den) from the Based forward kernel.

    q, k [B, T, H, 16], v [B, T, H, Dv], initial state s0 [B, H, 273, Dv] and z0 [B, H, 273]
    (float32; zeros for none). Returns y [B, T, H, Dv] in v's dtype, the final state
    S [B, H, 273, Dv], z [B, H, 273] and the normaliser den [B, H, T] (without eps; the
    backward's residual), all float32 but y. Under vmap, extra leading axes fold into the
    batch in C++.
    """
    *lead, seq_len, heads, _ = v.shape
    out_types = (
        jax.ShapeDtypeStruct(v.shape, v.dtype),
        jax.ShapeDtypeStruct(s0.shape, jnp.float32),
        jax.ShapeDtypeStruct(z0.shape, jnp.float32),
        jax.ShapeDtypeStruct((*lead, heads, seq_len), jnp.float32),
    )
    call = jax.ffi.ffi_call("tk_based_fwd", out_types, vmap_method="broadcast_all")
    return call(q, k, v, s0.astype(jnp.float32), z0.astype(jnp.float32),
                normalize=np.int64(1 if normalize else 0), eps=np.float32(eps))


def based_bwd(q, k, v, y, den, dy, s0, z0, d_state, d_z, *, normalize: bool, eps: float,
              with_dq: bool = True):
    """(dq, dk, dv, dS0, dz0) from the Based backward kernel (dq = 0 when not `with_dq`: the
    kernel then skips its dq sweep, for callers that need only the rest).

    Forward inputs q, k, v, s0, z0 and outputs y, den (from based_fwd); cotangents dy of y and
    d_state, d_z of the final state. The kernel wants dnum = dy / (den + eps) and the
    normaliser's cotangent dden = -(dy . y) / (den + eps) per row, prepared here in one fused
    XLA pass ([B, H, T] each; 1 and 0 without normalisation). It returns dq and dk as float32
    partial sums per column block of v (the blocks run in parallel), added up here: the sum and
    the cast to q's dtype are one fused pass, which XLA may fuse further into the consumer.
    """
    if normalize:
        inv_den = 1.0 / (den + eps)
        dot = jnp.einsum("bthe,bthe->bht", dy.astype(jnp.float32), y.astype(jnp.float32))
        dden = -dot * inv_den
    else:
        inv_den = jnp.ones_like(den)
        dden = jnp.zeros_like(den)
    *lead, seq_len, heads, value_dim = v.shape
    c = based_conventions()
    parts = jax.ShapeDtypeStruct(
        (*lead, seq_len, heads, value_dim // c["column_block"], c["feature_dim"]), jnp.float32)
    out_types = (parts, parts, jax.ShapeDtypeStruct(v.shape, v.dtype),
                 jax.ShapeDtypeStruct(s0.shape, jnp.float32), jax.ShapeDtypeStruct(z0.shape, jnp.float32))
    call = jax.ffi.ffi_call("tk_based_bwd", out_types, vmap_method="broadcast_all")
    dq_parts, dk_parts, dv, ds0, dz0 = call(
        q, k, v, dy.astype(v.dtype), inv_den, dden, s0.astype(jnp.float32), z0.astype(jnp.float32),
        d_state.astype(jnp.float32), d_z.astype(jnp.float32), with_dq=np.int64(1 if with_dq else 0))
    return dq_parts.sum(-2).astype(q.dtype), dk_parts.sum(-2).astype(k.dtype), dv, ds0, dz0


def based_decode_unsupported(q_t, v_t) -> str | None:
    """None when the decode-step kernel handles q_t [..., 16] / v_t [..., Dv], else why not."""
    c = based_conventions()
    if c is None:
        return "the Based kernels are not built (no tk_jax._tk)"
    if q_t.dtype not in [jnp.dtype(d) for d in KERNEL_DTYPES]:
        return f"the Based decode kernel takes bf16 or fp16 inputs, got {q_t.dtype}"
    if q_t.shape[-1] != c["feature_dim"]:
        return f"the Based decode kernel needs feature dim {c['feature_dim']}, got {q_t.shape[-1]}"
    if v_t.shape[-1] not in c["value_dims"]:
        return (f"the Based decode kernel supports value dim (v_t's last axis) in "
                f"{c['value_dims']}, got {v_t.shape[-1]}")
    if math.prod(q_t.shape[:-1]) < 1:
        return "the Based decode kernel needs at least one (batch, head) row"
    return None


def based_decode(q_t, k_t, v_t, s, z, *, normalize: bool, eps: float):
    """(y_t, S', z') from the decode-step kernel: q_t, k_t [..., H, 16], v_t [..., H, Dv],
    S [..., H, 273, Dv], z [..., H, 273] (float32). S' and z' reuse the buffers of S and z
    (input_output_aliases): inside a jitted generation loop the state is updated in place."""
    out_types = (
        jax.ShapeDtypeStruct(v_t.shape, v_t.dtype),
        jax.ShapeDtypeStruct(s.shape, jnp.float32),
        jax.ShapeDtypeStruct(z.shape, jnp.float32),
    )
    call = jax.ffi.ffi_call("tk_based_decode", out_types, vmap_method="broadcast_all",
                            input_output_aliases={3: 1, 4: 2})
    return call(q_t, k_t, v_t, s.astype(jnp.float32), z.astype(jnp.float32),
                normalize=np.int64(1 if normalize else 0), eps=np.float32(eps))


# ----------------------------------------------------------------------------------------------
# Attention against a KV cache: decode, speculative verification, chunked prefill
# (cpp/kernels/kvcache/kvcache.h states the semantics; cpp/ffi/kvcache.cc the buffers).

def kvcache_kernel_unsupported(q, k_cache, page_table) -> str | None:
    """None when the KV-cache kernel handles queries q [..., B, Tq, Hq, D] against this cache
    (contiguous [..., B, S, Hkv, D], or paged [..., P, page_size, Hkv, D] when a page_table
    [..., B, max_pages] is given), else why not. Shapes are assumed consistent (the caller
    validates them)."""
    if q.dtype not in [jnp.dtype(d) for d in KERNEL_DTYPES]:
        return f"the KV-cache kernel takes bf16 or fp16 inputs, got {q.dtype}"
    if k_cache.dtype != q.dtype:
        return f"the KV-cache kernel needs the cache in q's dtype {q.dtype}, got {k_cache.dtype}"
    if _tk is None:
        return f"the kernel extension tk_jax._tk cannot be imported: {_TK_IMPORT_ERROR}"
    if not hasattr(_tk, "kvcache_head_dims"):
        return "the kernel extension was built without the KV-cache kernel: rebuild tk_jax"
    head_dims = tuple(_tk.kvcache_head_dims)
    if q.shape[-1] not in head_dims:
        return f"the KV-cache kernel supports head_dim in {head_dims}, got {q.shape[-1]}"
    heads_q, heads_kv = q.shape[-2], k_cache.shape[-2]
    if heads_kv < 1 or heads_q % heads_kv:
        return f"the KV-cache kernel needs heads_q a multiple of heads_kv, got {heads_q} and {heads_kv}"
    if page_table is not None:
        page_sizes = tuple(_tk.kvcache_page_sizes)
        if k_cache.shape[-3] not in page_sizes:
            return (f"the KV-cache kernel supports page sizes (k_cache.shape[-3] of a paged "
                    f"cache) in {page_sizes}, got {k_cache.shape[-3]}")
    return None


def kvcache_num_splits(q, k_cache, page_table=None, num_splits: int = 0) -> int:
    """The key splits attention_kvcache uses for these shapes: num_splits (> 0) capped at what
    the cache allows (at most one a key tile, at most _tk.kvcache_max_splits), or for 0 the
    kernel's own choice for this GPU's multiprocessor count (cpp/kernels/kvcache/kvcache.cu)."""
    *lead, batch, seq_q, heads_q, head_dim = q.shape
    capacity = (page_table.shape[-1] * k_cache.shape[-3] if page_table is not None
                else k_cache.shape[-3])
    page_size = k_cache.shape[-3] if page_table is not None else 0
    return int(_tk.kvcache_num_splits(math.prod(lead) * batch, heads_q, k_cache.shape[-2], seq_q,
                                      head_dim, capacity, page_size, multiprocessor_count(),
                                      int(num_splits)))


def attention_kvcache(q, k_cache, v_cache, seqlens, page_table=None, *, scale: float,
                      window_left: int, window_right: int, num_splits: int = 0):
    """(o, lse) of queries q [B, Tq, Hq, D] against a KV cache, from the KV-cache kernel.

    k_cache, v_cache: contiguous [B, S, Hkv, D], or paged [num_pages, page_size, Hkv, D] with
    page_table [B, max_pages] int32 (logical key j of row b in page page_table[b, j // page_size]
    at offset j % page_size). seqlens [B] int32: valid keys of each row. Query t of row b sits at
    position seqlens[b] - Tq + t and sees key j iff j < seqlens[b] and the window allows it
    (window_left / window_right as in attention_fwd, -1 unbounded; causal is window_right 0).
    Returns o like q and lse [B, Hq, Tq] float32 (natural log); rows that see no key get o = 0,
    lse = -inf. seqlens outside [0, capacity] and page ids outside [0, num_pages) are clamped
    into range; table entries past a row's last page are never read.
    num_splits: key splits (0 chooses; see kvcache_num_splits). The split partial results live in
    a workspace, one more output of the call, dropped here. Under vmap, extra leading axes fold
    into the batch in C++ (a paged cache then holds one page pool per leading index).
    """
    *lead, batch, seq_q, heads_q, head_dim = q.shape
    splits = kvcache_num_splits(q, k_cache, page_table, num_splits)
    workspace_bytes = _tk.kvcache_workspace_bytes(math.prod(lead) * batch, heads_q, seq_q, head_dim, splits)
    paged = page_table is not None
    if not paged:  # the handler keeps one list of buffers; a contiguous call's table is not read
        page_table = jnp.zeros((*lead, batch, 0), jnp.int32)
    out_types = (
        jax.ShapeDtypeStruct(q.shape, q.dtype),
        jax.ShapeDtypeStruct((*lead, batch, heads_q, seq_q), jnp.float32),
        jax.ShapeDtypeStruct((workspace_bytes,), jnp.uint8),
    )
    call = jax.ffi.ffi_call("tk_attention_kvcache", out_types, vmap_method="broadcast_all")
    o, lse, _ = call(q, k_cache, v_cache, jnp.asarray(seqlens, jnp.int32), jnp.asarray(page_table, jnp.int32),
                     scale=np.float32(scale), window_left=np.int64(window_left),
                     window_right=np.int64(window_right), num_splits=np.int64(splits),
                     paged=np.int64(1 if paged else 0))
    return o, lse
