"""The gate threshold as a tile map (sparseattn._tiles.from_gate_threshold, which the CUDA path of flash_attention
passes to the kernels as a block-sparse mask): on the CPU, attention with that map equals the CPU reference's own
gate threshold (forward, and the gradients batched), batched and packed, both gates, tiles of several sizes."""
import pytest
import torch

import sparseattn
from sparseattn import _tiles


def gates(shape_alpha, shape_delta, key_dim):
    """alpha >= 1 and delta <= -1 on the first half of the keys, >= 1 on the rest: the pairs of the first half have
    g <= logsigmoid(-1) (product: <= -1) and are skipped at the thresholds below, the others kept."""
    alpha = 1 + torch.randn(shape_alpha, dtype=torch.float64).abs()
    delta = 1 + torch.randn(shape_delta, dtype=torch.float64).abs()
    half = shape_delta[key_dim] // 2
    delta.narrow(key_dim, 0, half).neg_()
    return alpha, delta


def cu(lengths):
    return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)


@pytest.mark.parametrize("gate", ["logsigmoid", "product"])
@pytest.mark.parametrize("tiles", [(4, 4), (3, 5), (8, 2)])
@pytest.mark.parametrize("causal", [False, True])
def test_batched_map_equals_the_reference(gate, tiles, causal):
    torch.manual_seed(0)
    B, T, S, Hq, Hkv, D = 2, 13, 17, 4, 2, 8
    q, k, v = torch.randn(B, T, Hq, D, dtype=torch.float64), torch.randn(B, S, Hkv, D, dtype=torch.float64), \
        torch.randn(B, S, Hkv, D, dtype=torch.float64)
    alpha, delta = gates((B, T, Hq), (B, S, Hkv), 1)
    threshold = -1.2 if gate == "logsigmoid" else -0.5
    bq, bk = tiles
    n_q, n_k = -(-T // bq), -(-S // bk)
    states = _tiles.from_gate_threshold(alpha, delta, threshold, gate == "product", bq, bk, n_q, n_k, B)
    assert states.shape == (B, Hq, n_q, n_k)
    assert 0 < int(states.sum()) < states.numel()  # some pairs skipped, some kept: the test can fail
    d_o = torch.randn(B, T, Hq, D, dtype=torch.float64)

    def run(**extra):
        leaves = [t.clone().requires_grad_() for t in (q, k, v, alpha, delta)]
        o = sparseattn.flash_attention(*leaves[:3], causal=causal, alpha=leaves[3], delta=leaves[4], gate=gate,
                                       **extra)
        return [o] + list(torch.autograd.grad(o, leaves, d_o))

    ref = run(gate_threshold=threshold, threshold_block=tiles)
    got = run(block_mask=states.bool(), block_size=tiles)
    for name, g, r in zip(("o", "dq", "dk", "dv", "dalpha", "ddelta"), got, ref):
        torch.testing.assert_close(g, r, rtol=0, atol=1e-12, msg=name)


@pytest.mark.parametrize("gate", ["logsigmoid", "product"])
def test_packed_map_equals_the_reference(gate):
    torch.manual_seed(1)
    lengths_q, lengths_k = [0, 9, 4, 12], [3, 11, 0, 14]
    Hq, Hkv, D, bq, bk = 4, 1, 8, 4, 3
    Nq, Nk = sum(lengths_q), sum(lengths_k)
    q, k, v = (torch.randn(n, h, D, dtype=torch.float64) for n, h in ((Nq, Hq), (Nk, Hkv), (Nk, Hkv)))
    alpha, delta = gates((Nq, Hq), (Nk, Hkv), 0)
    threshold = -1.2 if gate == "logsigmoid" else -0.5
    cq, ck = cu(lengths_q), cu(lengths_k)
    n_q, n_k = -(-max(lengths_q) // bq), -(-max(lengths_k) // bk)
    states = _tiles.from_gate_threshold(alpha, delta, threshold, gate == "product", bq, bk, n_q, n_k,
                                        len(lengths_q), cq, ck)
    assert 0 < int(states.sum()) < states.numel()
    common = dict(alpha=alpha, delta=delta, gate=gate, cu_seqlens_q=cq, cu_seqlens_k=ck)
    ref = sparseattn.flash_attention(q, k, v, gate_threshold=threshold, threshold_block=(bq, bk), **common)
    got = sparseattn.flash_attention(q, k, v, block_mask=states.bool(), block_size=(bq, bk), **common)
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-12)


def test_keep_where_makes_skipped_pairs_absent():
    states = torch.tensor([[[[1, 2], [0, 1]]]], dtype=torch.uint8)  # [1, 1, 2, 2]: one head, shared
    kept = torch.tensor([[[[1, 0], [1, 1]], [[0, 1], [1, 0]]]], dtype=torch.uint8)  # [1, 2, 2, 2]
    out = _tiles.keep_where(states, kept)
    assert out.tolist() == [[[[1, 0], [0, 1]], [[0, 2], [0, 0]]]]
