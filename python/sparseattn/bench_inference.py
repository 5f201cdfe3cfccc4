"""The inference benchmark: NSA serving a model (decode steps, chunked prefill, model.generate()) against dense
decoding, timed in one process.

    python -m sparseattn.bench_inference                          # every section, the issue's cases
    python -m sparseattn.bench_inference --time-budget-s 420      # ... fitted into about 7 minutes
    python -m sparseattn.bench_inference --sections decode --decode-contexts 32K 128K --decode-batches 1
    python -m sparseattn.bench_inference --sections generate --generate-prompts 16K 64K
    python -m sparseattn.bench_inference --from-json bench/results/X_inference.json --out /tmp/x   # no GPU
    python -m sparseattn.bench_inference --device cpu             # tiny smoke run on the CPU reference

Heads --heads (64/4), head dim --head-dim (128) for q, k and v, dtype --dtype (bf16), NSA defaults
(sparseattn.NSAConfig) except --window. Sections and exactly what each measures:

  decode    A decode step: --decode-queries (Tq, 1) new queries per sequence against a KV cache of S keys
            (--decode-contexts 8K 32K 64K 128K) at batch B (--decode-batches 1 64), the queries the last Tq
            positions (bottom-right). K and V are [B, S, Hkv, D], the same memory for every method:
              nsa             nsa_attention(q, k, v, g_cmp, g_slc, g_swa): the whole NSA pipeline of the step,
                              the compressed K/V pooled from the S keys inside the call (what sparseattn.hf does
                              at every step).
              nsa_cmp_given   the same with k_cmp, v_cmp = compress_kv(k, v) computed once beforehand (untimed):
                              a server that keeps the compressed K/V as a second cache. Same output as nsa.
              flash_decode    sparseattn.flash_decode(q, k, v, cache_seqlens=[S]*B): our dense split-KV decode.
              sdpa_cudnn      torch SDPA with the cuDNN backend, and sdpa_flash with the flash backend, on
              sdpa_flash      [B, H, S, D] views, enable_gqa=True (no mask for Tq = 1, else a bool bottom-right
                              mask); "fastest SDPA" is the faster of the two that ran.
              nsa_decode      sparseattn.nsa_decode over the same K/V seen as pages of 64 keys (block table
                              [B, S/64], each sequence its own pages) with k_cmp, v_cmp = compress_kv(k, v) as the
                              compressed cache: the paged NSA decode kernels. Same rows as nsa.
              flash_decode_paged  flash_decode over those pages: our dense decode over the same paged cache.
            Each method is timed eagerly (bench.py's timer) and as the replay of a CUDA graph captured once per
            shape (warm-up on a side stream, then torch.cuda.graph); a failed capture is recorded with its reason
            and the eager time stands. Reported: ms per step, tokens/s = B * Tq / step time, time / flash_decode
            time, time / fastest SDPA time, and for the dense methods the K/V bytes read per second.
            Bars (graph times, Tq = 1; checked for nsa and for nsa_decode against flash_decode_paged, and shown
            for nsa_cmp_given as a variant):
              at 128K, B = 1: NSA step <= 0.12 ms, and NSA time / flash_decode time <= 0.25;
              at 32K, B = 64: NSA tokens/s / flash_decode tokens/s >= 5.
  prefill   Chunked prefill: C new tokens (--prefill-chunk 8K) against a cache of S keys (--prefill-context 128K:
            the chunk included, so S - C cached keys before it), batch --prefill-batch (1), under torch.no_grad():
              chunk           nsa_attention(q[:, S-C:], k, v, gates[:, S-C:]): one chunk call;
              full            nsa_attention(q, k, v, gates) on all S tokens: the training forward of the sequence;
              full_before     the same on the first S - C tokens;
              chunked         the S tokens as S/C chunk calls in order, chunk i against keys [0, (i+1)C).
            The training forward's time on the chunk's tokens is its marginal time, full - full_before: what its
            last C rows add (their keys' compression included). A chunk at the end of the sequence does more than
            the average row (its queries see the most compressed blocks), so the average throughputs (chunk
            tokens/s = B*C / chunk time against B*S / full time, also reported) differ even where the kernels are
            equally efficient; chunked tokens/s = B*S / chunked time is the whole prefill done in chunks.
            Bar: chunk speed / the training forward's on the same tokens = (full - full_before) / chunk >= 0.9.
  generate  model.generate() of a random-initialised Llama of about 1B parameters (--generate-model 1b: hidden
            2048, 12 layers, MLP 5632, vocabulary 32000, --heads and --head-dim attention) with NSA attention
            (sparseattn.hf.NSALlamaForCausalLM, SparseAttnCache) and with SDPA attention (transformers'
            LlamaForCausalLM, attn_implementation="sdpa", DynamicCache: generate()'s default cache), batch
            --generate-batch (16), prompts of P tokens (--generate-prompts 64K), greedy, N new tokens
            (--generate-new-tokens 32). Prefill, timed on its own: the first P - 1 prompt tokens run through the
            model in groups of --generate-prefill-group sequences (1: one whole sequence per forward, so that no
            attention mask is materialised), and the groups' caches are joined into the batch's cache (timed
            apart, "join"). Decode: generate(prompt, past_key_values=cache, max_new_tokens=N), N forwards of
            one token per sequence each (the last prompt token, then N - 1 generated ones); run
            --generate-reps (3) times, the cache cropped back to P - 1 tokens between runs; median.
            Reported: prefill time and tokens/s (B*(P-1)/prefill time), generate time, ms per step (time / N),
            decode tokens/s = B*N / generate time, peak memory. Bar: at P = 64K, NSA decode tokens/s / SDPA
            decode tokens/s >= 3. --generate-prompts takes several lengths (e.g. 16K 64K) where 64K does not
            fit; a length that runs out of memory is recorded as OOM.
            --generate-modes (cuda: eager graph; cpu: eager): "eager" is the above; "graph" then copies the
            prefilled cache into a fixed-capacity one (NSA: sparseattn.hf.SparseAttnStaticCache; SDPA:
            transformers' StaticCache; P + N tokens, "join" timed apart) and times generate() from it, which on
            CUDA makes transformers compile the model's forward (mode "reduce-overhead": each decode step a CUDA
            graph replay). One untimed generate() first (compilation, graph recording), then --generate-reps
            timed ones, the cache rewound to P - 1 tokens before each; reported as the models nsa_graph and
            sdpa_graph, with whether transformers did compile (notes *_graph_compiled; on the CPU it does not: the
            static caches then run eagerly). Bar: the same ratio, graph mode, >= 3. While copying, both caches
            are held (at 64K, batch 16, NSA after the eager runs: a 128K-token SparseAttnCache plus the static
            cache, about 75 GB: an H200; --generate-modes graph alone skips the eager runs and their growth).

Timing and failures are bench.py's: CUDA events, L2 flush and a GPU sleep before each timed run, median;
--time-budget-s shares the budget among the measurements left, and what is not started within it is recorded
as skipped. A measurement that fails is recorded with its reason ("OOM", "unsupported": no CUDA kernel for it in
this build, "unavailable": e.g. an SDPA backend that does not take the call, "capture failed", "skipped") and
the run goes on. generate() is timed with the wall clock around the call (after a device synchronisation).

--device cpu runs every section on the CPU reference with tiny defaults (4/2 heads, head dim 16, float32,
contexts 512 and 1024, batches 1 and 2, a 128-token chunk of 1024 keys, a 2-layer model with a 48-token prompt)
and a wall-clock timer, to check the benchmark itself; CUDA graphs and SDPA's GPU backends are then recorded as
unavailable. Any option given explicitly overrides these defaults.

Reports: <out>/<GPU>_<date>_<commit>_inference.json and .md, rewritten after every case; the bars are printed
with met / not met at the end.
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import statistics
import time
import warnings
from dataclasses import asdict, dataclass
from typing import Callable, Optional

import torch

from . import bench
from .bench import Case, Shape, fmt_ms, fmt_number, ratio, seqlen_label, time_cell
from .bench_flash import (WallClockTimer, decode_sdpa_mask, guarded, heads_first, not_measured_lines,
                          peak_hbm_bytes_per_s)
from .decode import flash_decode
from .functional import NSAConfig, compress_kv, nsa_attention
from .nsa_decode import nsa_decode

SECTIONS = ("decode", "prefill", "generate")
SECTION_TITLES = {"decode": "Decode step against a KV cache", "prefill": "Chunked prefill",
                  "generate": "model.generate() of a ~1B Llama"}
DECODE_METHODS = ("nsa", "nsa_cmp_given", "flash_decode", "sdpa_cudnn", "sdpa_flash", "nsa_decode",
                  "flash_decode_paged")
DENSE_DECODE_METHODS = ("flash_decode", "sdpa_cudnn", "sdpa_flash", "flash_decode_paged")
#: The page size of the paged decode methods (the dense cache's memory seen as pages, no copy).
DECODE_PAGE_SIZE = 64
SDPA_METHODS = ("sdpa_cudnn", "sdpa_flash")
MODES = ("graph", "eager")
PREFILL_METHODS = ("chunk", "full", "full_before", "chunked")
MODELS = ("nsa", "sdpa")
METHOD_LABELS = {
    "nsa": "NSA",
    "nsa_cmp_given": "NSA, compressed K/V given",
    "flash_decode": "sparseattn flash_decode",
    "sdpa_cudnn": "SDPA cuDNN",
    "sdpa_flash": "SDPA flash",
    "nsa_decode": "NSA decode, paged (nsa_decode)",
    "flash_decode_paged": "sparseattn flash_decode, paged",
    "chunk": "one chunk",
    "full": "full forward",
    "full_before": "full forward of the first S - C tokens",
    "chunked": "all chunks in order",
}
GENERATE_MODES = ("eager", "graph")
#: The generate section's models in graph mode (same models, fixed-capacity caches, compiled decode steps).
GRAPH_MODELS = ("nsa_graph", "sdpa_graph")
MODEL_LABELS = {"nsa": "NSA (NSALlamaForCausalLM, SparseAttnCache)", "sdpa": "SDPA (LlamaForCausalLM, DynamicCache)",
                "nsa_graph": "NSA (SparseAttnStaticCache, compiled step, CUDA graph)",
                "sdpa_graph": "SDPA (StaticCache, compiled step, CUDA graph)"}
NO_GRAPH_ON_CPU = "unavailable: CUDA graphs need a CUDA device"

#: Llama architectures of the generate section (the attention heads and head dim come from --heads, --head-dim).
MODEL_PRESETS = {
    "1b": {"vocab_size": 32000, "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 12},
    "tiny": {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2},
}

#: Defaults of the options that depend on --device: the issue's cases on CUDA, a tiny smoke run on the CPU.
DEVICE_DEFAULTS = {
    "cuda": {"heads": "64/4", "head_dim": 128, "dtype": "bfloat16", "decode_contexts": ["8K", "32K", "64K", "128K"],
             "decode_batches": [1, 64], "prefill_context": "128K", "prefill_chunk": "8K", "generate_prompts": ["64K"],
             "generate_batch": 16, "generate_new_tokens": 32, "generate_model": "1b", "generate_reps": 3,
             "generate_modes": ["eager", "graph"], "rep_ms": 100.0, "warmup_ms": 25.0, "max_reps": 100},
    "cpu": {"heads": "4/2", "head_dim": 16, "dtype": "float32", "decode_contexts": ["512", "1024"],
            "decode_batches": [1, 2], "prefill_context": "1024", "prefill_chunk": "128", "generate_prompts": ["48"],
            "generate_batch": 2, "generate_new_tokens": 3, "generate_model": "tiny", "generate_reps": 2,
            "generate_modes": ["eager"], "rep_ms": 1.0, "warmup_ms": 0.0, "max_reps": 2},
}


# ---------------------------------------------------------------------------------------------------- bars


@dataclass(frozen=True)
class Bar:
    """A target: the value at `path` in the results of `section` whose fields match `at`, compared with `limit`
    (at most, or at least with `at_least`). `needs` are the measurements whose failure explains a missing value."""
    section: str
    name: str
    path: tuple
    at: tuple
    limit: float
    at_least: bool
    needs: tuple
    variant: bool = False

    def met(self, value: float) -> bool:
        return value >= self.limit if self.at_least else value <= self.limit

    def where(self) -> str:
        """The case fields the bar is checked at, e.g. "context=128K, batch=1"; "" for every case."""
        return ", ".join(f"{field}={seqlen_label(value) if field in ('context', 'prompt') else value}"
                         for field, value in self.at)


def decode_bars(method: str, variant: bool, dense: str = "flash_decode") -> tuple:
    label = METHOD_LABELS[method]
    at_128k, at_32k = (("context", 131072), ("batch", 1), ("queries", 1)), (("context", 32768), ("batch", 64),
                                                                             ("queries", 1))
    graph = f"{method}_graph"
    return (
        Bar("decode", f"decode: {label} step from a CUDA graph at 128K, B=1 <= 0.12 ms", ("times_ms", graph),
            at_128k, 0.12, False, (graph,), variant),
        Bar("decode", f"decode: {label} / {dense} time (graphs) at 128K, B=1 <= 0.25",
            (f"time_vs_{dense}", graph), at_128k, 0.25, False, (graph, f"{dense}_graph"), variant),
        Bar("decode", f"decode: {label} tokens/s / {dense} tokens/s (graphs) at 32K, B=64 >= 5",
            (f"speedup_vs_{dense}", graph), at_32k, 5.0, True, (graph, f"{dense}_graph"), variant),
    )


BARS = (decode_bars("nsa", False) + decode_bars("nsa_cmp_given", True)
        + decode_bars("nsa_decode", False, "flash_decode_paged") + (
    Bar("prefill", "prefill: chunk speed / the training forward's speed on the same tokens >= 0.9",
        ("chunk_vs_marginal",), (), 0.9, True, ("chunk", "full", "full_before")),
    Bar("generate", "generate: NSA decode tokens/s / SDPA decode tokens/s at a 64K prompt >= 3",
        ("nsa_vs_sdpa_decode_tokens_per_s",), (("prompt", 65536),), 3.0, True, ("nsa_generate", "sdpa_generate")),
    Bar("generate", "generate (compiled steps, CUDA graphs): NSA decode tokens/s / SDPA decode tokens/s at a 64K "
        "prompt >= 3", ("nsa_vs_sdpa_decode_tokens_per_s_graph",), (("prompt", 65536),), 3.0, True,
        ("nsa_graph_generate", "sdpa_graph_generate")),
    Bar("generate", "generate (each model in its faster mode): NSA decode tokens/s / SDPA decode tokens/s at a 64K "
        "prompt >= 3", ("best_nsa_vs_best_sdpa_decode_tokens_per_s",), (("prompt", 65536),), 3.0, True,
        ("nsa_generate", "nsa_graph_generate", "sdpa_generate", "sdpa_graph_generate")),
))


def lookup(result: dict, path: tuple) -> Optional[float]:
    value = result
    for key in path:
        if not isinstance(value, dict):
            return None
        value = value.get(key)
    return value


def evaluate_bars(results: list[dict]) -> list[dict]:
    """One row per bar and matching case: value, limit, status met / not met / not measured (with the reason);
    a bar with no matching case gets one row "not measured (no case at ...)"."""
    rows = []
    for bar in BARS:
        matching = [r for r in results if r["section"] == bar.section
                    and all(r.get(field) == value for field, value in bar.at)]
        row = {"bar": bar.name, "section": bar.section, "limit": bar.limit, "at_least": bar.at_least,
               "variant": bar.variant}
        if not matching:
            missing = f"no case at {bar.where()}" if bar.at else "no case"
            rows.append({**row, "case": bar.where() or "any", "value": None, "status": f"not measured ({missing})"})
            continue
        for result in matching:
            value = lookup(result, bar.path)
            if value is None:
                errors = result.get("errors", {})
                reason = next((errors[key] for key in (*bar.needs, "case") if errors.get(key)), "no time")
                status = f"not measured ({reason.split(':')[0]})"
            else:
                status = "met" if bar.met(value) else "not met"
            rows.append({**row, "case": case_label(result), "value": value, "status": status})
    return rows


def bar_lines(bars: list[dict]) -> list[str]:
    return [f"bar {b['bar']}{' (variant)' if b['variant'] else ''} at {b['case']}: {fmt_number(b['value'], 3)}: "
            f"{b['status']}" for b in bars]


# ----------------------------------------------------------------------------------------------- results


def case_label(result: dict) -> str:
    section = result["section"]
    if section == "decode":
        return f"B={result['batch']}, S={seqlen_label(result['context'])}, Tq={result['queries']}"
    if section == "prefill":
        return f"B={result['batch']}, C={seqlen_label(result['chunk'])} of S={seqlen_label(result['context'])}"
    return f"B={result['batch']}, P={seqlen_label(result['prompt'])}, N={result['new_tokens']}"


def new_result(section: str, args, **fields) -> dict:
    """The result dict of one case before its measurements: bench.Case's keys, the section and the case's
    fields (decode: batch, context, queries; prefill: batch, context, chunk; generate: batch, prompt,
    new_tokens)."""
    heads_q, heads_kv = parse_heads(args.heads)
    shape = Shape(heads_q, heads_kv, args.head_dim, args.head_dim)
    return {"section": section, **fields, "shape": asdict(shape), "times_ms": {}, "reps": {}, "peak_memory_gb": {},
            "errors": {}, "notes": {}}


def skipped_result(section: str, args, reason: str, **fields) -> dict:
    result = new_result(section, args, **fields)
    result["errors"]["case"] = reason
    return result


def summarize(result: dict, element_bytes: int) -> dict:
    """Adds the derived numbers of a result: tokens/s and ratios (decode, prefill), or per-model rates (generate)."""
    section, times = result["section"], result["times_ms"]
    if section == "decode":
        shape = result["shape"]
        tokens = result["batch"] * result["queries"]
        result["kv_bytes"] = (result["batch"] * result["context"] * shape["heads_kv"]
                              * (shape["dim_qk"] + shape["dim_v"]) * element_bytes)
        result["tokens_per_s"], result["time_vs_flash_decode"], result["speedup_vs_flash_decode"] = {}, {}, {}
        result["time_vs_sdpa_best"], result["kv_bytes_per_s"], result["sdpa_best"] = {}, {}, {}
        result["time_vs_flash_decode_paged"], result["speedup_vs_flash_decode_paged"] = {}, {}
        for mode in MODES:
            ran = [(times[f"{m}_{mode}"], m) for m in SDPA_METHODS if times.get(f"{m}_{mode}") is not None]
            best = min(ran)[1] if ran else None
            result["sdpa_best"][mode] = best
            for method in DECODE_METHODS:
                key = f"{method}_{mode}"
                ms = times.get(key)
                dense_ms = times.get(f"flash_decode_{mode}")
                result["tokens_per_s"][key] = None if ms is None else tokens / (ms * 1e-3)
                result["time_vs_flash_decode"][key] = ratio(ms, dense_ms)
                result["speedup_vs_flash_decode"][key] = ratio(dense_ms, ms)
                paged_ms = times.get(f"flash_decode_paged_{mode}")
                result["time_vs_flash_decode_paged"][key] = ratio(ms, paged_ms)
                result["speedup_vs_flash_decode_paged"][key] = ratio(paged_ms, ms)
                result["time_vs_sdpa_best"][key] = ratio(ms, times.get(f"{best}_{mode}") if best else None)
                if method in DENSE_DECODE_METHODS:
                    result["kv_bytes_per_s"][key] = None if ms is None else result["kv_bytes"] / (ms * 1e-3)
    elif section == "prefill":
        tokens = {"chunk": result["batch"] * result["chunk"], "full": result["batch"] * result["context"],
                  "full_before": result["batch"] * (result["context"] - result["chunk"]),
                  "chunked": result["batch"] * result["context"]}
        result["tokens_per_s"] = {m: None if times.get(m) is None else tokens[m] / (times[m] * 1e-3)
                                  for m in PREFILL_METHODS}
        result["tokens_per_s_vs_full"] = {m: ratio(result["tokens_per_s"][m], result["tokens_per_s"]["full"])
                                          for m in PREFILL_METHODS}
        # The training forward's time on the chunk's tokens: its time on all S tokens less its time on the first
        # S - C (what the last C rows add, their keys' compression included).
        full, before = times.get("full"), times.get("full_before")
        result["marginal_ms"] = None if full is None or before is None else full - before
        result["chunk_vs_marginal"] = ratio(result["marginal_ms"], times.get("chunk"))
    else:
        prefill_tokens = result["batch"] * (result["prompt"] - 1)
        decode_tokens = result["batch"] * result["new_tokens"]
        result["prefill_tokens_per_s"], result["decode_tokens_per_s"], result["ms_per_step"] = {}, {}, {}
        graph_models = tuple(m for m in GRAPH_MODELS if f"{m}_generate" in times)
        for model in MODELS + graph_models:
            prefill_ms, generate_ms = times.get(f"{model}_prefill"), times.get(f"{model}_generate")
            result["prefill_tokens_per_s"][model] = None if prefill_ms is None else prefill_tokens / (prefill_ms * 1e-3)
            result["decode_tokens_per_s"][model] = None if generate_ms is None else decode_tokens / (generate_ms * 1e-3)
            result["ms_per_step"][model] = None if generate_ms is None else generate_ms / result["new_tokens"]
        result["nsa_vs_sdpa_decode_tokens_per_s"] = ratio(result["decode_tokens_per_s"]["nsa"],
                                                          result["decode_tokens_per_s"]["sdpa"])
        result["nsa_vs_sdpa_decode_tokens_per_s_graph"] = ratio(result["decode_tokens_per_s"].get("nsa_graph"),
                                                                result["decode_tokens_per_s"].get("sdpa_graph"))

        def fastest(name: str) -> Optional[float]:
            rates = [result["decode_tokens_per_s"].get(model) for model in (name, f"{name}_graph")]
            rates = [rate for rate in rates if rate is not None]
            return max(rates) if rates else None

        result["best_nsa_vs_best_sdpa_decode_tokens_per_s"] = ratio(fastest("nsa"), fastest("sdpa"))
    return result


# ------------------------------------------------------------------------------------------------ helpers


def parse_heads(text: str) -> tuple[int, int]:
    """HQ/HKV, e.g. 64/4."""
    try:
        heads_q, heads_kv = (int(x) for x in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not HQ/HKV (e.g. 64/4)") from None
    if min(heads_q, heads_kv) < 1 or heads_q % heads_kv:
        raise argparse.ArgumentTypeError(f"{text!r}: heads must be positive and HKV must divide HQ")
    return heads_q, heads_kv


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def free_memory(device: str) -> None:
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def capture_graph(fn: Callable[[], object]):
    """(graph, its output) of fn captured in a CUDA graph after two warm-up runs on a side stream (as
    torch.cuda.graph asks), so that lazy initialisation (cuBLAS handles, cuDNN plans) happens outside it."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        output = fn()
    return graph, output


def capture_failure(error: BaseException) -> str:
    if isinstance(error, torch.OutOfMemoryError):
        return bench.failure_reason(error, [])
    message = (str(error).strip().splitlines() or [type(error).__name__])[0][:300]
    return f"capture failed: {type(error).__name__}: {message}"


def measure_step(case: Case, method: str, step: Callable[[], object], device: str) -> None:
    """Times one decode step eagerly (method_eager, with its peak memory on CUDA) and as the replay of a CUDA
    graph captured once (method_graph); both under torch.no_grad()."""
    with torch.no_grad():
        case.measure(f"{method}_eager", guarded(step), peak_memory=device == "cuda")
        if case.result["times_ms"][f"{method}_eager"] is None:
            case.fail(f"{method}_graph", "skipped: the eager call failed")
            return
        if device != "cuda":
            case.fail(f"{method}_graph", NO_GRAPH_ON_CPU)
            return
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                graph, output = capture_graph(step)
        except Exception as error:  # noqa: BLE001 - recorded with its reason, never swallowed
            case.fail(f"{method}_graph", capture_failure(error))
            free_memory(device)
            return
        case.measure(f"{method}_graph", graph.replay)
        del graph, output


def sdpa_step(backend_name: str, q, k, v):
    """SDPA over [B, H, T, D] views of the token-major tensors with one backend, enable_gqa; a bottom-right bool
    mask when there are several queries."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = {"sdpa_cudnn": SDPBackend.CUDNN_ATTENTION, "sdpa_flash": SDPBackend.FLASH_ATTENTION}[backend_name]
    qh, kh, vh = heads_first(q, k, v)
    attn_mask = decode_sdpa_mask(q.shape[1], k.shape[1], q.device)

    def step():
        with sdpa_kernel([backend]):
            return torch.nn.functional.scaled_dot_product_attention(qh, kh, vh, attn_mask=attn_mask, enable_gqa=True)
    return step


def random_gates(batch: int, tokens: int, heads: int, device: str, dtype: torch.dtype) -> list[torch.Tensor]:
    return [torch.sigmoid(torch.randn(batch, tokens, heads, device=device)).to(dtype) for _ in range(3)]


# ------------------------------------------------------------------------------------------------ sections


def paged_view(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The dense cache [B, S, Hkv, D] seen as pages [B*S/P, P, Hkv, D] of DECODE_PAGE_SIZE keys (the same memory;
    a copy padded to whole pages where P does not divide S) and the block table int32 [B, ceil(S/P)] that gives
    each sequence its own pages in order."""
    batch, context = k.shape[:2]
    pages = -(-context // DECODE_PAGE_SIZE)

    def as_pages(t: torch.Tensor) -> torch.Tensor:
        if context % DECODE_PAGE_SIZE:
            padded = t.new_zeros(batch, pages * DECODE_PAGE_SIZE, *t.shape[2:])
            padded[:, :context] = t
            t = padded
        return t.view(batch * pages, DECODE_PAGE_SIZE, *t.shape[2:])

    table = torch.arange(batch * pages, dtype=torch.int32, device=k.device).view(batch, pages)
    return as_pages(k), as_pages(v), table


def decode_steps(q, k, v, gates, k_cmp, v_cmp, config: NSAConfig) -> dict[str, Callable[[], object]]:
    """The step of every decode method on the same q, K/V cache and gates (k_cmp, v_cmp: compress_kv(k, v)); the
    paged methods read the same K/V memory as pages (paged_view)."""
    batch, context = k.shape[:2]
    cache_seqlens = torch.full((batch,), context, dtype=torch.int32, device=q.device)
    k_pages, v_pages, table = paged_view(k, v)
    return {
        "nsa_decode": lambda: nsa_decode(q, k_pages, v_pages, block_table=table, cache_seqlens=cache_seqlens,
                                         k_cmp=k_cmp, v_cmp=v_cmp, g_cmp=gates[0], g_slc=gates[1], g_swa=gates[2],
                                         config=config),
        "flash_decode_paged": lambda: flash_decode(q, k_pages, v_pages, cache_seqlens=cache_seqlens,
                                                   block_table=table, causal=True),
        "nsa": lambda: nsa_attention(q, k, v, *gates, config=config),
        "nsa_cmp_given": lambda: nsa_attention(q, k, v, *gates, config=config, k_cmp=k_cmp, v_cmp=v_cmp),
        "flash_decode": lambda: flash_decode(q, k, v, cache_seqlens=cache_seqlens, causal=True),
        "sdpa_cudnn": sdpa_step("sdpa_cudnn", q, k, v),
        "sdpa_flash": sdpa_step("sdpa_flash", q, k, v),
    }


def run_decode(case: Case, args, config: NSAConfig, device: str) -> None:
    result = case.result
    heads_q, heads_kv = parse_heads(args.heads)
    dtype = getattr(torch, args.dtype)
    batch, context, queries = result["batch"], result["context"], result["queries"]
    try:
        q = torch.randn(batch, queries, heads_q, args.head_dim, device=device, dtype=dtype)
        k, v = (torch.randn(batch, context, heads_kv, args.head_dim, device=device, dtype=dtype) for _ in range(2))
        gates = random_gates(batch, queries, heads_q, device, dtype)
    except (RuntimeError, ValueError) as error:
        result["errors"]["case"] = bench.failure_reason(error, [])
        return
    try:
        with torch.no_grad():
            k_cmp, v_cmp = compress_kv(k, v, block=config.cmp_block, stride=config.cmp_stride)
    except (RuntimeError, ValueError) as error:
        k_cmp = v_cmp = None
        for mode in MODES:
            for method in ("nsa_cmp_given", "nsa_decode"):
                case.fail(f"{method}_{mode}", "skipped: compress_kv failed: " + bench.failure_reason(error, []))
    steps = decode_steps(q, k, v, gates, k_cmp, v_cmp, config)
    # The paged methods first: under a time budget they are the ones the bars of nsa_decode need.
    for method in sorted(DECODE_METHODS, key=lambda m: m not in ("nsa_decode", "flash_decode_paged")):
        if k_cmp is None and method in ("nsa_cmp_given", "nsa_decode"):
            continue
        measure_step(case, method, steps[method], device)


def run_prefill(case: Case, args, config: NSAConfig, device: str) -> None:
    result = case.result
    heads_q, heads_kv = parse_heads(args.heads)
    dtype = getattr(torch, args.dtype)
    batch, context, chunk = result["batch"], result["context"], result["chunk"]
    try:
        q = torch.randn(batch, context, heads_q, args.head_dim, device=device, dtype=dtype)
        k, v = (torch.randn(batch, context, heads_kv, args.head_dim, device=device, dtype=dtype) for _ in range(2))
        gates = random_gates(batch, context, heads_q, device, dtype)
    except (RuntimeError, ValueError) as error:
        result["errors"]["case"] = bench.failure_reason(error, [])
        return
    # Batch 1 slices along the tokens are contiguous; larger batches get contiguous copies, made before timing.
    chunk_q = q[:, context - chunk:].contiguous()
    chunk_gates = [g[:, context - chunk:].contiguous() for g in gates]
    pieces = [(q[:, a:a + chunk].contiguous(), k[:, :a + chunk].contiguous(), v[:, :a + chunk].contiguous(),
               [g[:, a:a + chunk].contiguous() for g in gates]) for a in range(0, context, chunk)]

    def chunked():
        for piece_q, piece_k, piece_v, piece_gates in pieces:
            nsa_attention(piece_q, piece_k, piece_v, *piece_gates, config=config)

    with torch.no_grad():
        case.measure("chunk", guarded(lambda: nsa_attention(chunk_q, k, v, *chunk_gates, config=config)),
                     peak_memory=device == "cuda")
        case.measure("full", guarded(lambda: nsa_attention(q, k, v, *gates, config=config)),
                     peak_memory=device == "cuda")
        before = context - chunk
        if before > 0:
            head = [t[:, :before].contiguous() for t in (q, k, v, *gates)]
            case.measure("full_before", guarded(lambda: nsa_attention(*head, config=config)))
        case.measure("chunked", guarded(chunked))


# ---------------------------------------------------------------------------------------- generate section


def model_config(args, nsa: bool, max_positions: int):
    """The Llama config of --generate-model with --heads, --head-dim and, for NSA, --window."""
    from transformers import LlamaConfig

    from .hf import NSALlamaConfig

    heads_q, heads_kv = parse_heads(args.heads)
    fields = dict(MODEL_PRESETS[args.generate_model], num_attention_heads=heads_q, num_key_value_heads=heads_kv,
                  head_dim=args.head_dim, max_position_embeddings=max_positions, tie_word_embeddings=False,
                  pad_token_id=0, bos_token_id=None, eos_token_id=None)
    return NSALlamaConfig(nsa_window=args.window, **fields) if nsa else LlamaConfig(**fields)


def build_model(args, nsa: bool, max_positions: int, device, dtype: torch.dtype):
    """A random-initialised NSALlamaForCausalLM (nsa) or LlamaForCausalLM with SDPA attention, created on
    `device` in `dtype`, in eval mode."""
    from transformers import LlamaForCausalLM

    from .hf import NSALlamaForCausalLM

    config = model_config(args, nsa, max_positions)
    with torch.device(device):
        if nsa:
            model = NSALlamaForCausalLM._from_config(config, dtype=dtype)
        else:
            model = LlamaForCausalLM._from_config(config, dtype=dtype, attn_implementation="sdpa")
    return model.eval()


def parameter_count(args, nsa: bool) -> int:
    """Parameters of the generate section's model (built on the meta device: no memory, no initialisation)."""
    return sum(p.numel() for p in build_model(args, nsa, 4096, "meta", torch.float32).parameters())


def new_cache(nsa: bool):
    from transformers import DynamicCache

    from .hf import SparseAttnCache

    return SparseAttnCache() if nsa else DynamicCache()


def prefill(model, prompt: torch.Tensor, group: int, nsa: bool, device: str):
    """Runs the first P - 1 tokens of every prompt through the model, `group` sequences per forward (each with a
    fresh cache of the model's kind: SparseAttnCache for NSA, DynamicCache for SDPA), then joins the groups' keys
    and values, layer by layer, into one such cache of the batch. Returns (cache, prefill ms, join ms)."""
    start = time.perf_counter()
    layer_keys, layer_values = None, None
    with torch.no_grad():
        for first in range(0, prompt.shape[0], group):
            group_cache = new_cache(nsa)
            model(input_ids=prompt[first:first + group, :-1], past_key_values=group_cache, use_cache=True,
                  logits_to_keep=1)
            if layer_keys is None:
                layer_keys, layer_values = [[] for _ in group_cache.layers], [[] for _ in group_cache.layers]
            for index, layer in enumerate(group_cache.layers):
                layer_keys[index].append(layer.keys)
                layer_values[index].append(layer.values)
            del group_cache
    synchronize(device)
    prefill_ms = (time.perf_counter() - start) * 1000
    start = time.perf_counter()
    cache = new_cache(nsa)
    for index in range(len(layer_keys)):
        keys, values = torch.cat(layer_keys[index]), torch.cat(layer_values[index])
        layer_keys[index] = layer_values[index] = None  # the groups' tensors of this layer are freed here
        cache.update(keys, values, index)
        del keys, values
    synchronize(device)
    return cache, prefill_ms, (time.perf_counter() - start) * 1000


def static_cache(model, cache, nsa: bool, capacity: int):
    """A fixed-capacity cache of `capacity` tokens (NSA: SparseAttnStaticCache; SDPA: transformers' StaticCache)
    holding the keys and values of `cache` (a prefilled SparseAttnCache or DynamicCache), whose layers are dropped
    as they are copied (so that the two caches coexist one layer at a time)."""
    from transformers import StaticCache

    from .hf import SparseAttnStaticCache

    first = cache.layers[0]
    if nsa:
        target = SparseAttnStaticCache(model.config, max_batch_size=first.keys.shape[0], max_cache_len=capacity,
                                       device=first.keys.device, dtype=first.keys.dtype)
    else:
        target = StaticCache(config=model.config, max_cache_len=capacity)
    for index in range(len(cache.layers)):
        layer = cache.layers[index]
        target.update(layer.keys, layer.values, index)
        cache.layers[index] = None
        del layer
    return target


def rewind(cache, length: int) -> None:
    """Brings a cache back to its first `length` tokens: crop() where the cache has it; transformers' StaticCache
    has none, its layers' lengths (device tensors) are set instead (the keys past them are rewritten)."""
    from .hf import SparseAttnStaticCache

    if isinstance(cache, SparseAttnStaticCache) or not cache.is_compileable:
        extra = int(cache.get_seq_length()) - length
        if extra > 0:
            cache.crop(-extra)
    else:
        for layer in cache.layers:
            layer.cumulative_length.fill_(length)


def generate_runs(model, prompt: torch.Tensor, cache, new_tokens: int, reps: int, device: str):
    """generate(prompt, past_key_values=cache) `reps` times from the same prefilled cache (P - 1 tokens; brought
    back to them before each run), greedy, exactly new_tokens new tokens. Returns (the times in ms, the output of
    the last run)."""
    prefix = prompt.shape[1] - 1
    times, output = [], None
    for _ in range(reps):
        rewind(cache, prefix)
        synchronize(device)
        start = time.perf_counter()
        output = model.generate(prompt, attention_mask=torch.ones_like(prompt), past_key_values=cache,
                                max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
        synchronize(device)
        times.append((time.perf_counter() - start) * 1000)
    if output.shape[1] != prompt.shape[1] + new_tokens:
        raise RuntimeError(f"generate() gave {output.shape[1] - prompt.shape[1]} new tokens, not {new_tokens}")
    return times, output


def run_generate_model(result: dict, args, nsa: bool, device: str) -> None:
    """Builds one model, prefills, and times generate(); records times, peak memory and failures under the
    model's name (nsa_* or sdpa_*)."""
    name = "nsa" if nsa else "sdpa"
    dtype = getattr(torch, args.dtype)
    batch, prompt_length, new_tokens = result["batch"], result["prompt"], result["new_tokens"]
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    model = cache = prompt = None
    stage = "build"
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        try:
            model = build_model(args, nsa, prompt_length + new_tokens, device, dtype)
            generator = torch.Generator(device="cpu").manual_seed(args.seed)
            prompt = torch.randint(1, model.config.vocab_size, (batch, prompt_length), generator=generator)
            prompt = prompt.to(device)
            stage = "prefill"
            cache, prefill_ms, join_ms = prefill(model, prompt, args.generate_prefill_group, nsa, device)
            result["times_ms"][f"{name}_prefill"], result["times_ms"][f"{name}_join"] = prefill_ms, join_ms
            stage = "generate"
            if "eager" in args.generate_modes:
                runs, _ = generate_runs(model, prompt, cache, new_tokens, args.generate_reps, device)
                result["times_ms"][f"{name}_generate"] = statistics.median(runs)
                result["notes"][f"{name}_generate_runs_ms"] = runs
            if "graph" in args.generate_modes:
                stage = "graph: copy into the static cache"
                rewind(cache, prompt_length - 1)
                synchronize(device)
                start = time.perf_counter()
                cache = static_cache(model, cache, nsa, prompt_length + new_tokens)
                synchronize(device)
                free_memory(device)  # the dropped dynamic layers' blocks go back before compilation
                result["times_ms"][f"{name}_graph_join"] = (time.perf_counter() - start) * 1000
                stage = "graph: generate (compilation)"
                generate_runs(model, prompt, cache, new_tokens, 1, device)
                result["notes"][f"{name}_graph_compiled"] = hasattr(model, "_compiled_call")
                stage = "graph: generate"
                runs, _ = generate_runs(model, prompt, cache, new_tokens, args.generate_reps, device)
                result["times_ms"][f"{name}_graph_generate"] = statistics.median(runs)
                result["notes"][f"{name}_graph_generate_runs_ms"] = runs
        except Exception as error:  # noqa: BLE001 - recorded with its reason, never swallowed
            if not isinstance(error, (RuntimeError, ValueError, NotImplementedError)):
                error = RuntimeError(f"{type(error).__name__}: {error}")
            reason = f"{bench.failure_reason(error, warned)} (while: {stage})"
            for key in generate_keys(name, args):
                if key not in result["times_ms"]:
                    result["times_ms"][key] = None
                    result["errors"][key] = reason
    if device == "cuda":
        result["peak_memory_gb"][name] = torch.cuda.max_memory_allocated() / 2**30
    del model, cache, prompt
    free_memory(device)


def generate_keys(name: str, args) -> tuple:
    """The times a model's generate case records under --generate-modes."""
    keys = (f"{name}_prefill",)
    if "eager" in args.generate_modes:
        keys += (f"{name}_generate",)
    if "graph" in args.generate_modes:
        keys += (f"{name}_graph_generate",)
    return keys


def run_generate(result: dict, args, timer: bench.Timer, device: str) -> None:
    try:
        import transformers  # noqa: F401

        from . import hf  # noqa: F401
    except ImportError as error:
        result["errors"]["case"] = f"unavailable: the generate section needs transformers ({error})"
        return
    for nsa in (True, False):
        name = "nsa" if nsa else "sdpa"
        result["notes"][f"{name}_parameters"] = parameter_count(args, nsa)
        if timer.out_of_time():
            for key in generate_keys(name, args):
                result["times_ms"][key] = None
                result["errors"][key] = "skipped: time budget exhausted"
            continue
        run_generate_model(result, args, nsa, device)


# ------------------------------------------------------------------------------------------------- reports


def fmt_rate(value: Optional[float]) -> str:
    """Tokens/s or bytes/s with an SI prefix: 1.23M, 456k, 12.3."""
    if value is None:
        return "n/a"
    for factor, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if value >= factor:
            return f"{value / factor:.3g}{prefix}"
    return f"{value:.3g}"


def decode_table(results: list[dict]) -> list[str]:
    rows = ["| case | method | graph ms | eager ms | tokens/s graph, eager | time / flash_decode graph, eager "
            "| time / fastest SDPA graph, eager | K/V bytes/s graph | peak GB eager |",
            "|---|---|---|---|---|---|---|---|---|"]

    def pair(r: dict, name: str, method: str, cell: Callable[[Optional[float]], str]) -> str:
        values = r.get(name, {})
        return ", ".join(cell(values.get(f"{method}_{mode}")) for mode in MODES)

    for r in results:
        for method in DECODE_METHODS:
            rows.append(f"| {case_label(r)} | {METHOD_LABELS[method]} | {time_cell(r, f'{method}_graph')} "
                        f"| {time_cell(r, f'{method}_eager')} | {pair(r, 'tokens_per_s', method, fmt_rate)} "
                        f"| {pair(r, 'time_vs_flash_decode', method, lambda x: fmt_number(x, 3))} "
                        f"| {pair(r, 'time_vs_sdpa_best', method, lambda x: fmt_number(x, 3))} "
                        f"| {fmt_rate(r.get('kv_bytes_per_s', {}).get(f'{method}_graph'))} "
                        f"| {fmt_number(r['peak_memory_gb'].get(f'{method}_eager'))} |")
    return rows


def decode_notes(meta: dict, results: list[dict]) -> list[str]:
    lines = ["", "Fastest SDPA (graph, eager): " + "; ".join(
        f"{case_label(r)}: {METHOD_LABELS.get(r.get('sdpa_best', {}).get('graph'), 'none')}, "
        f"{METHOD_LABELS.get(r.get('sdpa_best', {}).get('eager'), 'none')}" for r in results)]
    peak = meta.get("peak_hbm_bytes_per_s")
    if peak:
        lines.append(f"Peak HBM bandwidth of {meta['gpu']}: {peak / 1e12:g} TB/s (NVIDIA data sheet).")
    return lines


def prefill_table(results: list[dict]) -> list[str]:
    rows = ["| case | method | ms | tokens/s | tokens/s / full forward's | peak GB |", "|---|---|---|---|---|---|"]
    for r in results:
        for method in PREFILL_METHODS:
            rows.append(f"| {case_label(r)} | {METHOD_LABELS[method]} | {time_cell(r, method)} "
                        f"| {fmt_rate(r.get('tokens_per_s', {}).get(method))} "
                        f"| {fmt_number(r.get('tokens_per_s_vs_full', {}).get(method), 3)} "
                        f"| {fmt_number(r['peak_memory_gb'].get(method))} |")
        if r.get("chunk_vs_marginal") is not None:
            rows.append(f"| {case_label(r)} | the training forward on the chunk's tokens (full - first S - C) "
                        f"| {r['marginal_ms']:.2f} | chunk / it: {r['chunk_vs_marginal']:.3f} | | |")
    return rows


def generate_table(results: list[dict]) -> list[str]:
    rows = ["| case | model | parameters | prefill ms | prefill tokens/s | join ms | generate ms (median) | ms/step "
            "| decode tokens/s | peak GB |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        for model in MODELS + tuple(m for m in GRAPH_MODELS if f"{m}_generate" in r["times_ms"]):
            parameters = r["notes"].get(f"{model.removesuffix('_graph')}_parameters")
            rows.append(f"| {case_label(r)} | {MODEL_LABELS[model]} | {fmt_rate(parameters)} "
                        f"| {time_cell(r, f'{model}_prefill')} "
                        f"| {fmt_rate(r.get('prefill_tokens_per_s', {}).get(model))} | {time_cell(r, f'{model}_join')} "
                        f"| {time_cell(r, f'{model}_generate')} "
                        f"| {fmt_number(r.get('ms_per_step', {}).get(model))} "
                        f"| {fmt_rate(r.get('decode_tokens_per_s', {}).get(model))} "
                        f"| {fmt_number(r['peak_memory_gb'].get(model.removesuffix('_graph')))} |")
    return rows


def generate_notes(results: list[dict]) -> list[str]:
    lines = [""]
    for r in results:
        runs = {m: r["notes"].get(f"{m}_generate_runs_ms") for m in MODELS}
        lines.append(f"- {case_label(r)}: NSA / SDPA decode tokens/s = "
                     f"{fmt_number(r.get('nsa_vs_sdpa_decode_tokens_per_s'))}; generate runs (ms): "
                     + "; ".join(f"{m} {', '.join(fmt_ms(x) for x in runs[m]) if runs[m] else 'none'}" for m in MODELS))
        graph = [m for m in GRAPH_MODELS if f"{m}_generate" in r["times_ms"]]
        if graph:
            runs = {m: r["notes"].get(f"{m}_generate_runs_ms") for m in graph}
            lines.append(f"- {case_label(r)}, graph mode: NSA / SDPA decode tokens/s = "
                         f"{fmt_number(r.get('nsa_vs_sdpa_decode_tokens_per_s_graph'))}; compiled by transformers: "
                         + ", ".join(f"{m} {r['notes'].get(f'{m}_compiled')}" for m in graph) + "; generate runs (ms): "
                         + "; ".join(f"{m} {', '.join(fmt_ms(x) for x in runs[m]) if runs[m] else 'none'}"
                                     for m in graph))
    return lines


def markdown(meta: dict, results: list[dict], bars: list[dict]) -> str:
    lines = [f"# sparseattn inference benchmark: {meta['gpu']}, {meta['date']}, commit {meta['commit']}", "",
             f"dtype {meta['dtype']}, heads {meta['heads']}, head dim {meta['head_dim']}, device {meta['device']}, "
             f"NSA config {meta['config']}. Times in ms (median). `python -m sparseattn.bench_inference --help` says "
             "exactly what each section measures."]
    if bars:
        lines += ["", "## Bars", "", "| bar | case | value | status |", "|---|---|---|---|"]
        lines += [f"| {b['bar']}{' (variant)' if b['variant'] else ''} | {b['case']} | {fmt_number(b['value'], 3)} "
                  f"| {b['status']} |" for b in bars]
    tables = {"decode": lambda rows: decode_table(rows) + decode_notes(meta, rows),
              "prefill": prefill_table, "generate": lambda rows: generate_table(rows) + generate_notes(rows)}
    for number, section in enumerate(SECTIONS, 1):
        rows = [r for r in results if r["section"] == section]
        if rows:
            lines += ["", f"## {number}. {SECTION_TITLES[section]}", ""] + tables[section](rows)
    lines += not_measured_lines(results, case_label)
    return "\n".join(lines) + "\n"


def report_stem(out: str, meta: dict) -> str:
    return bench.report_stem(out, meta) + "_inference"


def write_reports(stem: str, meta: dict, results: list[dict]) -> list[str]:
    """stem.json (meta, results, bars) and stem.md; returns the paths. Creates the output folder only here."""
    bars = evaluate_bars(results)
    os.makedirs(os.path.dirname(stem) or ".", exist_ok=True)
    with open(stem + ".json", "w") as f:
        json.dump({"meta": meta, "results": results, "bars": bars}, f, indent=1)
    with open(stem + ".md", "w") as f:
        f.write(markdown(meta, results, bars))
    return [stem + ".json", stem + ".md"]


# ---------------------------------------------------------------------------------------------------- main


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m sparseattn.bench_inference", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                        help="cpu: a tiny smoke run on the CPU reference (its own defaults, see above)")
    parser.add_argument("--heads", type=str, help="HQ/HKV (cuda 64/4)")
    parser.add_argument("--head-dim", type=int, help="head dim of q, k and v (cuda 128)")
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], help="cuda bfloat16, cpu float32")
    parser.add_argument("--window", type=int, default=512, help="NSA sliding window (other NSA fields: defaults)")
    parser.add_argument("--decode-contexts", nargs="+", help="KV-cache lengths S (cuda 8K 32K 64K 128K)")
    parser.add_argument("--decode-batches", nargs="+", type=int, help="batch sizes (cuda 1 64)")
    parser.add_argument("--decode-queries", type=int, default=1, help="new queries per sequence and step (1..16)")
    parser.add_argument("--prefill-context", help="keys of the prefill case, the chunk included (cuda 128K)")
    parser.add_argument("--prefill-chunk", help="tokens of a prefill chunk (cuda 8K); must divide the context")
    parser.add_argument("--prefill-batch", type=int, default=1)
    parser.add_argument("--generate-prompts", nargs="+", help="prompt lengths P (cuda 64K)")
    parser.add_argument("--generate-batch", type=int, help="sequences (cuda 16)")
    parser.add_argument("--generate-new-tokens", type=int, help="new tokens N per sequence (cuda 32)")
    parser.add_argument("--generate-model", choices=sorted(MODEL_PRESETS), help="architecture (cuda 1b)")
    parser.add_argument("--generate-reps", type=int, help="generate() runs per model, median (cuda 3)")
    parser.add_argument("--generate-prefill-group", type=int, default=1, help="sequences per prefill forward")
    parser.add_argument("--generate-modes", nargs="+", choices=GENERATE_MODES,
                        help="eager (SparseAttnCache / DynamicCache) and/or graph (static caches, compiled steps) "
                             "(cuda: eager graph; cpu: eager)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="bench/results", help="folder for the JSON and markdown files")
    parser.add_argument("--time-budget-s", type=float, default=None,
                        help="wall-clock seconds the run should fit in: fewer timed runs per measurement, and "
                             "what is not started in time is recorded as skipped")
    parser.add_argument("--rep-ms", type=float, help="timed milliseconds per measurement (cuda 100)")
    parser.add_argument("--warmup-ms", type=float, help="untimed milliseconds before timing (cuda 25)")
    parser.add_argument("--max-reps", type=int, help="most timed runs per measurement (cuda 100)")
    parser.add_argument("--from-json", metavar="JSON",
                        help="rewrite the markdown of an earlier run into --out (no GPU needed)")
    args = parser.parse_args(argv)
    for name, value in DEVICE_DEFAULTS[args.device].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    try:
        parse_heads(args.heads)
        args.decode_contexts = [bench.parse_seqlen(str(x)) for x in args.decode_contexts]
        args.prefill_context = bench.parse_seqlen(str(args.prefill_context))
        args.prefill_chunk = bench.parse_seqlen(str(args.prefill_chunk))
        args.generate_prompts = [bench.parse_seqlen(str(x)) for x in args.generate_prompts]
    except (ValueError, argparse.ArgumentTypeError) as error:
        parser.error(str(error))
    if not 1 <= args.decode_queries <= 16:
        parser.error("--decode-queries must be in 1..16")
    if min(args.decode_contexts) < args.decode_queries:
        parser.error("--decode-contexts must be at least --decode-queries")
    if not 1 <= args.prefill_chunk <= args.prefill_context or args.prefill_context % args.prefill_chunk:
        parser.error("--prefill-chunk must divide --prefill-context")
    if min(args.generate_prompts) < 2:
        parser.error("--generate-prompts must be at least 2 tokens")
    positive = ("head_dim", "window", "prefill_batch", "generate_batch", "generate_new_tokens", "generate_reps",
                "generate_prefill_group", "max_reps")
    if min(min(args.decode_batches), *(getattr(args, name) for name in positive)) < 1:
        parser.error("--decode-batches, --head-dim, --window, the batch sizes, counts and --max-reps must be "
                     "positive")
    return args


def planned_cases(args) -> list[tuple[str, dict]]:
    """(section, case fields) in run order: decode (batch-major, shortest context first), prefill, generate."""
    cases = []
    if "decode" in args.sections:
        cases += [("decode", {"batch": b, "context": s, "queries": args.decode_queries})
                  for b in args.decode_batches for s in args.decode_contexts]
    if "prefill" in args.sections:
        cases.append(("prefill", {"batch": args.prefill_batch, "context": args.prefill_context,
                                  "chunk": args.prefill_chunk}))
    if "generate" in args.sections:
        cases += [("generate", {"batch": args.generate_batch, "prompt": p, "new_tokens": args.generate_new_tokens})
                  for p in args.generate_prompts]
    return cases


MEASUREMENTS = {"decode": 2 * len(DECODE_METHODS), "prefill": len(PREFILL_METHODS), "generate": 0}


def run_case(section: str, fields: dict, args, config: NSAConfig, timer: bench.Timer) -> dict:
    heads_q, heads_kv = parse_heads(args.heads)
    case = Case(Shape(heads_q, heads_kv, args.head_dim, args.head_dim), fields.get("context", 0), timer)
    case.result = new_result(section, args, **fields)
    torch.manual_seed(args.seed)
    if section == "decode":
        run_decode(case, args, config, args.device)
    elif section == "prefill":
        run_prefill(case, args, config, args.device)
    else:
        run_generate(case.result, args, timer, args.device)
    return case.result


def print_case(result: dict, wall_s: float) -> None:
    section = result["section"]
    if section == "decode":
        times = ", ".join(f"{m} {time_cell(result, f'{m}_graph')} ({time_cell(result, f'{m}_eager')})"
                          for m in DECODE_METHODS)
        print(f"[{wall_s:.0f} s] decode {case_label(result)}: ms graph (eager): {times}", flush=True)
    elif section == "prefill":
        times = ", ".join(f"{m} {time_cell(result, m)}" for m in PREFILL_METHODS)
        print(f"[{wall_s:.0f} s] prefill {case_label(result)}: ms: {times}", flush=True)
    else:
        times = ", ".join(f"{m} prefill {time_cell(result, f'{m}_prefill')}, generate "
                          f"{time_cell(result, f'{m}_generate')}, graph generate "
                          f"{time_cell(result, f'{m}_graph_generate')}" for m in MODELS)
        print(f"[{wall_s:.0f} s] generate {case_label(result)}: ms: {times}", flush=True)


def main(argv: Optional[list[str]] = None) -> None:
    args = parse_args(argv)
    if args.from_json:
        with open(args.from_json) as f:
            saved = json.load(f)
        meta = saved["meta"]
        results = [summarize(r, meta["element_bytes"]) for r in saved["results"]]
        written = write_reports(report_stem(args.out, meta), meta, results)
        print("\n".join(bar_lines(evaluate_bars(results))))
        print("wrote " + ", ".join(written))
        return
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("the benchmark needs a CUDA GPU (or --device cpu to check it on the CPU reference)")
    config = NSAConfig(window=args.window)
    started = time.monotonic()
    timer_class = bench.Timer if args.device == "cuda" else WallClockTimer
    timer = timer_class(args.rep_ms, args.warmup_ms, args.max_reps, args.time_budget_s)
    gpu = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    element_bytes = getattr(torch, args.dtype).itemsize
    meta = {"gpu": gpu, "date": datetime.date.today().isoformat(), "commit": bench.git_commit(),
            "torch": torch.__version__, "dtype": args.dtype, "element_bytes": element_bytes, "heads": args.heads,
            "head_dim": args.head_dim, "device": args.device, "config": asdict(config), "seed": args.seed,
            "peak_hbm_bytes_per_s": peak_hbm_bytes_per_s(gpu), "sections": args.sections,
            "generate": {"model": args.generate_model, "preset": MODEL_PRESETS[args.generate_model],
                         "reps": args.generate_reps, "prefill_group": args.generate_prefill_group,
                         "modes": args.generate_modes},
            "timing": {"rep_ms": args.rep_ms, "warmup_ms": args.warmup_ms, "max_reps": args.max_reps,
                       "time_budget_s": args.time_budget_s}}
    stem = report_stem(args.out, meta)
    cases = planned_cases(args)
    results = []
    for index, (section, fields) in enumerate(cases):
        if timer.out_of_time():
            result = skipped_result(section, args, "skipped: time budget exhausted", **fields)
        else:
            timer.measurements_left = sum(MEASUREMENTS[s] for s, _ in cases[index:])
            result = run_case(section, fields, args, config, timer)
        results.append(summarize(result, element_bytes))
        free_memory(args.device)
        meta["wall_s"] = round(time.monotonic() - started, 1)
        write_reports(stem, meta, results)
        print_case(result, meta["wall_s"])
    written = write_reports(stem, meta, results)
    bars = evaluate_bars(results)
    print(markdown(meta, results, bars))
    print("\n".join(bar_lines(bars)))
    print("wrote " + ", ".join(written))


if __name__ == "__main__":
    main()
