"""The chunked long-sequence reference (torch_nsa_fp32.py) on the CPU at small T, before it is trusted as the
oracle of test_cuda_nsa_long.py: in float64 it must equal the naive oracle (naive_nsa.py) for every chunk size,
and with bf16-stored data it must compute what sparseattn's CPU reference computes (compressed K/V rounded
to bf16, the same selection)."""

import dataclasses

import pytest
import torch

import naive_nsa as nv
import torch_nsa_fp32 as chunked
from helpers import assert_close, assert_close64, grads, leaf_clones, require_sparseattn

sa = require_sparseattn()

CONFIGS = {
    "l16-d8-sel32": nv.Config(cmp_block=16, cmp_stride=8, sel_block=32, num_selected=4, num_init=1, num_local=2,
                              window=40),
    "l32-d16-sel64": nv.Config(cmp_block=32, cmp_stride=16, sel_block=64, num_selected=3, num_init=1, num_local=1,
                               window=100),
    "fla-l16-d16-sel16": nv.Config(cmp_block=16, cmp_stride=16, sel_block=16, num_selected=5, num_init=2,
                                   num_local=1, window=17),
}
# (config, T, Hq, Hkv, Dqk, Dv, chunk); chunk 37 divides neither T nor a block and is shorter than the window
CASES = [
    ("l16-d8-sel32", 300, 4, 2, 16, 8, 37),
    ("l16-d8-sel32", 300, 4, 2, 16, 8, 300),
    ("l32-d16-sel64", 300, 3, 1, 24, 16, 64),
    ("fla-l16-d16-sel16", 130, 2, 2, 8, 8, 16),
    ("l16-d8-sel32", 12, 2, 1, 8, 8, 5),  # shorter than one compressed block: the compressed branch is empty
]


def random_inputs(B, T, Hq, Hkv, Dqk, Dv, dtype=torch.float64):
    return [torch.randn(B, T, Hq, Dqk, dtype=dtype), torch.randn(B, T, Hkv, Dqk, dtype=dtype),
            torch.randn(B, T, Hkv, Dv, dtype=dtype), *torch.rand(3, B, T, Hq, dtype=dtype)]


def naive_branch_lses(q, k, v, indices, cfg):
    """lse [B, Hq, T] of the selected and sliding-window branches of the naive oracle."""
    _, lse_slc = nv.selected_attention(q, k, v, indices, block=cfg.sel_block, scale=cfg.scale)
    _, lse_swa = nv.flash_attention(q, k, v, causal=True, window=(cfg.window - 1, 0), scale=cfg.scale,
                                    return_lse=True)
    return lse_slc, lse_swa


@pytest.mark.parametrize("config,T,Hq,Hkv,Dqk,Dv,chunk", CASES)
def test_float64_equals_naive(config, T, Hq, Hkv, Dqk, Dv, chunk):
    cfg = CONFIGS[config]
    inputs = random_inputs(2, T, Hq, Hkv, Dqk, Dv)
    naive_leaves, leaves = leaf_clones(*inputs), leaf_clones(*inputs)
    o_ref, extras = nv.nsa_attention(*naive_leaves, config=cfg, return_extras=True)
    idx_ref = torch.stack([e["indices"] for e in extras])

    selection = chunked.reference_selection(*inputs[:2], cfg, chunk=chunk, compute_dtype=torch.float64)
    assert torch.equal(selection.indices, idx_ref)
    result = chunked.nsa_reference(*leaves, cfg, chunk=chunk, compute_dtype=torch.float64)
    assert_close64(result.o, o_ref, name="o")
    assert_close64(result.lse_cmp, torch.stack([e["lse_cmp"] for e in extras]), name="lse_cmp")
    for name, got, ref in zip(("lse_slc", "lse_swa"), (result.lse_slc, result.lse_swa),
                              naive_branch_lses(*inputs[:3], idx_ref, cfg)):
        assert_close64(got, ref, name=name)

    d_o = torch.randn_like(o_ref)
    for name, got, ref in zip(("dq", "dk", "dv", "dg_cmp", "dg_slc", "dg_swa"), grads(result.o, leaves, d_o),
                              grads(o_ref, naive_leaves, d_o)):
        assert_close64(got, ref, name=name)


def test_skipped_branches_and_given_indices_equal_naive():
    cfg = CONFIGS["l16-d8-sel32"]
    q, k, v, _, g_slc, g_swa = random_inputs(1, 200, 4, 1, 16, 16)
    idx = nv.nsa_indices(q, k, v, cfg)
    past_the_end = 1 << 20
    thinned = torch.where(torch.rand(idx.shape) < 0.3, past_the_end, idx.masked_fill(idx < 0, past_the_end))
    thinned = thinned.sort(dim=-1).values
    idx = thinned.masked_fill(thinned == past_the_end, -1)  # ascending, -1 at the tail
    naive_leaves, leaves = leaf_clones(q, k, v, g_slc, g_swa), leaf_clones(q, k, v, g_slc, g_swa)
    o_ref = nv.nsa_attention(*naive_leaves[:3], None, *naive_leaves[3:], config=cfg, block_indices=idx)
    result = chunked.nsa_reference(*leaves[:3], None, *leaves[3:], cfg, block_indices=idx, chunk=64,
                                   compute_dtype=torch.float64)
    assert result.lse_cmp is None
    assert_close64(result.o, o_ref, name="o")
    d_o = torch.randn_like(o_ref)
    for i, (got, ref) in enumerate(zip(grads(result.o, leaves, d_o), grads(o_ref, naive_leaves, d_o))):
        assert_close64(got, ref, name=f"grad[{i}]")


def test_scores_and_margin():
    """Scores equal the naive oracle's; the margin is (weakest block chosen by score - best candidate left
    out) / the former, recomputed here row by row."""
    cfg = CONFIGS["l16-d8-sel32"]
    q, k, v = random_inputs(1, 300, 4, 2, 16, 16)[:3]
    sel = chunked.reference_selection(q, k, cfg, chunk=50, compute_dtype=torch.float64)
    k_cmp, _ = nv.compress_kv(k, v, cfg.cmp_block, cfg.cmp_stride)
    _, lse = nv.compressed_attention(q, k_cmp, k_cmp, cfg.cmp_block, cfg.cmp_stride)
    scores = nv.selection_scores(q, k_cmp, lse, cfg.cmp_block, cfg.cmp_stride, cfg.sel_block)
    assert_close64(sel.scores, scores, name="scores")
    competing_rows = 0
    for t in range(q.shape[1]):
        current = t // cfg.sel_block
        forced = set(range(cfg.num_init)) | set(range(current - cfg.num_local + 1, current + 1))
        for h in range(k.shape[2]):
            row = scores[0, h, t]
            chosen = {int(b) for b in sel.indices[0, t, h] if b >= 0}
            by_score = [row[b].item() for b in chosen - forced]
            left_out = [row[b].item() for b in range(current + 1) if b not in chosen]
            if not by_score or not left_out:
                assert sel.margin[0, t, h] == float("inf")
                continue
            competing_rows += 1
            weakest, best_out = min(by_score), max(left_out)
            assert weakest >= best_out
            assert sel.margin[0, t, h].item() == pytest.approx((weakest - best_out) / weakest, rel=1e-9, abs=1e-15)
    assert competing_rows == 2 * (300 - 4 * 32)  # rows with more candidates than slots


def test_equal_scores_go_to_the_lower_block():
    cfg = nv.Config(sel_block=4, num_selected=4, num_init=1, num_local=1)
    T, nsel = 40, 10
    scores = torch.zeros(2, T, nsel, dtype=torch.float64)
    scores[1, :, 7] = 1.0  # head 1: block 7 wins once it is a candidate, the rest tie
    positions = torch.arange(T)
    indices, margin = chunked._top_n(scores.transpose(0, 1), positions, cfg)
    expected = nv.select_from_scores(scores, cfg.sel_block, cfg.num_selected, cfg.num_init, cfg.num_local)
    assert torch.equal(indices, expected)
    assert indices[39, 0].tolist() == [0, 1, 2, 9]  # forced 0 and 9, then the lowest tied blocks 1 and 2
    assert indices[39, 1].tolist() == [0, 1, 7, 9]
    assert margin[39].tolist() == [0.0, 0.0]  # the last slot is a tie of 0 scores (0 / 0 counts as 0)
    assert margin[3].tolist() == [float("inf")] * 2  # only block 0 is a candidate: nothing competes


def test_bf16_storage_computes_what_sparseattn_computes():
    """bf16 data held in float64 leaves with storage_dtype bf16: compressed K/V equal compress_kv's bf16 output
    bit for bit, the selection equals select_blocks' on the bf16 data, and output and gradients equal the
    float64 CPU reference fed those rounded compressed K/V (the rounding passes the gradient through)."""
    cfg = CONFIGS["l16-d8-sel32"]
    sa_config = sa.NSAConfig(**dataclasses.asdict(cfg))
    inputs = [x.to(torch.bfloat16) for x in random_inputs(1, 300, 4, 2, 16, 16)]
    k_cmp, v_cmp = sa.compress_kv(inputs[1], inputs[2], block=cfg.cmp_block, stride=cfg.cmp_stride)
    wide = [x.double() for x in inputs]
    assert torch.equal(chunked.compress(wide[1][0], cfg.cmp_block, cfg.cmp_stride, torch.bfloat16), k_cmp[0].double())
    assert torch.equal(chunked.compress(wide[2][0], cfg.cmp_block, cfg.cmp_stride, torch.bfloat16), v_cmp[0].double())

    _, lse = sa.compressed_attention(inputs[0], k_cmp, v_cmp, block=cfg.cmp_block, stride=cfg.cmp_stride)
    idx = sa.select_blocks(inputs[0], k_cmp, lse, cmp_block=cfg.cmp_block, cmp_stride=cfg.cmp_stride,
                           sel_block=cfg.sel_block, num_selected=cfg.num_selected, num_init=cfg.num_init,
                           num_local=cfg.num_local)
    selection = chunked.reference_selection(*wide[:2], cfg, storage_dtype=torch.bfloat16, chunk=64,
                                            compute_dtype=torch.float64)
    assert torch.equal(selection.indices, idx)

    def rounded_compression(k, v):
        """compress_kv in float64 with the values of its bf16 output and the gradient of the mean."""
        exact = sa.compress_kv(k, v, block=cfg.cmp_block, stride=cfg.cmp_stride)
        return [e + (r.double() - e).detach() for e, r in zip(exact, (k_cmp, v_cmp))]

    sa_leaves, leaves = leaf_clones(*wide), leaf_clones(*wide)
    o_sa = sa.nsa_attention(*sa_leaves, config=sa_config, k_cmp=rounded_compression(*sa_leaves[1:3])[0],
                            v_cmp=rounded_compression(*sa_leaves[1:3])[1])
    result = chunked.nsa_reference(*leaves, cfg, storage_dtype=torch.bfloat16, chunk=64, compute_dtype=torch.float64)
    assert_close64(result.o, o_sa, name="o")
    d_o = torch.randn_like(o_sa)
    for name, got, ref in zip(("dq", "dk", "dv", "dg_cmp", "dg_slc", "dg_swa"), grads(result.o, leaves, d_o),
                              grads(o_sa, sa_leaves, d_o)):
        assert_close64(got, ref, name=name)
