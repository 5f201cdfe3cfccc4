"""flash_attention's uint8 tile-state map (CPU reference, through sparseattn._ops, which takes it as it is):
0 absent, 1 exists, 2 exists and full (the element mask is not read), docs/semantics.md section 8. The same
results as the bool map and the FlexAttention lists with full tiles; out-of-range states are errors."""

import pytest
import torch

from helpers import require_sparseattn

sa = require_sparseattn()
from sparseattn import _ops  # noqa: E402


def call(q, k, v, mask, block_mask=None, lists=(None, None, None, None), block=(0, 0), causal=False):
    return _ops.flash_attention(q, k, v, mask, None, None, None, 0, 0, causal, -1, -1, None,
                                block_mask=block_mask, kv_num_blocks=lists[0], kv_indices=lists[1],
                                full_kv_num_blocks=lists[2], full_kv_indices=lists[3], block_q=block[0],
                                block_k=block[1])


def lists_of(tiles):
    """Tiles [..., nQ, nK] (bool) as (counts, indices) with maxK = nK (entries past the count: 0)."""
    nk = tiles.shape[-1]
    counts = tiles.sum(-1).to(torch.int32)
    order = torch.where(tiles, torch.arange(nk), nk + torch.arange(nk)).argsort(dim=-1).to(torch.int32)
    return counts, torch.where(torch.arange(nk) < counts[..., None], order, torch.zeros_like(order))


@pytest.mark.parametrize("causal", [False, True])
def test_uint8_states_match_bool_map_and_lists(causal):
    B, T, S, Hq, Hkv, D, bq, bk = 2, 23, 30, 4, 2, 8, 6, 7
    q = torch.randn(B, T, Hq, D, dtype=torch.float64)
    k = torch.randn(B, S, Hkv, D, dtype=torch.float64)
    v = torch.randn(B, S, Hkv, D, dtype=torch.float64)
    mask = torch.rand(B, Hq, T, S) < 0.7
    states = torch.randint(0, 3, (B, Hkv, 4, 5), dtype=torch.uint8)
    o, lse = call(q, k, v, mask, states, block=(bq, bk), causal=causal)
    # A full tile (2) keeps its keys whatever the element mask says there: the bool map with the mask set there.
    full = (states == 2).repeat_interleave(Hq // Hkv, dim=1)
    rows, cols = torch.arange(T) // bq, torch.arange(S) // bk
    mask_full = mask | full[:, :, rows][..., cols]
    o_bool, lse_bool = call(q, k, v, mask_full, states != 0, block=(bq, bk), causal=causal)
    torch.testing.assert_close(o, o_bool)
    torch.testing.assert_close(lse, lse_bool)
    # FlexAttention's lists: partial tiles in kv_indices, full ones in full_kv_indices.
    partial_counts, partial_indices = lists_of(states == 1)
    full_counts, full_indices = lists_of(states == 2)
    o_lists, lse_lists = call(q, k, v, mask, lists=(partial_counts, partial_indices, full_counts, full_indices),
                              block=(bq, bk), causal=causal)
    torch.testing.assert_close(o, o_lists)
    torch.testing.assert_close(lse, lse_lists)


def test_uint8_states_gradients_match_bool_map():
    B, T, S, H, D, bq, bk = 1, 12, 17, 2, 8, 4, 5
    q, k, v = (torch.randn(B, n, H, D, dtype=torch.float64, requires_grad=True) for n in (T, S, S))
    states = torch.tensor([[[[1, 0, 2, 1], [0, 0, 0, 0], [2, 2, 1, 0]]]], dtype=torch.uint8).expand(B, H, 3, 4)
    o, _ = call(q, k, v, None, states, block=(bq, bk))
    o_bool, _ = call(q, k, v, None, states != 0, block=(bq, bk))
    d_o = torch.randn_like(o)
    grads = torch.autograd.grad(o, (q, k, v), d_o)
    grads_bool = torch.autograd.grad(o_bool, (q, k, v), d_o)
    for g, r in zip(grads, grads_bool):
        torch.testing.assert_close(g, r)


def test_uint8_state_out_of_range_is_an_error():
    q = torch.randn(1, 8, 1, 8, dtype=torch.float64)
    states = torch.ones(1, 1, 2, 2, dtype=torch.uint8)
    states[0, 0, 1, 0] = 3
    with pytest.raises(sa.SparseAttnError, match="block_mask") as info:
        call(q, q, q, None, states, block=(4, 4))
    assert "2 (full)" in str(info.value)


def test_other_integer_maps_are_dtype_errors():
    q = torch.randn(1, 8, 1, 8, dtype=torch.float64)
    with pytest.raises(sa.SparseAttnDTypeError, match="block_mask"):
        call(q, q, q, None, torch.ones(1, 1, 2, 2, dtype=torch.int32), block=(4, 4))
