"""flash_decode on the CPU: its result is flash_attention's on each sequence's gathered cache keys (dense and
paged, shuffled pages, lengths 0 .. capacity, windows), the custom op's registration, and bad calls."""
import doctest

import pytest
import torch

from decode_check import gathered, page_table, to_pages
from helpers import require_sparseattn

sa = require_sparseattn()
import sparseattn.decode as decode  # noqa: E402
from sparseattn.decode import flash_decode, flash_decode_plan  # noqa: E402


def flash_per_sequence(q, k_cache, v_cache, lengths, block_table, causal, window, scale=None):
    """flash_attention on each sequence alone: o [B, Tq, Hq, Dv], lse [B, Hq, Tq]."""
    outs, lses = [], []
    for b, length in enumerate(lengths):
        k = gathered(k_cache, block_table, b, length)[None]
        v = gathered(v_cache, block_table, b, length)[None]
        o, lse = sa.flash_attention(q[b:b + 1], k, v, causal=causal, window=window, scale=scale, return_lse=True)
        outs.append(o)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)


# (B, Tq, Hq, Hkv, Dqk, Dv, S, lengths, causal, window)
CASES = [
    (3, 1, 8, 2, 16, 16, 40, [0, 17, 40], True, (-1, -1)),
    (2, 3, 4, 4, 8, 12, 25, [1, 25], True, (-1, -1)),
    (2, 16, 6, 3, 8, 8, 30, [5, 30], True, (4, 0)),
    (3, 4, 16, 1, 8, 4, 50, [2, 3, 50], False, (-1, -1)),
    (2, 2, 4, 2, 16, 16, 33, [20, 33], True, (6, 2)),
    (1, 5, 2, 1, 8, 8, 9, [9], False, (3, 3)),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "B{}Tq{}H{}-{}D{}-{}S{}c{}w{}".format(*c[:7], c[8], c[9]))
def test_dense_matches_flash_attention(case):
    B, Tq, Hq, Hkv, Dqk, Dv, S, lengths, causal, window = case
    q = torch.randn(B, Tq, Hq, Dqk, dtype=torch.float64)
    k = torch.randn(B, S, Hkv, Dqk, dtype=torch.float64)
    v = torch.randn(B, S, Hkv, Dv, dtype=torch.float64)
    seqlens = torch.tensor(lengths, dtype=torch.int32)
    o, lse = flash_decode(q, k, v, cache_seqlens=seqlens, causal=causal, window=window, return_lse=True)
    o_ref, lse_ref = flash_per_sequence(q, k, v, lengths, None, causal, window)
    torch.testing.assert_close(o, o_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, lse_ref, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("page_size", [1, 2, 5, 16])
@pytest.mark.parametrize("case", CASES[:4], ids=lambda c: "B{}Tq{}H{}-{}D{}-{}S{}".format(*c[:7]))
def test_paged_equals_dense(case, page_size, generator):
    B, Tq, Hq, Hkv, Dqk, Dv, S, lengths, causal, window = case
    q = torch.randn(B, Tq, Hq, Dqk, dtype=torch.float64)
    k = torch.randn(B, S, Hkv, Dqk, dtype=torch.float64)
    v = torch.randn(B, S, Hkv, Dv, dtype=torch.float64)
    seqlens = torch.tensor(lengths, dtype=torch.int32)
    table, num_pages = page_table(B, S, page_size, generator)
    k_pages = to_pages(k, table, num_pages, page_size, generator)
    v_pages = to_pages(v, table, num_pages, page_size, generator)
    dense = flash_decode(q, k, v, cache_seqlens=seqlens, causal=causal, window=window, return_lse=True)
    paged = flash_decode(q, k_pages, v_pages, cache_seqlens=seqlens, block_table=table, causal=causal,
                         window=window, return_lse=True)
    assert torch.equal(dense[0], paged[0]) and torch.equal(dense[1], paged[1])
    ref = flash_per_sequence(q, k_pages, v_pages, lengths, table, causal, window)
    assert torch.equal(paged[0], ref[0]) and torch.equal(paged[1], ref[1])


def test_semantics_example():
    """docs/semantics.md section 8, "Decode against a KV cache": page size 2, block table [[2, 0, 3]], 5 keys."""
    k_pages = torch.tensor([[[0.5, -1.0], [1.0, 0.0]], [[2.0, 1.0], [9.0, 9.0]], [[-1.0, 0.5], [0.0, 2.0]],
                            [[1.5, -0.5], [7.0, 7.0]]], dtype=torch.float64)[:, :, None]
    v_pages = torch.tensor([[[1.0, 0.0], [0.0, 1.0]], [[5.0, 5.0], [9.0, 9.0]], [[2.0, 2.0], [-1.0, 3.0]],
                            [[4.0, -2.0], [7.0, 7.0]]], dtype=torch.float64)[:, :, None]
    table = torch.tensor([[2, 0, 3]], dtype=torch.int32)
    q = torch.tensor([1.0, 0.5], dtype=torch.float64).reshape(1, 1, 1, 2)
    seqlens = torch.tensor([5], dtype=torch.int32)
    for window, o_doc, lse_doc in (((-1, -1), [1.268149, 0.465145], 2.341736),
                                   ((2, 0), [2.075482, -0.591292], 1.975278)):
        o, lse = flash_decode(q, k_pages, v_pages, cache_seqlens=seqlens, block_table=table, window=window,
                              scale=1.0, return_lse=True)
        torch.testing.assert_close(o.flatten(), torch.tensor(o_doc, dtype=torch.float64), rtol=0, atol=5e-7)
        torch.testing.assert_close(lse.flatten(), torch.tensor([lse_doc], dtype=torch.float64), rtol=0, atol=5e-7)


def test_default_lengths_and_scale():
    q, k, v = torch.randn(2, 2, 4, 8), torch.randn(2, 11, 2, 8), torch.randn(2, 11, 2, 8)
    o = flash_decode(q, k, v, scale=0.3)
    full = torch.full((2,), 11, dtype=torch.int32)
    torch.testing.assert_close(o, flash_decode(q, k, v, cache_seqlens=full, scale=0.3), rtol=0, atol=0)
    o_ref, _ = flash_per_sequence(q, k, v, [11, 11], None, True, (-1, -1), scale=0.3)
    torch.testing.assert_close(o, o_ref, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_low_precision_rounds_like_flash_attention(dtype):
    q = torch.randn(2, 3, 4, 16).to(dtype)
    k, v = torch.randn(2, 20, 2, 16).to(dtype), torch.randn(2, 20, 2, 16).to(dtype)
    lengths = [7, 20]
    o, lse = flash_decode(q, k, v, cache_seqlens=torch.tensor(lengths, dtype=torch.int32), return_lse=True)
    o_ref, lse_ref = flash_per_sequence(q, k, v, lengths, None, True, (-1, -1))
    assert o.dtype == dtype and lse.dtype == torch.float32
    assert torch.equal(o, o_ref) and torch.equal(lse, lse_ref)


def test_rows_without_keys():
    """Tq = 3 against 1 key: queries 0 and 1 align before key 0 and keep nothing (o = 0, lse = -inf)."""
    q, k, v = torch.randn(1, 3, 2, 8), torch.randn(1, 4, 1, 8), torch.randn(1, 4, 1, 8)
    o, lse = flash_decode(q, k, v, cache_seqlens=torch.tensor([1], dtype=torch.int32), return_lse=True)
    assert torch.equal(o[0, :2], torch.zeros(2, 2, 8))
    assert torch.isinf(lse[0, :, :2]).all() and (lse[0, :, :2] < 0).all()
    torch.testing.assert_close(o[0, 2], v[0, 0].expand(2, 8))
    o, lse = flash_decode(q, k, v, cache_seqlens=torch.tensor([0], dtype=torch.int32), return_lse=True)
    assert torch.equal(o, torch.zeros_like(o)) and torch.isinf(lse).all()


def test_strided_inputs():
    big = torch.randn(2, 30, 4, 16)
    k, v = big[:, :, ::2], big[:, :, 1::2]
    q = torch.randn(2, 8, 4, 16).transpose(1, 2)[:, :2]  # [2, 2, 8, 16] with a non-contiguous layout
    o = flash_decode(q, k, v, cache_seqlens=torch.tensor([30, 13], dtype=torch.int32))
    o_ref, _ = flash_per_sequence(q.contiguous(), k.contiguous(), v.contiguous(), [30, 13], None, True, (-1, -1))
    torch.testing.assert_close(o, o_ref, rtol=0, atol=0)


def test_custom_op_registration():
    assert hasattr(torch.ops.sparseattn, "flash_decode")
    q, k, v = torch.randn(2, 2, 4, 8), torch.randn(2, 9, 2, 8), torch.randn(2, 9, 2, 4)
    seqlens = torch.tensor([3, 9], dtype=torch.int32)
    torch.library.opcheck(torch.ops.sparseattn.flash_decode.default, (q, k, v, seqlens, None, True, -1, -1, None, 0))
    pages, table = torch.randn(5, 4, 2, 8), torch.tensor([[4, 0, 2], [1, 3, 0]], dtype=torch.int32)
    torch.library.opcheck(torch.ops.sparseattn.flash_decode.default,
                          (q, pages, pages[..., :4], seqlens, table, True, 2, 0, 0.5, 0))
    with torch._subclasses.fake_tensor.FakeTensorMode():
        o, lse = decode.flash_decode_op(torch.empty(3, 1, 6, 8), torch.empty(3, 9, 2, 8), torch.empty(3, 9, 2, 4),
                                        None, None, True, -1, -1, None, 0)
        assert tuple(o.shape) == (3, 1, 6, 4) and tuple(lse.shape) == (3, 6, 1)


def test_plan_on_cpu():
    q, k = torch.randn(1, 1, 4, 8), torch.randn(1, 100, 1, 8)
    assert flash_decode_plan(q, k, k) == (1, 0)
    assert flash_decode_plan(q, k, k, num_splits=7) == (1, 0)


def test_docstring_examples_run():
    finder = doctest.DocTestFinder(exclude_empty=True)
    runner = doctest.DocTestRunner(optionflags=doctest.NORMALIZE_WHITESPACE | doctest.ELLIPSIS)
    for test in finder.find(decode, "sparseattn.decode"):
        runner.run(test)
    result = runner.summarize(verbose=False)
    assert result.attempted > 0 and result.failed == 0


def test_docstring_sections():
    for fn in (flash_decode, flash_decode_plan):
        for section in ("Args:", "Returns:", "Raises:", "Example:"):
            assert section in fn.__doc__, f"{fn.__name__} lacks {section}"


# ------------------------------------------------------------------------------------------------- bad calls


def _call(q=None, k=None, v=None, **kwargs):
    q = torch.randn(2, 1, 4, 8) if q is None else q
    k = torch.randn(2, 10, 2, 8) if k is None else k
    v = torch.randn(2, 10, 2, 8) if v is None else v
    return flash_decode(q, k, v, **kwargs)


def _raises(cls, argument, fn, match=None):
    with pytest.raises(cls, match=match) as info:
        fn()
    assert info.value.op == "flash_decode" and info.value.argument == argument, str(info.value)
    return info.value


def test_bad_shapes():
    _raises(sa.SparseAttnError, "q", lambda: _call(q=torch.randn(2, 17, 4, 8)), match="1 to 16")
    _raises(sa.SparseAttnError, "q", lambda: _call(q=torch.randn(2, 0, 4, 8)), match="1 to 16")
    _raises(sa.SparseAttnError, "q", lambda: _call(q=torch.randn(2, 4, 8)), match="4 dimensions")
    _raises(sa.SparseAttnError, "k_cache", lambda: _call(k=torch.randn(2, 10, 3, 8), v=torch.randn(2, 10, 3, 8)),
            match="divide")
    _raises(sa.SparseAttnError, "k_cache", lambda: _call(k=torch.randn(3, 10, 2, 8)), match="expected shape")
    _raises(sa.SparseAttnError, "k_cache", lambda: _call(k=torch.randn(2, 10, 2, 6)), match="expected shape")
    _raises(sa.SparseAttnError, "v_cache", lambda: _call(v=torch.randn(2, 9, 2, 8)), match="expected shape")
    _raises(sa.SparseAttnError, "k_cache", lambda: _call(k=torch.randn(10, 2, 8)), match="4 dimensions")
    _raises(sa.SparseAttnError, "cache_seqlens",
            lambda: _call(cache_seqlens=torch.tensor([1, 2, 3], dtype=torch.int32)), match="expected shape")


def test_bad_paged_calls():
    pages = torch.randn(6, 4, 2, 8)
    table = torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=torch.int32)
    seqlens = torch.tensor([12, 5], dtype=torch.int32)
    _raises(sa.SparseAttnError, "cache_seqlens", lambda: _call(k=pages, v=pages, block_table=table),
            match="required with a paged cache")
    _raises(sa.SparseAttnError, "block_table",
            lambda: _call(k=pages, v=pages, block_table=table[:1], cache_seqlens=seqlens), match=r"\[B, max_pages\]")
    _raises(sa.SparseAttnDTypeError, "block_table",
            lambda: _call(k=pages, v=pages, block_table=table.long(), cache_seqlens=seqlens), match="int32")
    err = _raises(sa.SparseAttnError, "cache_seqlens",
                  lambda: _call(k=pages, v=pages, block_table=table, cache_seqlens=torch.tensor([13, 5],
                                                                                                dtype=torch.int32)),
                  match=r"outside \[0, 12\]")
    assert err.kind == "value"
    bad = table.clone()
    bad[1, 1] = 6  # sequence 1 (5 keys) reads entries 0 and 1
    err = _raises(sa.SparseAttnError, "block_table",
                  lambda: _call(k=pages, v=pages, block_table=bad, cache_seqlens=seqlens), match=r"\[1, 1\] is 6")
    assert err.kind == "value"
    unused = table.clone()
    unused[1, 2] = -7  # past sequence 1's keys: never read
    _call(k=pages, v=pages, block_table=unused, cache_seqlens=seqlens)


def test_bad_values_and_types():
    _raises(sa.SparseAttnError, "cache_seqlens",
            lambda: _call(cache_seqlens=torch.tensor([-1, 2], dtype=torch.int32)), match="outside")
    _raises(sa.SparseAttnDTypeError, "cache_seqlens", lambda: _call(cache_seqlens=torch.tensor([1, 2])),
            match="int32")
    _raises(sa.SparseAttnDTypeError, "k_cache", lambda: _call(k=torch.randn(2, 10, 2, 8, dtype=torch.float64)))
    _raises(sa.SparseAttnError, "num_splits", lambda: _call(num_splits=-1))
    _raises(sa.SparseAttnTypeError, "num_splits", lambda: _call(num_splits=1.5))
    _raises(sa.SparseAttnTypeError, "window", lambda: _call(window=5))
    _raises(sa.SparseAttnTypeError, "causal", lambda: _call(causal="yes"))
    _raises(sa.SparseAttnError, "scale", lambda: _call(scale=-1.0))
    _raises(sa.SparseAttnTypeError, "block_table", lambda: _call(block_table=[[0]]))
    _raises(sa.SparseAttnDTypeError, "q", lambda: _call(q=torch.ones(2, 1, 4, 8, dtype=torch.int32)))
    _raises(sa.SparseAttnError, "k_cache", lambda: _call(k=torch.randn(2, 10, 2, 8, device="meta")),
            match="is on meta")
