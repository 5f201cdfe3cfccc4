"""The context-parallel benchmark (python -m sparseattn.bench_distributed) without a GPU: a smoke run over 1 and 2
gloo ranks on the CPU reference (the report's numbers and files), the derived efficiencies and bars from synthetic
results, and a configuration that does not finish in time recorded as such."""
import json

import pytest
import torch

from helpers import require_sparseattn

sa = require_sparseattn()
import torch.distributed as dist  # noqa: E402

from sparseattn import bench_distributed as bd  # noqa: E402

SMALL = "cmp_block=16,cmp_stride=8,sel_block=32,num_selected=4,window=64"
SHAPE = bd.Shape.parse("4/1/32/32")


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed gloo")
def test_smoke_run_on_cpu(tmp_path, capsys):
    bd.main(["--device", "cpu", "--dtype", "float32", "--gpus", "1", "2", "--tokens-per-gpu", "200", "--heads", "4/1",
             "--dim", "32", "--config", SMALL, "--repeats", "1", "--whole", "--out", str(tmp_path)])
    (json_path,) = tmp_path.glob("cpu_*_distributed.json")
    saved = json.loads(json_path.read_text())
    timed = saved["timed"]
    assert [(r["ranks"], r["tokens"], r["error"]) for r in timed] == [(1, 200, None), (2, 400, None)]
    for r in timed:
        assert r["fwd_ms"] > 0 and r["fwd_bwd_ms"] > 0 and r["peak_gib"] is None
    assert timed[0]["token_efficiency"] == pytest.approx(1.0)
    assert timed[1]["token_efficiency"] == pytest.approx(timed[0]["fwd_bwd_ms"] / timed[1]["fwd_bwd_ms"])
    (whole,) = saved["whole"]
    assert (whole["ranks"], whole["tokens"], whole["error"]) == (1, 400, None)
    assert timed[1]["same_length_efficiency"] == pytest.approx(whole["fwd_bwd_ms"] / (2 * timed[1]["fwd_bwd_ms"]))
    assert saved["meta"]["config"]["num_selected"] == 4 and saved["meta"]["shape"] == "4/1/32/32"
    text = json_path.with_suffix(".md").read_text()
    assert "| 2 | 400 |" in text and "same-length efficiency" in text
    assert "wrote" in capsys.readouterr().out


def test_efficiencies_and_bars():
    config = bd.parse_config(SMALL)
    timed = [{"ranks": 1, "tokens": 1000, "error": None, "fwd_ms": 1.0, "fwd_bwd_ms": 4.0, "peak_gib": 1.0},
             {"ranks": 4, "tokens": 4000, "error": None, "fwd_ms": 2.0, "fwd_bwd_ms": 8.0, "peak_gib": 1.5}]
    bd.summarize(timed, SHAPE, config)
    assert timed[1]["token_efficiency"] == pytest.approx(0.5)  # 4x the tokens in 2x the time, on 4 ranks
    work = sum(bd.nsa_flops(SHAPE, 4000, config).values()) / sum(bd.nsa_flops(SHAPE, 1000, config).values())
    assert work > 4  # the compressed branch grows with the square of the sequence
    assert timed[1]["work_efficiency"] == pytest.approx(work / 2 / 4)
    fits = [{"ranks": 4, "tokens": 2 << 20, "error": "out of memory"}]
    bars = {b["bar"]: b for b in bd.evaluate_bars(timed, fits)}
    expected = "tokens no, work yes" if work / 8 >= 0.85 else "no"
    assert bars["4 GPUs: throughput >= 0.85 x 4 x one GPU's"]["met"] == expected
    assert bars["2M tokens fit on 4 GPUs"]["met"] == "no"
    text = bd.markdown({"gpu": "X", "max_ranks": 4, "commit": "abc", "dtype": "bfloat16", "shape": "4/1/32/32",
                        "tokens_per_gpu": 1000, "repeats": 3, "config": {}, "bars": bd.evaluate_bars(timed, fits)},
                       timed, fits)
    assert "no: out of memory" in text and "| 4 | 4000 |" in text


def test_a_group_past_its_time_limit_is_recorded(tmp_path):
    args = bd.parse_args(["--device", "cpu", "--case-timeout-s", "1", "--config", SMALL])
    args.shape = "4/1/32/32"
    result = bd.run_group(args, 2, 1 << 20, 0)
    assert result["error"] == "timed out after 1 s" and result["ranks"] == 2


def test_bad_arguments():
    with pytest.raises(SystemExit, match="no field 'window_size'"):
        bd.parse_config("window_size=3")
    assert bd.parse_fit("4:2M".replace("M", "K")) == (4, 2048)
