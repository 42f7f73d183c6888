"""kittens unit tests on the GPU: each op family runs in a small test kernel
(cpp/tests/kittens_ops.cu) and is compared with numpy."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def kernels(hopper):
    from tk_jax import _ext

    ok, why = _ext.test_kernels_available()
    assert ok, why
    return True


def _call(name, outs, *args, **attributes):
    return jax.ffi.ffi_call(name, outs)(*args, **attributes)


@pytest.mark.parametrize("cols", [16, 32, 64, 128])
@pytest.mark.parametrize("valid_rows", [64, 37, 1])
def test_load_store_roundtrip_every_swizzle(kernels, rng, cols, valid_rows):
    x = rng.standard_normal((valid_rows, cols)).astype(jnp.bfloat16)
    outs = [jax.ShapeDtypeStruct((64, cols), jnp.bfloat16)] * 2
    y, y_via_shared = _call("tk_test_roundtrip", outs, jnp.asarray(x))
    expected = np.zeros((64, cols), np.float32)
    expected[:valid_rows] = x.astype(np.float32)  # rows past the input's end load as zeros
    np.testing.assert_array_equal(np.asarray(y, np.float32), expected)
    np.testing.assert_array_equal(np.asarray(y_via_shared, np.float32), expected)


@pytest.mark.parametrize("cols", [16, 32, 64, 128])
def test_store_transposed_every_swizzle(kernels, rng, cols):
    """A register tile written transposed into a swizzled shared tile (stmatrix .trans)."""
    x = rng.standard_normal((64, cols)).astype(jnp.bfloat16)
    (y,) = _call("tk_test_transpose", [jax.ShapeDtypeStruct((cols, 64), jnp.bfloat16)], jnp.asarray(x))
    np.testing.assert_array_equal(np.asarray(y, np.float32), x.astype(np.float32).T)


@pytest.mark.parametrize("dtype,target", [(jnp.bfloat16, "tk_test_mma_bf16"), (jnp.float16, "tk_test_mma_f16")])
def test_mma_ab_and_abt(kernels, rng, dtype, target):
    a, b, c = (rng.standard_normal((64, 64)).astype(dtype) for _ in range(3))
    outs = [jax.ShapeDtypeStruct((64, 64), jnp.float32)] * 2
    ab, abt = _call(target, outs, jnp.asarray(a), jnp.asarray(b), jnp.asarray(c))
    a64, b64, c64 = (m.astype(np.float64) for m in (a, b, c))
    np.testing.assert_allclose(np.asarray(ab), a64 @ b64, rtol=1e-4, atol=1e-3)
    np.testing.assert_allclose(np.asarray(abt), a64 @ c64.T, rtol=1e-4, atol=1e-3)


def test_maps_reductions_broadcasts_masks(kernels, rng):
    x = (3 * rng.standard_normal((64, 64))).astype(jnp.bfloat16)
    col = rng.standard_normal(64).astype(np.float32)
    outs = [jax.ShapeDtypeStruct((64, 64), jnp.float32)] * 4 + [jax.ShapeDtypeStruct((64,), jnp.float32)] * 2
    softmax, masked, banded, col_mapped, row_max, row_sum = _call("tk_test_rowops", outs, jnp.asarray(x),
                                                                  jnp.asarray(col))
    x64 = x.astype(np.float64)
    np.testing.assert_allclose(np.asarray(col_mapped), x64 * col - col, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(row_max), x64.max(1), rtol=0, atol=0)
    np.testing.assert_allclose(np.asarray(row_sum), x64.sum(1), rtol=1e-5, atol=1e-4)
    p = np.exp2(x64 - x64.max(1, keepdims=True))
    np.testing.assert_allclose(np.asarray(softmax), p / p.sum(1, keepdims=True), rtol=2e-5, atol=1e-6)
    causal = np.where(np.tril(np.ones((64, 64), bool)), x64, -1e30) * 2
    np.testing.assert_allclose(np.asarray(masked), causal, rtol=1e-6)
    # mask_band: -5 <= col - row <= 3, row < 50, col < 61 (constants of kittens_ops.cu)
    r, c = np.indices((64, 64))
    keep = (c - r >= -5) & (c - r <= 3) & (r < 50) & (c < 61)
    np.testing.assert_array_equal(np.asarray(banded), np.where(keep, x64, -1e30).astype(np.float32))


def test_tma_and_wgmma(kernels, rng):
    """TMA loads into swizzled tiles, then wgmma: A B^T from shared memory (K-major) and
    A C with A in registers and C MN-major."""
    a = rng.standard_normal((64, 64)).astype(jnp.bfloat16)
    b = rng.standard_normal((64, 64)).astype(jnp.bfloat16)
    c = rng.standard_normal((64, 128)).astype(jnp.bfloat16)
    outs = [jax.ShapeDtypeStruct((64, 64), jnp.float32), jax.ShapeDtypeStruct((64, 128), jnp.float32)]
    abt, ac = _call("tk_test_wgmma", outs, jnp.asarray(a), jnp.asarray(b), jnp.asarray(c))
    a64, b64, c64 = (m.astype(np.float64) for m in (a, b, c))
    np.testing.assert_allclose(np.asarray(abt), a64 @ b64.T, rtol=1e-4, atol=1e-3)
    np.testing.assert_allclose(np.asarray(ac), a64 @ c64, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("d", [128, 256])
def test_grouped_rows_tile_gathered_from_pages_for_wgmma(kernels, rng, d):
    """A 64-row tile gathered from four shuffled 16-row pages of head 1 of a [6, 16, 3, d]
    cache, a page's rows of every 64-column panel one TMA box, landing in 8-row groups of all
    panels (st atoms::grouped_rows): wgmma reads it K-major (a K^T) and MN-major (p K); with p
    the identity, p K is the gathered tile itself, exactly."""
    cache = rng.standard_normal((6, 16, 3, d)).astype(jnp.bfloat16)
    pages = rng.permutation(6)[:4].astype(np.int32)
    a = rng.standard_normal((64, d)).astype(jnp.bfloat16)
    p = rng.standard_normal((64, 64)).astype(jnp.bfloat16)
    k64 = cache[pages, :, 1, :].reshape(64, d).astype(np.float64)
    outs = [jax.ShapeDtypeStruct((64, 64), jnp.float32), jax.ShapeDtypeStruct((64, d), jnp.float32)]
    call = lambda p: _call("tk_test_grouped_rows", outs, jnp.asarray(a), jnp.asarray(p), jnp.asarray(cache),
                           jnp.asarray(pages))
    abt, pk = call(p)
    np.testing.assert_allclose(np.asarray(abt), a.astype(np.float64) @ k64.T, rtol=1e-4, atol=1e-3)
    np.testing.assert_allclose(np.asarray(pk), p.astype(np.float64) @ k64, rtol=1e-4, atol=1e-3)
    _, k_back = call(np.eye(64, dtype=jnp.bfloat16))
    np.testing.assert_array_equal(np.asarray(k_back), k64.astype(np.float32))


def test_producer_consumer_ring(kernels, rng):
    """Two two-slot rings, phases wrapping twice: five TMA tiles through one, five rows of random
    column weights through the other, stored by a producer warp's lanes; the consumer
    warpgroup sums tile i times weights i, so a slot read at the wrong phase shows up."""
    x = rng.standard_normal((5 * 64, 64)).astype(jnp.bfloat16)
    w = rng.standard_normal((5, 64)).astype(np.float32)
    out = _call("tk_test_ring", jax.ShapeDtypeStruct((64, 64), jnp.float32), jnp.asarray(x), jnp.asarray(w))
    tiles = x.astype(np.float64).reshape(5, 64, 64)
    expected = sum(tiles[i] * w[i].astype(np.float64) for i in range(5))
    np.testing.assert_allclose(np.asarray(out), expected, rtol=1e-5, atol=1e-5)


def test_fp32_shared_tiles_bulk_store_and_add(kernels, rng):
    """Registers -> swizzled fp32 shared tiles -> one TMA bulk store and two rounds of TMA bulk
    adds into [50, 128] tensors: the copy is x exactly, every element of the sum gets 2 x, and
    the box's rows past 50 are clipped, not written."""
    base = rng.standard_normal((50, 128)).astype(np.float32)
    x = rng.standard_normal((64, 128)).astype(np.float32)
    shape = jax.ShapeDtypeStruct((50, 128), jnp.float32)
    out, copy = _call("tk_test_bulk_add", (shape, shape), jnp.asarray(base), jnp.asarray(x))
    np.testing.assert_array_equal(np.asarray(copy), x[:50])
    np.testing.assert_allclose(np.asarray(out), base.astype(np.float64) + 2 * x[:50], rtol=1e-6, atol=1e-6)


def _from_fragment_order(flat):
    """64 x 64 floats in the fragment order of four warps' 16 x 64 tiles, back in row order, as
    kittens memory.cuh documents it: warp w's lane l = 4 g + t puts quad n = 2 j + half at floats
    1024 w + 4 (32 n + l), holding rows 16 w + g (down = 0) and 16 w + 8 + g (down = 1), columns
    16 j + 8 half + 2 t and + 1 (bit), in the order (down, bit)."""
    w, j, half, g, t, down, bit = np.meshgrid(*(np.arange(n) for n in (4, 4, 2, 8, 4, 2, 2)), indexing="ij")
    rows = np.empty((64, 64), flat.dtype)
    rows[16 * w + 8 * down + g, 16 * j + 8 * half + 2 * t + bit] = flat[
        1024 * w + 4 * (32 * (2 * j + half) + 4 * g + t) + 2 * down + bit]
    return rows


def test_fragment_order_bulk_add(kernels, rng):
    """Four warps stage a 64 x 64 fp32 register tile in their register order (store_fragments),
    one thread adds it twice with 1-D bulk reductions, and the warps add it once more from
    their registers (atomic_add_fragments); put back in row order by the documented
    permutation, the sum must be 3 x."""
    base = rng.standard_normal(64 * 64).astype(np.float32)
    x = rng.standard_normal((64, 64)).astype(np.float32)
    out = _call("tk_test_fragment_add", jax.ShapeDtypeStruct((64 * 64,), jnp.float32), jnp.asarray(base),
                jnp.asarray(x))
    added = (np.asarray(out, np.float64) - base).astype(np.float32)
    np.testing.assert_allclose(_from_fragment_order(added), 3 * x, rtol=1e-5, atol=1e-5)


def test_cluster_mailbox(kernels, rng):
    """Two blocks of a cluster swap fp32 register tiles through each other's shared memory,
    32 columns per use, six uses (barrier phases wrap): block r's tile in round n is x[r] + n,
    so block r ends with x[r] + 3 x[1 - r] + 3. A use read at the wrong phase, a column half
    sent twice or a partner mixed up changes the sum."""
    x = rng.standard_normal((2, 64, 64)).astype(np.float32)
    out = _call("tk_test_mailbox", jax.ShapeDtypeStruct((2, 64, 64), jnp.float32), jnp.asarray(x))
    x64 = x.astype(np.float64)
    np.testing.assert_allclose(np.asarray(out), x64 + 3 * x64[::-1] + 3, rtol=1e-6, atol=1e-5)


def test_swap_layout_and_free_transpose(kernels, rng):
    """A tile changed to col layout in registers (swap_layout, movmatrix) and one loaded in col
    layout both read as x^T through as_transpose; swapping twice gives x back."""
    x = rng.standard_normal((64, 64)).astype(jnp.bfloat16)
    outs = [jax.ShapeDtypeStruct((64, 64), jnp.float32)] * 3
    via_swap, via_load, back = _call("tk_test_layouts", outs, jnp.asarray(x))
    xf = x.astype(np.float32)
    np.testing.assert_array_equal(np.asarray(via_swap), xf.T)
    np.testing.assert_array_equal(np.asarray(via_load), xf.T)
    np.testing.assert_array_equal(np.asarray(back), xf)


@pytest.mark.parametrize("dtype,target", [(jnp.bfloat16, "tk_test_broadcasts_bf16"),
                                          (jnp.float16, "tk_test_broadcasts_f16")])
def test_column_broadcasts_scalar_products_select(kernels, rng, dtype, target):
    """Rows scaled by a column of another tile (mul_by_columns: two columns, bf16 products;
    mul_by_column in row and col layout: products in the input type), at run-time columns in
    either 8-column half; a 16-bit tile times 1/4; a per-register select between two tiles.
    Every product is rounded once, so they match numpy's exact products rounded."""
    x = rng.standard_normal((64, 64)).astype(dtype)
    y = rng.standard_normal((64, 16)).astype(dtype)
    pair, row, col = 10, 7, 3
    outs = [jax.ShapeDtypeStruct((64, 64), jnp.float32)] * 6
    by_pair0, by_pair1, by_row, by_col, quarter, selected = _call(
        target, outs, jnp.asarray(x), jnp.asarray(y), pair=np.int64(pair), row=np.int64(row), col=np.int64(col))
    x64, y64 = x.astype(np.float64), y.astype(np.float64)

    def rounded(z, to):
        return z.astype(to).astype(np.float32)

    np.testing.assert_array_equal(np.asarray(by_pair0), rounded(x64 * y64[:, pair:pair + 1], jnp.bfloat16))
    np.testing.assert_array_equal(np.asarray(by_pair1), rounded(x64 * y64[:, pair + 1:pair + 2], jnp.bfloat16))
    np.testing.assert_array_equal(np.asarray(by_row), rounded(x64 * y64[:, row:row + 1], dtype))
    np.testing.assert_array_equal(np.asarray(by_col), rounded(x64 * y64[:, col:col + 1], dtype).T)
    np.testing.assert_array_equal(np.asarray(quarter), rounded(x64 / 4, dtype))  # fp16: may be subnormal
    odd_warp_rows = (np.arange(64) // 16 % 2 == 1)[:, None]
    np.testing.assert_array_equal(np.asarray(selected), np.where(odd_warp_rows, x64, 2 * x64).astype(np.float32))


def test_row_and_column_vectors(kernels, rng):
    """row_dot; row and column maps with two vectors (x * u + v); the sum of a column vector;
    row vectors loaded and stored with a row bound; a shared vector loaded with a valid length
    (4-byte cp.async, zeros past it); a tile handed to another warp in fragment order."""
    x = rng.standard_normal((64, 64)).astype(jnp.bfloat16)
    u = rng.standard_normal(64).astype(np.float32)
    v = rng.standard_normal(64).astype(np.float32)
    vec, mat = jax.ShapeDtypeStruct((64,), jnp.float32), jax.ShapeDtypeStruct((64, 64), jnp.float32)
    outs = [vec, mat, mat, jax.ShapeDtypeStruct((2,), jnp.float32), vec, vec, mat]
    dots, affine_rows, affine_cols, sums, rows_out, staged, handed = _call(
        "tk_test_vectors", outs, jnp.asarray(x), jnp.asarray(u), jnp.asarray(v))
    x64, u64, v64 = x.astype(np.float64), u.astype(np.float64), v.astype(np.float64)
    np.testing.assert_allclose(np.asarray(dots), (x64 * x64 / 2).sum(1), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(affine_rows), x64 * u64[:, None] + v64[:, None], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(affine_cols), x64 * u64 + v64, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(sums), [u64.sum()] * 2, rtol=1e-5, atol=1e-5)
    assert np.asarray(sums)[0] == np.asarray(sums)[1]  # every lane has the same total
    np.testing.assert_array_equal(np.asarray(rows_out), np.where(np.arange(64) < 50, u, 0))  # STORED_ROWS
    np.testing.assert_array_equal(np.asarray(staged), np.where(np.arange(64) < 37, u, 0))    # VALID
    partner_rows = x.astype(np.float32).reshape(4, 16, 64)[[1, 0, 3, 2]].reshape(64, 64)
    np.testing.assert_array_equal(np.asarray(handed), partner_rows)


def test_tensor_core_sums_and_split(kernels, rng):
    """Row sums and (weighted) column sums through the tensor cores, per 16-row block for the
    columns, weights rounded to bf16; an fp32 tile split into bf16 hi + lo (hi the rounded
    value, lo the rounded remainder, so hi + lo is within 2^-16 of it), and the one-part split."""
    x = rng.standard_normal((64, 64)).astype(jnp.bfloat16)
    u = rng.standard_normal(64).astype(np.float32)
    vec, mat = jax.ShapeDtypeStruct((64,), jnp.float32), jax.ShapeDtypeStruct((64, 64), jnp.float32)
    blocks = jax.ShapeDtypeStruct((4, 64), jnp.float32)
    row_sums, col_sums, plain_sums, hi, lo, lo_part = _call(
        "tk_test_sums", [vec, blocks, blocks, mat, mat, mat], jnp.asarray(x), jnp.asarray(u))
    x64 = x.astype(np.float64)
    w = u.astype(jnp.bfloat16).astype(np.float64)
    np.testing.assert_allclose(np.asarray(row_sums), x64.sum(1), rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(np.asarray(col_sums), (w[:, None] * x64).reshape(4, 16, 64).sum(1), rtol=1e-5,
                               atol=1e-4)
    np.testing.assert_allclose(np.asarray(plain_sums), x64.reshape(4, 16, 64).sum(1), rtol=1e-5, atol=1e-4)
    scaled = x.astype(np.float32) * np.float32(3.3)
    np.testing.assert_array_equal(np.asarray(hi), scaled.astype(jnp.bfloat16).astype(np.float32))
    remainder = scaled - np.asarray(hi)
    np.testing.assert_array_equal(np.asarray(lo), remainder.astype(jnp.bfloat16).astype(np.float32))
    np.testing.assert_array_equal(np.asarray(lo_part), np.asarray(lo))
    err = np.abs(np.asarray(hi, np.float64) + np.asarray(lo, np.float64) - scaled)
    assert np.all(err <= 2.0 ** -16 * np.abs(scaled) + 1e-30)
