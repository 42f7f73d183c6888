"""The KV-cache kernel's choice of key splits (host C++, cpp/kernels/kvcache/kvcache.cu), called
through the extension without a GPU: it runs wherever the CUDA sources were built."""
import shutil

import pytest

pytestmark = pytest.mark.skipif(shutil.which("nvcc") is None,
                                reason="no CUDA toolkit: the extension was not built here")

SMS = 132  # an H100 SXM


def splits(batch, heads_q, heads_kv, seq_q, head_dim, capacity, *, page_size=0, sms=SMS, requested=0):
    from tk_jax import _tk

    return _tk.kvcache_num_splits(batch, heads_q, heads_kv, seq_q, head_dim, capacity, page_size, sms,
                                  requested)


def test_a_requested_count_is_capped_by_the_key_tiles_and_the_most_allowed():
    from tk_jax import _tk

    assert splits(1, 8, 1, 1, 128, 6000, requested=7) == 7
    assert splits(1, 8, 1, 1, 128, 6000, requested=10**6) == 94       # 64-key tiles at D = 128
    assert splits(1, 8, 1, 1, 64, 6000, requested=10**6) == 47        # 128-key tiles at D = 64
    assert splits(1, 8, 1, 1, 128, 10**6, requested=10**6) == _tk.kvcache_max_splits


def test_blocks_that_fill_the_card_are_not_split():
    assert splits(64, 32, 8, 1, 128, 4096) == 1    # 512 blocks
    assert splits(8, 32, 32, 1, 128, 32768) == 1   # 256 blocks


def test_few_rows_are_split_to_fill_the_card_with_enough_tiles_each():
    for capacity in (32768, 131072):
        n = splits(1, 32, 8, 1, 128, capacity)   # 8 blocks before splitting
        assert 8 * n <= SMS and 8 * n >= 0.9 * SMS, n
        assert capacity // 64 // n >= 4, n
    assert splits(1, 32, 8, 1, 128, 512) <= 512 // 64 // 4   # a short cache: 4 tiles a split


def test_mqa_with_several_tokens_takes_blocks_of_128_rows():
    # 32 query heads x 4 tokens = 128 packed rows on one KV head: one block takes them all, two
    # consumer warpgroups (64 blocks for 64 batch rows, so 2 splits fill the card).
    for d in (64, 128, 256):
        assert splits(64, 32, 1, 4, d, 4096) == 2, d
    # 64 packed rows or fewer (32/8 x 4 tokens = 16): one block of rows, 512 blocks, no split.
    assert splits(64, 32, 8, 4, 128, 4096) == 1


def test_pages_under_64_keys_are_read_several_kv_heads_a_block():
    # 32/8, one token, 16-key pages: a block takes 4 KV heads (16 blocks before splitting, where
    # a contiguous cache has 64), in tiles of 16 keys of each at D = 128.
    n = splits(8, 32, 8, 1, 128, 32768, page_size=16)
    assert 16 * n <= SMS and 16 * n >= 0.9 * SMS, n
    assert splits(8, 32, 8, 1, 128, 32768) == 2
    assert splits(8, 32, 8, 1, 128, 32768, page_size=64) == 2
    assert splits(1, 8, 4, 1, 128, 2000, page_size=16, requested=10**6) == 125
    assert splits(1, 8, 4, 1, 128, 2000, page_size=64, requested=10**6) == 32
    # Up to 32 rows a head: at D = 128 four heads of two warps each (128-key tiles, 32 keys of
    # each), at D = 64 two heads (128-key tiles, 64 of each); KV heads in twos: two heads (32 keys
    # of each at D = 128); one head (64-key tiles) beyond
    assert splits(1, 16, 4, 8, 128, 2000, page_size=16, requested=10**6) == 63
    assert splits(1, 16, 4, 8, 64, 2000, page_size=16, requested=10**6) == 32
    assert splits(1, 8, 2, 1, 128, 2000, page_size=16, requested=10**6) == 63
    assert splits(1, 32, 4, 8, 128, 2000, page_size=16, requested=10**6) == 32
    assert splits(1, 8, 1, 1, 128, 2000, page_size=16, requested=10**6) == 32
