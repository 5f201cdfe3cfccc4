"""The benchmark's pieces that need no GPU: arguments, the time budget, failure reasons, the markdown table and the
reports written from a saved JSON (python -m sparseattn.bench --from-json)."""
import json
import warnings

import pytest
import torch

from helpers import require_sparseattn

sa = require_sparseattn()
from sparseattn import bench  # noqa: E402

CONFIG = sa.NSAConfig()
META = {"gpu": "Test GPU", "date": "2026-01-02", "commit": "abc1234", "torch": "2.11", "dtype": "bfloat16",
        "config": {"window": 512}}


def synthetic_result(shape_text, seqlen, times, memory=None, errors=None):
    shape = bench.Shape.parse(shape_text)
    result = {"shape": {"heads_q": shape.heads_q, "heads_kv": shape.heads_kv, "dim_qk": shape.dim_qk,
                        "dim_v": shape.dim_v},
              "seqlen": seqlen, "times_ms": dict(times), "reps": {}, "peak_memory_gb": dict(memory or {}),
              "errors": dict(errors or {})}
    for key in result["errors"]:
        result["times_ms"][key] = None
    return bench.summarize(result, shape, seqlen, CONFIG)


STAGE_TIMES = {"compress_kv": 0.1, "compressed_attention": 1.0, "select_blocks": 10.0, "selected_attention": 3.0,
               "sliding_window": 1.5, "combine": 0.4}
RESULTS = [
    synthetic_result("64/4/128/128", 8192,
                     {"nsa_fwd": 4.0, "nsa_fwd_bwd": 10.0, "sdpa_cudnn_fwd": 2.0, "sdpa_cudnn_fwd_bwd": 8.0,
                      "sdpa_flash_fwd": 3.0, "sdpa_flash_fwd_bwd": 12.0, **STAGE_TIMES},
                     memory={"nsa": 1.5, "sdpa_cudnn": 0.5, "sdpa_flash": 0.5}),
    synthetic_result("64/4/192/128", 8192,
                     {"nsa_fwd": 5.0, "nsa_fwd_bwd": 12.5, "sdpa_cudnn_fwd": 2.5, "sdpa_cudnn_fwd_bwd": 10.0},
                     memory={"nsa": 2.0, "sdpa_cudnn": 1.0},
                     errors={"sdpa_flash_fwd": "unavailable: No available kernel. [Flash attention requires q,k,v "
                                               "to have the same last dimension]",
                             "sdpa_flash_fwd_bwd": "unavailable: No available kernel. [Flash attention requires "
                                                   "q,k,v to have the same last dimension]"}),
    synthetic_result("64/4/128/128", 131072, {"sdpa_cudnn_fwd": 500.0},
                     errors={"nsa_fwd": "out of memory: CUDA out of memory. Tried to allocate 80.00 GiB"}),
    synthetic_result("64/4/192/128", 131072, {}, errors={"case": "skipped: time budget exhausted"}),
]


def table_row(text, label, seqlen):
    rows = [line for line in text.splitlines() if line.startswith(f"| {label} | {seqlen} |")]
    assert len(rows) == 2, rows  # the main table and the per-stage table
    return [[cell.strip() for cell in row.strip("|").split("|")] for row in rows]


def test_defaults_are_the_issue_matrix():
    args = bench.parse_args([])
    assert args.shapes == ["64/4/128/128", "32/8/128/128", "32/32/128/128", "28/4/128/128", "64/4/192/128"]
    assert args.seqlens == [8192, 16384, 32768, 65536, 131072]
    assert args.stages and args.time_budget_s is None and args.out == "bench/results"
    args = bench.parse_args(["--shapes", "64/4/128/128", "--seqlens", "8K", "65536", "--no-stages", "--dtype",
                             "float16", "--window", "256", "--time-budget-s", "420"])
    assert (args.shapes, args.seqlens, args.stages, args.dtype, args.window, args.time_budget_s) == \
        (["64/4/128/128"], [8192, 65536], False, "float16", 256, 420.0)
    assert bench.Shape.parse("28/4/192/128") == bench.Shape(28, 4, 192, 128)


def test_time_budget_is_shared_among_the_measurements_left():
    assert bench.Timer(rep_ms=100).target_ms() == 100
    timer = bench.Timer(rep_ms=100, budget_s=10)
    timer.measurements_left = 1000  # 10 s for 1000 measurements: 10 ms each
    assert 9 < timer.target_ms() <= 10
    timer.measurements_left = 10
    assert timer.target_ms() == 100  # never more than rep_ms
    assert not timer.out_of_time() and bench.Timer(budget_s=0).out_of_time()


def test_failure_reasons():
    oom = bench.failure_reason(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 9 GiB\nmore"), [])
    assert oom == "out of memory: CUDA out of memory. Tried to allocate 9 GiB"
    unsupported = sa.SparseAttnUnsupportedError("sparseattn.selected_attention: head dims 96/96 not built")
    assert bench.failure_reason(unsupported, []).startswith("unsupported: sparseattn.selected_attention")
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        warnings.warn("Flash attention requires q,k,v to have the same last dimension. (Triggered internally at "
                      "/pytorch/aten/src/ATen/native/transformers/sdp_utils_cpp.cpp:21.)")
    assert bench.failure_reason(RuntimeError("No available kernel.  Aborting execution."), warned) == \
        "unavailable: No available kernel.  Aborting execution. [Flash attention requires q,k,v to have the " \
        "same last dimension.]"


def test_markdown_table():
    text = bench.markdown(META, RESULTS)
    main, stages = table_row(text, "64/4, 128/128", "8K")
    # NSA, cuDNN, flash, cuDNN/NSA for fwd, then for fwd+bwd; TFLOP/s; peak GB; memory ratio
    assert main[2:10] == ["4.00", "2.00", "3.00", "0.50", "10.00", "8.00", "12.00", "0.80"]
    assert main[11:] == ["1.50 / 0.50", "3.00"]
    nsa_tflops = sum(bench.nsa_flops(bench.Shape(64, 4, 128, 128), 8192, CONFIG).values()) / 4e-3 / 1e12
    assert main[10].startswith(f"{nsa_tflops:.0f}, ")
    assert stages[2:] == ["0.100", "1.00", "10.00", "3.00", "1.50", "0.400", "16.00", "4.00"]

    main, _ = table_row(text, "64/4, 192/128", "8K")
    assert main[4] == main[8] == "unavailable" and main[5] == "0.50"
    main, stages = table_row(text, "64/4, 128/128", "128K")
    assert main[2] == "OOM" and main[3] == "500" and main[5] == "n/a" and stages[-1] == "OOM"
    main, _ = table_row(text, "64/4, 192/128", "128K")
    assert set(main[2:9]) - {"n/a"} == {"skipped"}
    # Shapes in order of first appearance, each by T, whatever the run order; every failure explained.
    assert text.index("| 64/4, 128/128 | 128K") < text.index("| 64/4, 192/128 | 8K")
    assert bench.markdown(META, [RESULTS[i] for i in (0, 3, 2, 1)]) == text
    assert "- `sdpa_flash_fwd` at 64/4, 192/128 T=8K: unavailable: No available kernel." in text
    assert "- `case` at 64/4, 192/128 T=128K: skipped: time budget exhausted" in text


def test_reports_from_json(tmp_path):
    saved = tmp_path / "run.json"
    saved.write_text(json.dumps({"meta": META, "results": RESULTS}))
    out = tmp_path / "out"
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError):
            bench.plot(META, RESULTS, str(tmp_path / "plot.png"))
        has_matplotlib = False
    else:
        has_matplotlib = True
    bench.main(["--from-json", str(saved), "--out", str(out)])
    stem = out / "Test_GPU_2026-01-02_abc1234"
    assert (stem.parent / (stem.name + ".md")).read_text() == bench.markdown(META, RESULTS)
    assert json.loads((stem.parent / (stem.name + ".json")).read_text())["results"] == RESULTS
    assert (stem.parent / (stem.name + ".png")).exists() == has_matplotlib


def test_kernel_names_are_shortened():
    assert bench.kernel_name(
        "void sparseattn::cuda::attention::attention_dkv_wgmma_kernel<__nv_bfloat16, 128, 128, "
        "sparseattn::cuda::attention::CompressedMask>(sparseattn::cuda::attention::AttnArgs<__nv_bfloat16>, "
        "sparseattn::cuda::attention::CompressedMask::Config)") == \
        "attention_dkv_wgmma_kernel<__nv_bfloat16, 128, 128, CompressedMask>"
    assert bench.kernel_name("(anonymous namespace)::selected_dkv_kernel<__half, 64, 64, 1>(Tokens<__half const>, "
                             "(anonymous namespace)::DkvConfig)") == "selected_dkv_kernel<__half, 64, 64, 1>"
    assert bench.kernel_name("(anonymous namespace)::make_keys_kernel") == "make_keys_kernel"


def test_markdown_lists_the_kernel_breakdown():
    result = dict(RESULTS[0], kernels_fwd_bwd_ms={"attention_dkv_wgmma_kernel<__nv_bfloat16>": 50.6, "combine": 1.5})
    text = bench.markdown(META, [result])
    assert "Kernels of one NSA fwd+bwd at 64/4, 128/128, T=8K (GPU ms, torch.profiler; total 52.10)" in text
    assert "| `attention_dkv_wgmma_kernel<__nv_bfloat16>` | 50.60 |" in text
    assert "--kernels" in bench.__doc__ and bench.parse_args(["--kernels"]).kernels


def test_drifting_tokens_have_locality_and_unit_size():
    gen = torch.Generator().manual_seed(0)
    x = bench.drifting_tokens(4096, 2, 64, device="cpu", dtype=torch.float32, generator=gen)[0]
    y = torch.randn(4096, 2, 64, generator=gen)
    assert x.shape == (4096, 2, 64)
    assert 0.5 < float(x.pow(2).mean().sqrt()) < 2.0

    def neighbour_cosine(t):
        return float(torch.nn.functional.cosine_similarity(t[1:], t[:-1], dim=-1).mean())

    assert neighbour_cosine(x) > 0.5 > 0.1 > abs(neighbour_cosine(y))


def test_inputs_mode_is_parsed_and_named_in_the_report_stem():
    args = bench.parse_args(["--inputs", "drifting"])
    assert args.inputs == "drifting"
    meta = {"gpu": "NVIDIA H100", "date": "2026-11-27", "commit": "abc", "inputs": "drifting"}
    assert bench.report_stem("out", meta).endswith("_abc_drifting")
    assert bench.report_stem("out", {**meta, "inputs": "random"}).endswith("_abc")


def test_the_commit_can_be_named_for_a_copy_of_the_tree(monkeypatch):
    monkeypatch.setenv("SPARSEATTN_COMMIT", "abc1234")
    assert bench.git_commit() == "abc1234"
    monkeypatch.delenv("SPARSEATTN_COMMIT")
    assert bench.git_commit() != "abc1234"


def test_sequence_lengths_take_k_and_m_suffixes():
    assert [bench.parse_seqlen(s) for s in ("8192", "8K", "8k", "1M", "2m")] == [8192, 8192, 8192, 1 << 20, 2 << 20]
    assert [bench.seqlen_label(n) for n in (8192, 1 << 20, 3 << 20, 1000, 1536 * 1024)] == ["8K", "1M", "3M", "1000",
                                                                                           "1536K"]
