"""The flash-sparse benchmark (python -m sparseattn.bench_flash) without a GPU: arguments, the block-sparse tile
mask generator and its BlockMask, the derived numbers and bars, the reports from a synthetic result set and from
a saved JSON, and a tiny smoke run of every section on the CPU reference."""
import argparse
import json

import pytest
import torch

from helpers import require_sparseattn

sa = require_sparseattn()
from sparseattn import bench_flash as bf  # noqa: E402

META = {"gpu": "NVIDIA H100 80GB HBM3", "date": "2026-01-02", "commit": "abc1234", "torch": "2.11",
        "dtype": "bfloat16", "head_dim": 128, "device": "cuda", "density": 0.1, "tile": 128, "seed": 0,
        "peak_hbm_bytes_per_s": 3.35e12}
ARGS = bf.parse_args([])
UNSUPPORTED = "unsupported: sparseattn.flash_attention: argument 'bias': no CUDA kernel"


def synthetic(section, text, times, errors=None, memory=None):
    result = bf.new_result(section, bf.CaseSpec.parse(text), ARGS)
    result["times_ms"].update(times)
    result["peak_memory_gb"].update(memory or {})
    for key, reason in (errors or {}).items():
        result["times_ms"][key] = None
        result["errors"][key] = reason
    return bf.summarize(result, META["peak_hbm_bytes_per_s"])


RESULTS = [
    synthetic("dense", "32/8:8K", {"sparseattn_fwd": 2.0, "sparseattn_fwd_bwd": 8.0, "sdpa_cudnn_fwd": 1.0,
                                   "sdpa_cudnn_fwd_bwd": 6.0, "sdpa_flash_fwd": 1.5, "sdpa_flash_fwd_bwd": 7.0},
              memory={"sparseattn": 0.5, "sdpa_cudnn": 0.25}),
    synthetic("block_sparse", "32/8:32K", {"sparseattn_fwd": 40.0, "sparseattn_fwd_bwd": 100.0,
                                           "sparseattn_blockmask_fwd": 5.0, "sparseattn_blockmask_fwd_bwd": 20.0,
                                           "flex_fwd": 6.0, "flex_fwd_bwd": 25.0},
              errors={"sparseattn_tiles_fwd": UNSUPPORTED, "sparseattn_tiles_fwd_bwd": UNSUPPORTED}),
    synthetic("bias", "32/8:16K", {"sparseattn_fwd": 10.0, "sparseattn_fwd_bwd": 40.0, "sparseattn_bias_fwd": 12.0,
                                   "sparseattn_bias_fwd_bwd": 52.0, "sdpa_bias_fwd": 50.0}),
    synthetic("gated", "32/8:16K", {"sparseattn_fwd": 10.0, "sparseattn_fwd_bwd": 40.0}, errors={
        "sparseattn_gated_fwd": UNSUPPORTED, "sparseattn_gated_fwd_bwd": UNSUPPORTED}),
    synthetic("decode", "32/8:128K:32", {"sparseattn_fwd": 10.0, "sdpa_flash_fwd": 6.7}),
    synthetic("decode", "64/4:128K", {}, errors={"case": "skipped: time budget exhausted"}),
]


def rows_of(text, prefix):
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in text.splitlines()
            if line.startswith(f"| {prefix}")]


def test_arguments():
    assert [(s, [c.label() for c in getattr(ARGS, s)]) for s in bf.SECTIONS] == [
        ("dense", ["32/8, T=8K, B=1", "32/8, T=16K, B=1", "64/4, T=8K, B=1"]),
        ("block_sparse", ["32/8, T=32K, B=1"]), ("bias", ["32/8, T=16K, B=1"]), ("gated", ["32/8, T=16K, B=1"]),
        ("decode", ["32/8, T=128K, B=1", "32/8, T=128K, B=32", "64/4, T=128K, B=1", "64/4, T=128K, B=32"])]
    assert (ARGS.head_dim, ARGS.dtype, ARGS.density, ARGS.tile, ARGS.decode_queries, ARGS.device, ARGS.flex,
            ARGS.out, ARGS.time_budget_s) == (128, "bfloat16", 0.1, 128, 1, "cuda", True, "bench/results", None)
    args = bf.parse_args(["--dense", "64/4:4K:2", "--gated", "--block-sparse", "--decode", "32/8:131072",
                          "--no-flex", "--device", "cpu", "--density", "0.25", "--time-budget-s", "60"])
    assert args.dense == [bf.CaseSpec(64, 4, 4096, 2)] and args.gated == [] and args.block_sparse == []
    assert args.decode == [bf.CaseSpec(32, 8, 131072, 1)] and not args.flex and args.density == 0.25
    assert [s for s, _ in bf.planned_cases(args)] == ["dense", "bias", "decode"]
    for bad in ("32/8", "32:8K", "32/6:8K", "32/8:8K:0", "a/8:8K"):
        with pytest.raises(argparse.ArgumentTypeError):
            bf.CaseSpec.parse(bad)
    with pytest.raises(SystemExit):
        bf.parse_args(["--density", "0"])


@pytest.mark.parametrize("n,heads,density", [(64, 3, 0.1), (256, 1, 0.1), (10, 2, 0.5)])
def test_tile_mask_density_and_causal_diagonal(n, heads, density):
    tiles = bf.causal_tile_mask(n, heads, density, seed=0)
    assert tiles.shape == (1, heads, n, n) and tiles.dtype == torch.bool
    assert tiles[0].diagonal(dim1=-2, dim2=-1).all()
    assert not tiles[0].triu(1).any()
    assert tiles[0].sum((-2, -1)).tolist() == [round(density * n * (n + 1) / 2)] * heads
    assert torch.equal(tiles, bf.causal_tile_mask(n, heads, density, seed=0))
    assert not torch.equal(tiles, bf.causal_tile_mask(n, heads, density, seed=1))
    if heads > 1:
        assert not torch.equal(tiles[0, 0], tiles[0, 1])


def test_tile_mask_limits_and_visible_pairs():
    assert torch.equal(bf.causal_tile_mask(8, 1, 0.01, seed=0)[0, 0], torch.eye(8, dtype=torch.bool))
    full = bf.causal_tile_mask(4, 1, 1.0, seed=0)
    assert torch.equal(full[0, 0], torch.ones(4, 4, dtype=torch.bool).tril())
    # T = 100 in tiles of 32 (the last one 4 long): every causal pair, then the diagonal alone.
    assert bf.visible_pairs(full, 100, 32).tolist() == [100 * 101 / 2]
    assert bf.visible_pairs(torch.eye(4, dtype=torch.bool)[None, None], 100, 32).tolist() == [3 * 32 * 33 / 2 + 10]


def test_tile_lists_and_block_mask_are_the_tile_mask():
    tiles = bf.causal_tile_mask(6, 2, 0.4, seed=3)
    counts, indices = bf.tile_lists(tiles)
    rebuilt = torch.zeros_like(tiles)
    for h in range(2):
        for i in range(6):
            kept = indices[0, h, i, :counts[0, h, i]]
            assert kept.tolist() == sorted(kept.tolist())
            rebuilt[0, h, i, kept.long()] = True
    assert torch.equal(rebuilt, tiles)

    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    block_mask = bf.flex_block_mask(tiles, 4, 24)
    assert isinstance(block_mask, flex.BlockMask) and tuple(block_mask.BLOCK_SIZE) == (4, 4)
    assert torch.equal(block_mask.to_dense().bool(), tiles)
    assert block_mask.full_kv_num_blocks.sum() == tiles.sum() - 2 * 6  # every tile full but the diagonal
    # The benchmark's two sparseattn forms are the same attention (CPU reference, float64).
    q, k, v = (torch.randn(1, 24, h, 8, dtype=torch.float64) for h in (4, 2, 2))
    dense_form = sa.flash_attention(q, k, v, causal=True, block_mask=tiles, block_size=(4, 4))
    list_form = sa.flash_attention(q, k, v, causal=True, block_mask=bf.flex_block_mask(
        tiles.repeat_interleave(2, dim=1), 4, 24))
    torch.testing.assert_close(dense_form, list_form, rtol=0, atol=1e-12)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_baselines_compute_what_sparseattn_computes():
    """The inputs the benchmark gives SDPA and FlexAttention (eager here, float64) describe the same attention as
    the sparseattn calls they are compared with (CPU reference)."""
    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    B, T, Hq, Hkv, D, tile = 2, 48, 4, 2, 8, 16
    q, k, v = (torch.randn(B, T, h, D, dtype=torch.float64) for h in (Hq, Hkv, Hkv))
    qh, kh, vh = bf.heads_first(q, k, v)
    tiles = bf.causal_tile_mask(T // tile, Hkv, 0.5, seed=1)
    assert tiles.sum() < 2 * 6  # some causal tile is absent
    block_mask = bf.flex_block_mask(tiles.repeat_interleave(2, dim=1), tile, T)
    o_flex = flex.flex_attention(qh, kh, vh, block_mask=block_mask, enable_gqa=True).transpose(1, 2)
    o_tiles = sa.flash_attention(q, k, v, causal=True, block_mask=tiles, block_size=(tile, tile))
    torch.testing.assert_close(o_flex, o_tiles, rtol=0, atol=1e-12)

    bias = torch.randn(B, Hkv, 1, T, dtype=torch.float64)
    o_bias = sa.flash_attention(q, k, v, causal=True, bias=bias)
    causal_blocks = flex.create_block_mask(bf.causal_mask_mod, None, None, T, T, device="cpu", BLOCK_SIZE=tile)
    o_flex = flex.flex_attention(qh, kh, vh, score_mod=bf.bias_score_mod(bias, 2), block_mask=causal_blocks,
                                 enable_gqa=True).transpose(1, 2)
    torch.testing.assert_close(o_flex, o_bias, rtol=0, atol=1e-12)
    causal_minus_inf = torch.full((T, T), float("-inf"), dtype=torch.float64).triu(1)
    o_sdpa = torch.nn.functional.scaled_dot_product_attention(
        qh, kh, vh, attn_mask=bf.sdpa_bias_mask(causal_minus_inf, bias, 2), enable_gqa=True).transpose(1, 2)
    torch.testing.assert_close(o_sdpa, o_bias, rtol=0, atol=1e-12)

    assert bf.decode_sdpa_mask(1, T, "cpu") is None
    for queries in (1, 3):
        q_dec = q[:, -queries:]
        o_sdpa = torch.nn.functional.scaled_dot_product_attention(
            *bf.heads_first(q_dec, k, v), attn_mask=bf.decode_sdpa_mask(queries, T, "cpu"),
            enable_gqa=True).transpose(1, 2)
        torch.testing.assert_close(o_sdpa, sa.flash_attention(q_dec, k, v, causal=True), rtol=0, atol=1e-12)


def test_derived_numbers():
    dense, block, bias, _, decode, _ = RESULTS
    assert dense["ratios"]["sparseattn_fwd"] == 0.5 and dense["ratios"]["sparseattn_fwd_bwd"] == 0.75
    flops = 4 * 32 * 128 * 8192 ** 2 / 2
    assert dense["tflops"]["sparseattn_fwd_bwd"] == pytest.approx(3.5 * flops / 8e-3 / 1e12)
    assert block["ratios"]["sparseattn_blockmask_fwd_bwd"] == 0.2 and block["ratios"]["flex_fwd_bwd"] == 0.25
    assert block["ratios"]["sparseattn_tiles_fwd_bwd"] is None
    assert bias["ratios"]["sparseattn_bias_fwd_bwd"] == 1.3 and bias["ratios"]["sdpa_bias_fwd_bwd"] is None
    kv_bytes = 32 * 131072 * 8 * 256 * 2
    assert decode["kv_bytes"] == kv_bytes
    assert decode["kv_bytes_per_s"]["sparseattn"] == pytest.approx(kv_bytes / 10e-3)
    assert decode["fraction_of_peak_hbm"]["sdpa_flash"] == pytest.approx(kv_bytes / 6.7e-3 / 3.35e12)
    assert decode["kv_bytes_per_s"]["flash_decode"] is None
    assert [bf.peak_hbm_bytes_per_s(name) for name in ("NVIDIA H100 80GB HBM3", "NVIDIA H100 PCIe", "NVIDIA H200",
                                                       "NVIDIA A100-SXM4-80GB")] == [3.35e12, 2.0e12, 4.8e12, None]


def test_bars():
    bars = bf.evaluate_bars(RESULTS)
    assert [(b["method"], b["status"]) for b in bars] == [
        ("sparseattn_tiles", "not measured (unsupported)"), ("sparseattn_blockmask", "met"),  # 0.2 <= 0.2
        ("sparseattn_bias", "not met"), ("sparseattn_gated", "not measured (unsupported)")]
    assert bars[2]["value"] == 1.3 and bars[2]["limit"] == 1.25 and bars[2]["case"] == "32/8, T=16K, B=1"
    assert bf.evaluate_bars(RESULTS[:1]) == []


def test_markdown():
    text = bf.markdown(META, RESULTS, bf.evaluate_bars(RESULTS))
    assert rows_of(text, "block_sparse: sparseattn BlockMask")[0][1:] == ["32/8, T=32K, B=1", "0.20", "met"]
    ours, cudnn, flash = rows_of(text, "32/8, T=8K, B=1")
    assert ours[1:4] == ["sparseattn dense", "2.00", "8.00"] and ours[5:] == ["0.50, 0.75", "0.50"]
    assert cudnn[5:] == ["1.00, 1.00", "0.25"] and flash[6] == "n/a"
    tiles = [r for r in rows_of(text, "32/8, T=32K, B=1") if r[1] == "sparseattn tile mask"][0]
    assert tiles[2:4] == ["unsupported", "unsupported"]
    decode = [r for r in rows_of(text, "32/8, T=128K, B=32") if r[3] == "SDPA flash"][0]
    assert decode[1:3] == ["1", f"{32 * 131072 * 8 * 256 * 2 / 1e9:.2f}"] and decode[4] == "6.70"
    assert decode[5] == f"{32 * 131072 * 8 * 256 * 2 / 6.7e-3 / 1e12:.2f}"
    assert decode[6] == f"{100 * 32 * 131072 * 8 * 256 * 2 / 6.7e-3 / 3.35e12:.0f}"
    assert all(r[4] == "skipped" for r in rows_of(text, "64/4, T=128K, B=1"))
    assert "- `gated: sparseattn_gated_fwd_bwd` at 32/8, T=16K, B=1: unsupported:" in text
    assert "- `decode: case` at 64/4, T=128K, B=1: skipped: time budget exhausted" in text
    assert text.index("## 1. Dense") < text.index("## 2. Block-sparse") < text.index("## 5. Decode")


def test_reports_from_json(tmp_path, capsys):
    saved = tmp_path / "run.json"
    saved.write_text(json.dumps({"meta": META, "results": RESULTS}))
    bf.main(["--from-json", str(saved), "--out", str(tmp_path / "out")])
    stem = tmp_path / "out" / "NVIDIA_H100_80GB_HBM3_2026-01-02_abc1234_flash"
    written = json.loads(stem.with_suffix(".json").read_text())
    assert written["results"] == RESULTS and written["bars"] == bf.evaluate_bars(RESULTS)
    assert stem.with_suffix(".md").read_text() == bf.markdown(META, RESULTS, written["bars"])
    assert "1.30: not met" in capsys.readouterr().out


def test_guarded_records_other_errors_as_runtime_errors():
    def compile_failure():
        raise AssertionError("inductor could not lower the score_mod")

    with pytest.raises(RuntimeError, match="AssertionError: inductor could not lower"):
        bf.guarded(compile_failure)()
    with pytest.raises(sa.SparseAttnUnsupportedError):
        bf.guarded(lambda: (_ for _ in ()).throw(sa.SparseAttnUnsupportedError("no kernel")))()


SMOKE = ["--device", "cpu", "--dtype", "float32", "--head-dim", "16", "--tile", "32", "--dense", "4/2:128",
         "--block-sparse", "4/2:256", "--bias", "4/2:128", "--gated", "4/2:96", "--decode", "4/2:512:2",
         "--decode-queries", "3", "--no-flex", "--rep-ms", "1", "--warmup-ms", "0", "--max-reps", "2"]


def test_smoke_run_on_the_cpu(tmp_path):
    bf.main(SMOKE + ["--out", str(tmp_path)])
    (path,) = tmp_path.glob("CPU_*_flash.json")
    saved = json.loads(path.read_text())
    results = {r["section"]: r for r in saved["results"]}
    assert list(results) == list(bf.SECTIONS)
    for section, result in results.items():
        assert result["times_ms"]["sparseattn_fwd"] > 0, (section, result["errors"])
        if section != "decode":
            assert result["times_ms"]["sparseattn_fwd_bwd"] > 0
    for key in ("sparseattn_tiles_fwd_bwd", "sparseattn_blockmask_fwd_bwd"):
        assert results["block_sparse"]["times_ms"][key] > 0, results["block_sparse"]["errors"]
    assert results["bias"]["times_ms"]["sparseattn_bias_fwd_bwd"] > 0
    assert results["gated"]["times_ms"]["sparseattn_gated_fwd_bwd"] > 0
    assert results["dense"]["errors"]["sdpa_cudnn_fwd"].startswith("unavailable")
    assert results["bias"]["notes"]["sdpa_bias_backend"] in bf.SDPA_BIAS_BACKENDS
    assert results["block_sparse"]["errors"]["flex_fwd_bwd"] == "skipped: --no-flex"
    assert results["decode"]["queries"] == 3 and results["decode"]["kv_bytes"] == 2 * 512 * 2 * 32 * 4
    if not hasattr(sa, "flash_decode"):
        assert results["decode"]["errors"]["flash_decode_fwd"].startswith("unavailable")
    assert [b["status"] for b in saved["bars"]] and all(b["value"] is not None for b in saved["bars"])
    assert path.with_suffix(".md").read_text() == bf.markdown(saved["meta"], saved["results"], saved["bars"])


def test_time_budget_and_missing_gpu(tmp_path):
    bf.main(SMOKE + ["--time-budget-s", "0", "--out", str(tmp_path)])
    (path,) = tmp_path.glob("*.json")
    assert {r["errors"]["case"] for r in json.loads(path.read_text())["results"]} == \
        {"skipped: time budget exhausted"}
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="needs a CUDA GPU"):
            bf.main(["--out", str(tmp_path / "none")])
        assert not (tmp_path / "none").exists()
