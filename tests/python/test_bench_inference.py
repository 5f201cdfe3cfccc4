"""The inference benchmark (python -m sparseattn.bench_inference) without a GPU: arguments, what each section's
methods compute, the prefill-then-generate path against a plain generate(), the bars with their boundaries, the
reports from a synthetic result set and from a saved JSON, failure records, and a smoke run of every section on
the CPU reference."""
import argparse
import json

import pytest
import torch

from helpers import require_sparseattn

sa = require_sparseattn()
transformers = pytest.importorskip("transformers", reason="the generate section needs transformers")
from sparseattn import bench_inference as bi  # noqa: E402

META = {"gpu": "NVIDIA H100 80GB HBM3", "date": "2026-01-02", "commit": "abc1234", "torch": "2.11",
        "dtype": "bfloat16", "element_bytes": 2, "heads": "64/4", "head_dim": 128, "device": "cuda",
        "config": {"window": 512}, "peak_hbm_bytes_per_s": 3.35e12}
ARGS = bi.parse_args([])
CAPTURE_FAILED = "capture failed: RuntimeError: operation not permitted when stream is capturing"


def synthetic(section, fields, times, errors=None, notes=None):
    result = bi.new_result(section, ARGS, **fields)
    result["times_ms"].update(times)
    result["notes"].update(notes or {})
    for key, reason in (errors or {}).items():
        result["times_ms"][key] = None
        result["errors"][key] = reason
    return bi.summarize(result, META["element_bytes"])


def decode_times(nsa, nsa_cmp_given, flash_decode, cudnn, flash):
    times = {}
    for method, ms in zip(bi.DECODE_METHODS, (nsa, nsa_cmp_given, flash_decode, cudnn, flash)):
        times[f"{method}_graph"] = ms
        times[f"{method}_eager"] = 2 * ms
    return times


RESULTS = [
    # 128K, B=1: NSA at 0.0625 ms, exactly 0.25 x flash_decode's time (met); the variant misses both bars.
    synthetic("decode", {"batch": 1, "context": 131072, "queries": 1},
              {**decode_times(0.0625, 0.125, 0.25, 0.125, 0.5)}),
    # 32K, B=64: NSA exactly 5x flash_decode's tokens/s; the variant's capture failed.
    synthetic("decode", {"batch": 64, "context": 32768, "queries": 1},
              {**decode_times(1.0, 0.5, 5.0, 4.0, 6.0), "nsa_cmp_given_graph": None},
              errors={"nsa_cmp_given_graph": CAPTURE_FAILED}),
    synthetic("decode", {"batch": 1, "context": 8192, "queries": 1}, {}, errors={"case": "out of memory: CUDA"}),
    # 8K of 128K: the chunk's tokens/s is 0.5 x the full forward's (16 chunk tokens per full token, 8x the time);
    # the full forward's last 8K rows add 8 ms (80 - 72), so the chunk runs at 0.8 x its speed on them.
    synthetic("prefill", {"batch": 1, "context": 131072, "chunk": 8192}, {"chunk": 10.0, "full": 80.0,
                                                                            "full_before": 72.0, "chunked": 100.0}),
    synthetic("generate", {"batch": 16, "prompt": 65536, "new_tokens": 32},
              {"nsa_prefill": 4000.0, "nsa_join": 50.0, "nsa_generate": 320.0, "sdpa_prefill": 20000.0,
               "sdpa_join": 60.0, "sdpa_generate": 960.0, "nsa_graph_join": 70.0, "nsa_graph_generate": 80.0,
               "sdpa_graph_join": 90.0, "sdpa_graph_generate": 240.0},
              notes={"nsa_parameters": 978899200, "sdpa_parameters": 974178304,
                     "nsa_generate_runs_ms": [400.0, 320.0, 310.0], "sdpa_generate_runs_ms": [990.0, 960.0, 950.0],
                     "nsa_graph_generate_runs_ms": [80.0, 79.0, 81.0], "nsa_graph_compiled": True,
                     "sdpa_graph_generate_runs_ms": [240.0, 241.0, 239.0], "sdpa_graph_compiled": True}),
]


def rows_of(text, prefix):
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in text.splitlines()
            if line.startswith(f"| {prefix}")]


def test_arguments():
    assert (ARGS.sections, ARGS.device, ARGS.heads, ARGS.head_dim, ARGS.dtype, ARGS.window) == (
        list(bi.SECTIONS), "cuda", "64/4", 128, "bfloat16", 512)
    assert (ARGS.decode_contexts, ARGS.decode_batches, ARGS.decode_queries) == ([8192, 32768, 65536, 131072],
                                                                                [1, 64], 1)
    assert (ARGS.prefill_context, ARGS.prefill_chunk, ARGS.prefill_batch) == (131072, 8192, 1)
    assert (ARGS.generate_prompts, ARGS.generate_batch, ARGS.generate_new_tokens, ARGS.generate_model,
            ARGS.generate_reps, ARGS.generate_prefill_group) == ([65536], 16, 32, "1b", 3, 1)
    assert (ARGS.rep_ms, ARGS.out, ARGS.time_budget_s) == (100.0, "bench/results", None)
    cpu = bi.parse_args(["--device", "cpu"])
    assert (cpu.heads, cpu.head_dim, cpu.dtype, cpu.decode_contexts, cpu.prefill_context, cpu.prefill_chunk,
            cpu.generate_model, cpu.rep_ms) == ("4/2", 16, "float32", [512, 1024], 1024, 128, "tiny", 1.0)
    args = bi.parse_args(["--device", "cpu", "--heads", "8/2", "--decode-contexts", "2K", "--prefill-chunk", "256",
                          "--sections", "prefill", "generate", "--generate-prompts", "16K", "64k"])
    assert (args.heads, args.decode_contexts, args.prefill_chunk, args.generate_prompts) == (
        "8/2", [2048], 256, [16384, 65536])
    assert [s for s, _ in bi.planned_cases(args)] == ["prefill", "generate", "generate"]
    assert [f for _, f in bi.planned_cases(ARGS)][:5] == [
        {"batch": 1, "context": c, "queries": 1} for c in (8192, 32768, 65536, 131072)] + [
        {"batch": 64, "context": 8192, "queries": 1}]
    for bad in (["--heads", "64/5"], ["--heads", "64"], ["--prefill-chunk", "3000"], ["--decode-queries", "17"],
                ["--decode-batches", "0"], ["--generate-prompts", "1"], ["--sections", "train"],
                ["--decode-contexts", "8Q"]):
        with pytest.raises(SystemExit):
            bi.parse_args(bad)
    with pytest.raises(argparse.ArgumentTypeError):
        bi.parse_heads("4/0")


def test_the_generate_model_has_about_a_billion_parameters():
    nsa, sdpa = bi.parameter_count(ARGS, True), bi.parameter_count(ARGS, False)
    assert 0.9e9 < sdpa < nsa < 1.1e9
    assert nsa - sdpa == 12 * (2048 + 1) * 3 * 64  # the gate projections of the 12 NSA layers
    config = bi.model_config(ARGS, True, 65568)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim, config.nsa_window,
            config.max_position_embeddings) == (64, 4, 128, 512, 65568)


def test_the_methods_of_a_section_compute_the_same_attention():
    """decode: NSA with and without the compressed K/V given, and flash_decode against SDPA; prefill: the chunk
    and the chunks in order give the full forward's rows (CPU reference, float64)."""
    config = sa.NSAConfig(cmp_block=8, cmp_stride=4, sel_block=16, num_selected=3, window=24)
    B, S, Hq, Hkv, D = 2, 100, 4, 2, 8
    for queries in (1, 3):
        q = torch.randn(B, queries, Hq, D, dtype=torch.float64)
        k, v = (torch.randn(B, S, Hkv, D, dtype=torch.float64) for _ in range(2))
        gates = bi.random_gates(B, queries, Hq, "cpu", torch.float64)
        k_cmp, v_cmp = sa.compress_kv(k, v, block=8, stride=4)
        steps = bi.decode_steps(q, k, v, gates, k_cmp, v_cmp, config)
        assert torch.equal(steps["nsa"](), steps["nsa_cmp_given"]())
        full_queries = torch.cat([torch.randn(B, S - queries, Hq, D, dtype=torch.float64), q], dim=1)
        full_gates = [torch.cat([torch.rand(B, S - queries, Hq, dtype=torch.float64), g], dim=1) for g in gates]
        torch.testing.assert_close(steps["nsa"](), sa.nsa_attention(full_queries, k, v, *full_gates,
                                                                    config=config)[:, -queries:], rtol=0, atol=0)
        expected = torch.nn.functional.scaled_dot_product_attention(
            *bi.heads_first(q, k, v), attn_mask=bi.decode_sdpa_mask(queries, S, "cpu"), enable_gqa=True)
        torch.testing.assert_close(steps["flash_decode"](), expected.transpose(1, 2), rtol=0, atol=1e-12)


def test_prefill_rows_are_the_full_forward_rows():
    config = sa.NSAConfig(cmp_block=8, cmp_stride=4, sel_block=16, num_selected=3, window=24)
    S, C = 96, 32
    q = torch.randn(1, S, 4, 8, dtype=torch.float64)
    k, v = (torch.randn(1, S, 2, 8, dtype=torch.float64) for _ in range(2))
    gates = bi.random_gates(1, S, 4, "cpu", torch.float64)
    full = sa.nsa_attention(q, k, v, *gates, config=config)
    chunks = [sa.nsa_attention(q[:, a:a + C], k[:, :a + C], v[:, :a + C], *(g[:, a:a + C] for g in gates),
                               config=config) for a in range(0, S, C)]
    assert torch.equal(torch.cat(chunks, dim=1), full)


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("nsa", [True, False], ids=["nsa", "sdpa"])
def test_prefill_then_generate_gives_the_tokens_of_a_plain_generate(nsa):
    """The benchmark's path (prefill in groups, join, generate from the cache, crop, generate again) gives the
    tokens generate() gives from the prompt alone (float64 tiny model, 3 sequences in groups of 2)."""
    args = bi.parse_args(["--device", "cpu"])
    torch.manual_seed(0)
    model = bi.build_model(args, nsa, 64, "cpu", torch.float64)
    prompt = torch.randint(1, 64, (3, 21))
    expected = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=5, do_sample=False,
                              pad_token_id=0)
    cache, prefill_ms, join_ms = bi.prefill(model, prompt, 2, nsa, "cpu")
    assert type(cache).__name__ == ("SparseAttnCache" if nsa else "DynamicCache")
    assert cache.get_seq_length() == 20 and prefill_ms > 0 and join_ms > 0
    times, output = bi.generate_runs(model, prompt, cache, 5, 2, "cpu")
    assert len(times) == 2 and torch.equal(output, expected)
    assert cache.get_seq_length() == 25
    # The graph mode's path: the cache copied into a fixed-capacity one, rewound and generated from (eagerly on
    # the CPU: transformers compiles on CUDA only).
    bi.rewind(cache, 20)
    static = bi.static_cache(model, cache, nsa, 26)
    assert type(static).__name__ == ("SparseAttnStaticCache" if nsa else "StaticCache") and static.is_compileable
    assert all(layer is None for layer in cache.layers)  # the source's layers are dropped as they are copied
    times, output = bi.generate_runs(model, prompt, static, 5, 2, "cpu")
    assert len(times) == 2 and torch.equal(output, expected)
    assert int(static.get_seq_length()) == 25


def test_derived_numbers():
    long, batched, _, prefill, generate = RESULTS
    assert long["time_vs_flash_decode"]["nsa_graph"] == 0.25 and long["time_vs_flash_decode"]["nsa_eager"] == 0.25
    assert long["sdpa_best"] == {"graph": "sdpa_cudnn", "eager": "sdpa_cudnn"}
    assert long["time_vs_sdpa_best"]["nsa_graph"] == 0.5
    assert long["tokens_per_s"]["nsa_graph"] == pytest.approx(1 / 0.0625e-3)
    kv_bytes = 131072 * 4 * 256 * 2
    assert long["kv_bytes"] == kv_bytes and long["kv_bytes_per_s"]["flash_decode_graph"] == pytest.approx(
        kv_bytes / 0.25e-3)
    assert "nsa_graph" not in long["kv_bytes_per_s"]
    assert batched["speedup_vs_flash_decode"]["nsa_graph"] == 5.0
    assert batched["tokens_per_s"]["nsa_graph"] == pytest.approx(64 / 1e-3)
    assert batched["speedup_vs_flash_decode"]["nsa_cmp_given_graph"] is None
    assert prefill["tokens_per_s"]["chunk"] == pytest.approx(8192 / 10e-3)
    assert prefill["tokens_per_s_vs_full"] == pytest.approx({"chunk": 0.5, "full": 1.0, "full_before": 120 / 128 / 0.9,
                                                              "chunked": 0.8})
    assert prefill["marginal_ms"] == pytest.approx(8.0) and prefill["chunk_vs_marginal"] == pytest.approx(0.8)
    assert generate["decode_tokens_per_s"] == {"nsa": pytest.approx(16 * 32 / 0.32),
                                               "sdpa": pytest.approx(16 * 32 / 0.96),
                                               "nsa_graph": pytest.approx(16 * 32 / 0.08),
                                               "sdpa_graph": pytest.approx(16 * 32 / 0.24)}
    assert generate["nsa_vs_sdpa_decode_tokens_per_s_graph"] == pytest.approx(3.0)
    assert generate["ms_per_step"]["nsa_graph"] == 2.5
    assert generate["ms_per_step"]["nsa"] == 10.0
    assert generate["prefill_tokens_per_s"]["sdpa"] == pytest.approx(16 * 65535 / 20.0)
    assert generate["nsa_vs_sdpa_decode_tokens_per_s"] == pytest.approx(3.0)


def test_bars_and_their_boundaries():
    bars = bi.evaluate_bars(RESULTS)
    by_name = {}
    for row in bars:
        by_name.setdefault(row["bar"], []).append(row)
    statuses = [(row["variant"], row["value"], row["status"]) for row in bars]
    assert statuses == [
        (False, 0.0625, "met"), (False, 0.25, "met"), (False, 5.0, "met"),            # at the limits: met
        (True, 0.125, "not met"), (True, 0.5, "not met"), (True, None, "not measured (capture failed)"),
        # nsa_decode's bars: the synthetic results have no paged methods.
        (False, None, "not measured (no time)"), (False, None, "not measured (no time)"),
        (False, None, "not measured (no time)"),
        (False, pytest.approx(0.8), "not met"), (False, pytest.approx(3.0), "met"),
        (False, pytest.approx(3.0), "met"), (False, pytest.approx(3.0), "met")]
    assert bars[0]["case"] == "B=1, S=128K, Tq=1" and bars[2]["case"] == "B=64, S=32K, Tq=1"
    # Each model in its faster mode: an SDPA graph step slower than its eager loop leaves the eager loop as SDPA's.
    slow_graph = synthetic("generate", {"batch": 16, "prompt": 65536, "new_tokens": 32},
                           {"nsa_generate": 320.0, "nsa_graph_generate": 80.0, "sdpa_generate": 960.0,
                            "sdpa_graph_generate": 9600.0})
    best = [row for row in bi.evaluate_bars([slow_graph]) if "faster mode" in row["bar"]]
    assert [(row["value"], row["status"]) for row in best] == [(pytest.approx(12.0), "met")]
    bar = bi.BARS[0]
    assert bar.met(0.12) and not bar.met(0.1201)
    prefill_bar = next(b for b in bi.BARS if b.section == "prefill")
    assert prefill_bar.met(0.9) and not prefill_bar.met(0.8999)
    # A matching case without the measurement, and no matching case at all.
    failed = synthetic("decode", {"batch": 1, "context": 131072, "queries": 1}, {},
                       errors={"case": "out of memory: CUDA out of memory"})
    assert bi.evaluate_bars([failed])[0]["status"] == "not measured (out of memory)"
    assert {row["status"] for row in bi.evaluate_bars([])} == {
        "not measured (no case at context=128K, batch=1, queries=1)",
        "not measured (no case at context=32K, batch=64, queries=1)", "not measured (no case)",
        "not measured (no case at prompt=64K)"}


def test_markdown():
    text = bi.markdown(META, RESULTS, bi.evaluate_bars(RESULTS))
    assert text.index("## Bars") < text.index("## 1. Decode") < text.index("## 2. Chunked") < text.index("## 3. ")
    nsa = [r for r in rows_of(text, "B=1, S=128K, Tq=1") if r[1] == "NSA"][0]
    assert nsa[2:7] == ["0.062", "0.125", "16k, 8k", "0.250, 0.250", "0.500, 0.500"]
    fd = [r for r in rows_of(text, "B=1, S=128K, Tq=1") if r[1] == "sparseattn flash_decode"][0]
    assert fd[7] == f"{131072 * 4 * 256 * 2 / 0.25e-3 / 1e12:.3g}T"
    variant = [r for r in rows_of(text, "B=64, S=32K, Tq=1") if r[1] == "NSA, compressed K/V given"][0]
    assert variant[2:4] == ["capture failed", "1.00"]
    assert all(r[2] == "OOM" for r in rows_of(text, "B=1, S=8K, Tq=1"))
    assert [r[1:5] for r in rows_of(text, "B=1, C=8K of S=128K")] == [
        ["one chunk", "10.00", "819k", "0.500"], ["full forward", "80.00", "1.64M", "1.000"],
        ["full forward of the first S - C tokens", "72.00", "1.71M", "1.042"],
        ["all chunks in order", "100", "1.31M", "0.800"],
        ["the training forward on the chunk's tokens (full - first S - C)", "8.00", "chunk / it: 0.800", ""]]
    nsa_model, sdpa_model, nsa_graph, sdpa_graph = rows_of(text, "B=16, P=64K, N=32")
    assert nsa_model[2:] == ["979M", "4000", "262k", "50.00", "320", "10.00", "1.6k", "n/a"]
    assert sdpa_model[6] == "960"
    assert nsa_graph[1:] == ["NSA (SparseAttnStaticCache, compiled step, CUDA graph)", "979M", "n/a", "n/a", "70.00",
                             "80.00", "2.50", "6.4k", "n/a"]
    assert sdpa_graph[6] == "240"
    assert ("graph mode: NSA / SDPA decode tokens/s = 3.00; compiled by transformers: nsa_graph True, sdpa_graph "
            "True; generate runs (ms): nsa_graph 80.00, 79.00, 81.00; sdpa_graph 240, 241, 239") in text
    assert "NSA / SDPA decode tokens/s = 3.00; generate runs (ms): nsa 400, 320, 310; sdpa 990, 960, 950" in text
    assert "- `decode: nsa_cmp_given_graph` at B=64, S=32K, Tq=1: capture failed: RuntimeError:" in text
    assert "- `decode: case` at B=1, S=8K, Tq=1: out of memory: CUDA" in text


def test_reports_from_json(tmp_path, capsys):
    saved = tmp_path / "run.json"
    saved.write_text(json.dumps({"meta": META, "results": RESULTS}))
    bi.main(["--from-json", str(saved), "--out", str(tmp_path / "out")])
    stem = tmp_path / "out" / "NVIDIA_H100_80GB_HBM3_2026-01-02_abc1234_inference"
    written = json.loads(stem.with_suffix(".json").read_text())
    assert written["results"] == json.loads(json.dumps(RESULTS))
    assert written["bars"] == json.loads(json.dumps(bi.evaluate_bars(RESULTS)))
    assert stem.with_suffix(".md").read_text() == bi.markdown(META, written["results"], written["bars"])
    printed = capsys.readouterr().out
    assert "0.250: met" in printed and "0.500: not met" in printed


def test_failures_are_recorded(monkeypatch):
    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 64.00 GiB")

    result = bi.new_result("generate", ARGS, batch=16, prompt=65536, new_tokens=32)
    monkeypatch.setattr(bi, "build_model", out_of_memory)
    bi.run_generate_model(result, bi.parse_args(["--device", "cpu"]), True, "cpu")
    assert result["times_ms"] == {"nsa_prefill": None, "nsa_generate": None}
    assert result["errors"]["nsa_generate"] == ("out of memory: CUDA out of memory. Tried to allocate 64.00 GiB "
                                                "(while: build)")
    assert bi.time_cell(result, "nsa_prefill") == "OOM"
    assert bi.capture_failure(RuntimeError("operation not permitted when stream is capturing\nmore")) == \
        "capture failed: RuntimeError: operation not permitted when stream is capturing"
    assert bi.capture_failure(torch.OutOfMemoryError("CUDA out of memory")).startswith("out of memory")

    case = bi.Case(bi.Shape(4, 2, 16, 16), 64, bi.WallClockTimer(1.0, 0.0, 2))
    case.result = bi.new_result("decode", ARGS, batch=1, context=64, queries=1)
    bi.measure_step(case, "nsa", lambda: torch.zeros(1), "cpu")
    bi.measure_step(case, "flash_decode", lambda: sa.flash_decode(torch.zeros(1, 1, 4, 16),
                                                                  torch.zeros(1, 8, 3, 16), torch.zeros(1, 8, 3, 16)),
                    "cpu")
    assert case.result["times_ms"]["nsa_eager"] > 0 and case.result["errors"]["nsa_graph"] == bi.NO_GRAPH_ON_CPU
    assert case.result["errors"]["flash_decode_eager"].startswith(
        "unavailable: sparseattn.flash_decode: argument 'k_cache'")
    assert case.result["errors"]["flash_decode_graph"] == "skipped: the eager call failed"


SMOKE = ["--device", "cpu", "--decode-contexts", "512", "--prefill-context", "512", "--prefill-chunk", "128",
         "--generate-prompts", "40"]


@pytest.mark.filterwarnings("ignore")
def test_smoke_run_on_the_cpu(tmp_path, capsys):
    bi.main(SMOKE + ["--out", str(tmp_path)])
    (path,) = tmp_path.glob("CPU_*_inference.json")
    saved = json.loads(path.read_text())
    decode = [r for r in saved["results"] if r["section"] == "decode"]
    (prefill,) = [r for r in saved["results"] if r["section"] == "prefill"]
    (generate,) = [r for r in saved["results"] if r["section"] == "generate"]
    assert [(r["batch"], r["context"]) for r in decode] == [(1, 512), (2, 512)]
    for result in decode:
        for method in ("nsa", "nsa_cmp_given", "flash_decode"):
            assert result["times_ms"][f"{method}_eager"] > 0, result["errors"]
            assert result["errors"][f"{method}_graph"] == bi.NO_GRAPH_ON_CPU
        assert result["errors"]["sdpa_cudnn_eager"].startswith("unavailable")
        assert result["time_vs_flash_decode"]["nsa_eager"] > 0 and result["tokens_per_s"]["nsa_eager"] > 0
    assert all(prefill["times_ms"][m] > 0 for m in bi.PREFILL_METHODS), prefill["errors"]
    assert prefill["tokens_per_s_vs_full"]["chunk"] > 0
    for model in bi.MODELS:
        for stage in ("prefill", "join", "generate"):
            assert generate["times_ms"][f"{model}_{stage}"] > 0, generate["errors"]
        assert len(generate["notes"][f"{model}_generate_runs_ms"]) == 2
    assert generate["notes"]["nsa_parameters"] > generate["notes"]["sdpa_parameters"] > 0
    assert generate["decode_tokens_per_s"]["nsa"] > 0 and generate["nsa_vs_sdpa_decode_tokens_per_s"] > 0
    assert not any("graph" in key for key in generate["times_ms"])  # the CPU's default modes: eager only
    statuses = {b["bar"]: b["status"] for b in saved["bars"]}
    assert statuses[bi.BARS[0].name].startswith("not measured (no case")
    assert statuses[next(b.name for b in bi.BARS if b.section == "prefill")] in ("met", "not met")
    assert path.with_suffix(".md").read_text() == bi.markdown(saved["meta"], saved["results"], saved["bars"])
    assert "bar prefill: chunk speed / the training forward's speed on the same tokens >= 0.9" in capsys.readouterr().out


def test_time_budget_and_missing_gpu(tmp_path):
    bi.main(SMOKE + ["--time-budget-s", "0", "--out", str(tmp_path)])
    (path,) = tmp_path.glob("*.json")
    saved = json.loads(path.read_text())
    assert {r["errors"]["case"] for r in saved["results"]} == {"skipped: time budget exhausted"}
    assert {b["status"] for b in saved["bars"] if b["section"] == "prefill"} == {"not measured (skipped)"}
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="needs a CUDA GPU"):
            bi.main(["--out", str(tmp_path / "none")])
        assert not (tmp_path / "none").exists()
