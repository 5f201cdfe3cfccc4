"""The tile-state maps that flash_attention's CUDA path reads (python/sparseattn/_tiles.py), checked on the CPU
against loops over the tiles, and through the CPU reference: a map built from a mask or from lists gives the same
attention as the mask or the lists themselves."""
import itertools

import pytest
import torch

import sparseattn
from sparseattn import _tiles


def _ceil(a, b):
    return -(-a // b)


def _random_lists(gen, lead, n_q, n_k, max_k):
    counts = torch.randint(0, max_k + 1, (*lead, n_q), generator=gen, dtype=torch.int32)
    indices = torch.full((*lead, n_q, max_k), -7, dtype=torch.int32)  # past the count: ignored
    for pos in itertools.product(*(range(d) for d in lead), range(n_q)):
        chosen = torch.randperm(n_k, generator=gen)[: int(counts[pos])].sort().values
        indices[pos][: len(chosen)] = chosen.int()
        counts[pos] = len(chosen)
    return counts, indices


def test_from_lists_matches_a_loop():
    gen = torch.Generator().manual_seed(0)
    lead, n_q, n_k = (2, 3), 4, 6
    counts, indices = _random_lists(gen, lead, n_q, n_k, 3)
    full_counts, full_indices = _random_lists(gen, lead, n_q, n_k, 2)
    states = _tiles.from_lists(counts, indices, full_counts, full_indices, n_k)
    assert states.dtype == torch.uint8 and states.shape == (*lead, n_q, n_k)
    expected = torch.zeros(*lead, n_q, n_k, dtype=torch.uint8)
    for pos in itertools.product(*(range(d) for d in lead), range(n_q)):
        for j in indices[pos][: int(counts[pos])].tolist():
            expected[pos][j] = 1
        for j in full_indices[pos][: int(full_counts[pos])].tolist():
            expected[pos][j] = 2
    assert torch.equal(states, expected)


def test_from_lists_drops_entries_out_of_range():
    counts = torch.tensor([[[2, 1]]], dtype=torch.int32)
    indices = torch.tensor([[[[0, 9], [-1, 1]]]], dtype=torch.int32)
    states = _tiles.from_lists(counts, indices, None, None, 3)
    assert states.tolist() == [[[[1, 0, 0], [0, 0, 0]]]]


@pytest.mark.parametrize("rows,keys,bq,bk,mask_rows", [(13, 21, 4, 8, 13), (16, 16, 4, 4, 1), (5, 37, 8, 16, 5)])
def test_from_mask_matches_a_loop(rows, keys, bq, bk, mask_rows):
    gen = torch.Generator().manual_seed(rows * keys)
    mask = torch.rand(2, 3, mask_rows, keys, generator=gen) < 0.5
    mask[0, 0, :, :bk] = False  # an all-False tile column
    mask[1, 2, :, -bk:] = True  # an all-True one
    n_q, n_k = _ceil(rows, bq), _ceil(keys, bk)
    states = _tiles.from_mask(mask, bq, bk, n_q, n_k)
    assert states.shape == (2, 3, n_q, n_k)
    for b, h, i, j in itertools.product(range(2), range(3), range(n_q), range(n_k)):
        r0, r1 = (0, 1) if mask_rows == 1 else (i * bq, min(rows, (i + 1) * bq))
        tile = mask[b, h, r0:r1, j * bk: min(keys, (j + 1) * bk)]
        expected = 2 if bool(tile.all()) else 1 if bool(tile.any()) else 0
        assert int(states[b, h, i, j]) == expected, (b, h, i, j)
    assert int(states[0, 0, 0, 0]) == 0
    assert int(states[1, 2, 0, n_k - 1]) == 2 or keys % bk != 0


def test_combine_keeps_absent_and_full_and_repeats_kv_heads():
    given = torch.tensor([0, 1, 2, 1], dtype=torch.uint8).view(1, 1, 2, 2).repeat(1, 2, 1, 1)  # Hkv = 2
    summary = torch.tensor([2, 0, 1, 2], dtype=torch.uint8).view(1, 1, 2, 2).repeat(1, 4, 1, 1)  # Hq = 4
    summary[:, 3] = 1
    combined = _tiles.combine(given, summary)
    assert combined.shape == (1, 4, 2, 2)
    assert combined[0, 0].flatten().tolist() == [0, 0, 2, 2]
    assert combined[0, 3].flatten().tolist() == [0, 1, 2, 1]


@pytest.mark.parametrize("mask_shape", [(2, 4, 19, 23), (1, 1, 1, 23), (2, 2, 19, 23)])
def test_summary_of_a_mask_gives_the_same_attention(mask_shape):
    # On the CPU the reference applies the element mask itself; a bool tile mask made from the summary
    # (absent where every element is False) must not change the result.
    gen = torch.Generator().manual_seed(1)
    q, k, v = torch.randn(2, 19, 4, 16, generator=gen), torch.randn(2, 23, 2, 16, generator=gen), torch.randn(
        2, 23, 2, 8, generator=gen)
    mask = torch.rand(mask_shape, generator=gen) < 0.3
    mask[..., :8] = False
    bq, bk = 4, 8
    states = _tiles.from_mask(mask, bq, bk, _ceil(19, bq), _ceil(23, bk))
    assert (states == 0).any()
    o_mask, lse_mask = sparseattn.flash_attention(q, k, v, mask=mask, causal=True, return_lse=True)
    o_tiles, lse_tiles = sparseattn.flash_attention(q, k, v, mask=mask, causal=True, return_lse=True,
                                                    block_mask=(states > 0), block_size=(bq, bk))
    torch.testing.assert_close(o_tiles, o_mask, rtol=0, atol=0)
    torch.testing.assert_close(lse_tiles, lse_mask, rtol=0, atol=0)


def test_map_of_lists_gives_the_same_attention():
    gen = torch.Generator().manual_seed(2)
    q, k, v = torch.randn(2, 17, 4, 16, generator=gen), torch.randn(2, 17, 4, 16, generator=gen), torch.randn(
        2, 17, 4, 16, generator=gen)
    bq = bk = 4
    n = _ceil(17, 4)
    counts, indices = _random_lists(gen, (2, 4), n, n, 3)
    o_lists = sparseattn.flash_attention(q, k, v, kv_num_blocks=counts, kv_indices=indices, block_size=(bq, bk))
    states = _tiles.from_lists(counts, indices, None, None, n)
    o_map = sparseattn.flash_attention(q, k, v, block_mask=(states > 0), block_size=(bq, bk))
    torch.testing.assert_close(o_map, o_lists, rtol=0, atol=0)
