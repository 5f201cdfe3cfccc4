"""Context-parallel NSA benchmark: sparseattn.distributed.nsa_attention over 1, 2 and 4 GPUs of one host, forward and
forward + backward, tokens per second, efficiency against one GPU, peak memory, and which long sequences fit.

    python -m sparseattn.bench_distributed                              # 1, 2, 4 GPUs (those the host has), 256K per GPU
    python -m sparseattn.bench_distributed --gpus 1 2 --tokens-per-gpu 64K --fit 4:2M --fit 1:512K
    python -m sparseattn.bench_distributed --device cpu --gpus 1 2 --tokens-per-gpu 384 --heads 4/1 --dim 32 \\
        --config cmp_block=16,cmp_stride=8,sel_block=32,num_selected=4,window=64 --out /tmp/x     # smoke run (gloo)

Each world size R runs in its own process group (torch.distributed.run, one process per GPU; NCCL on GPUs, gloo on
the CPU): a sequence of R x --tokens-per-gpu tokens, zigzag-sharded, batch 1, bf16, NSA defaults (--config changes
them), random q, k, v and gates. R = 1 is the one-GPU baseline: sparseattn.nsa_attention itself, no process group
in the call. Every timed step starts after a barrier; a step's time is the slowest rank's median over --repeats
steps after one warm-up step.

Reported per R: the forward and forward + backward times; tokens per second (R x tokens per GPU / time); the token
efficiency t_1 / t_R, which is (throughput at R) / (R x throughput at 1) since the sequence grows with R; the work
efficiency, the same with NSA's FLOPs (bench.nsa_flops: the compressed branch grows with the square of the
sequence, so R GPUs on an R times longer sequence have more than R times the work of one); with --whole, the
same-length efficiency t_1(R x N) / (R x t_R) against one GPU timed on the whole sequence; the peak memory of a
rank (the largest over ranks) above its inputs. Each --fit R:T runs one forward + backward step of T tokens over R
GPUs in its own process group and records whether it ran (an out-of-memory error or a timeout is recorded as such)
and its peak memory: the longest sequence a configuration holds is the longest fit that ran.

The report goes to --out as <GPU>_<date>_<commit>_distributed.{json,md} (bench.git_commit names the commit).
"""
import argparse
import dataclasses
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Optional

import torch

from .bench import Shape, git_commit, nsa_flops, parse_seqlen, seqlen_label
from .functional import NSAConfig

DEFAULT_GPUS = (1, 2, 4)
BARS = {"efficiency_4": 0.85, "fit_4": 2 * 1024 * 1024}


def parse_config(text: Optional[str]) -> NSAConfig:
    """NSAConfig from "field=value,field=value" (empty: the defaults)."""
    if not text:
        return NSAConfig()
    fields = {f.name: f.type for f in dataclasses.fields(NSAConfig)}
    values = {}
    for item in text.split(","):
        name, _, value = item.partition("=")
        if name not in fields:
            raise SystemExit(f"--config: NSAConfig has no field {name!r} (fields: {', '.join(fields)})")
        values[name] = float(value) if name == "scale" else int(value)
    return NSAConfig(**values)


def parse_fit(text: str) -> tuple[int, int]:
    ranks, _, tokens = text.partition(":")
    return int(ranks), parse_seqlen(tokens)


# ------------------------------------------------------------------------------------------ one process group


def _step_times(step, repeats: int, device: torch.device, group_size: int, warm_up: bool = True) -> list[float]:
    """Milliseconds of each of `repeats` steps (after a warm-up step unless told not to), every step started after a
    barrier."""
    import torch.distributed as dist

    times = []
    for index in range(repeats + int(warm_up)):
        if group_size > 1:
            dist.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if index or not warm_up:
            times.append((time.perf_counter() - start) * 1e3)
    return times


def worker(args: argparse.Namespace) -> None:
    """One rank of one configuration (started by torch.distributed.run); rank 0 writes the result to --result."""
    import torch.distributed as dist

    import sparseattn as sa
    from sparseattn import distributed as sad

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if args.device == "cuda":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                            timeout=datetime.timedelta(seconds=args.case_timeout_s))
    shape, config = Shape.parse(args.shape), parse_config(args.config)
    dtype = getattr(torch, args.dtype)
    tokens = sad.shard_lengths(args.tokens, world)[rank]
    generator = torch.Generator(device=device).manual_seed(1000 + rank)

    def random(*size):
        return torch.randn(*size, device=device, dtype=dtype, generator=generator)

    q = random(1, tokens, shape.heads_q, shape.dim_qk)
    k = random(1, tokens, shape.heads_kv, shape.dim_qk)
    v = random(1, tokens, shape.heads_kv, shape.dim_v)
    gates = [torch.sigmoid(random(1, tokens, shape.heads_q)) for _ in range(3)]
    leaves = [x.requires_grad_() for x in (q, k, v, *gates)]
    d_o = random(1, tokens, shape.heads_q, shape.dim_v)

    def call():
        if world == 1:
            return sa.nsa_attention(*leaves, config=config)
        return sad.nsa_attention(*leaves, config=config)

    def forward():
        with torch.no_grad():
            call()

    def forward_backward():
        torch.autograd.grad(call(), leaves, d_o)

    result = {"ranks": world, "tokens": args.tokens, "error": None}
    try:
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            inputs_bytes = torch.cuda.memory_allocated(device)
        if args.repeats:
            result["fwd_ms"] = _step_times(forward, args.repeats, device, world)
            result["fwd_bwd_ms"] = _step_times(forward_backward, args.repeats, device, world)
        else:  # a fit: one step, no warm-up
            result["fwd_bwd_ms"] = _step_times(forward_backward, 1, device, world, warm_up=False)
        peak = (torch.cuda.max_memory_allocated(device) - inputs_bytes) / 2**30 if device.type == "cuda" else None
    except torch.OutOfMemoryError as error:
        print(f"rank {rank}: out of memory: {str(error).splitlines()[0]}", file=sys.stderr, flush=True)
        sys.exit(3)
    mine = torch.tensor([statistics.median(result.get("fwd_ms") or [0.0]), statistics.median(result["fwd_bwd_ms"]),
                         -1.0 if peak is None else peak], dtype=torch.float64)
    if world > 1:
        mine = mine.to(device)
        every = [torch.zeros_like(mine) for _ in range(world)]
        dist.all_gather(every, mine)
        every = [t.cpu() for t in every]
    else:
        every = [mine]
    if rank == 0:
        slowest = torch.stack(every).max(dim=0).values.tolist()
        result.update(fwd_ms=slowest[0] if args.repeats else None, fwd_bwd_ms=slowest[1],
                      peak_gib=None if slowest[2] < 0 else slowest[2],
                      gpu=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu")
        with open(args.result, "w") as f:
            json.dump(result, f)
    if world > 1:
        dist.barrier()
    dist.destroy_process_group()


# ----------------------------------------------------------------------------------------------------- driver


def run_group(args: argparse.Namespace, ranks: int, tokens: int, repeats: int) -> dict:
    """Runs one configuration in a fresh process group of `ranks` processes; the result, or its failure."""
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "result.json")
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
                   "-m", "sparseattn.bench_distributed", "--worker", "--result", path, "--device", args.device,
                   "--shape", args.shape, "--dtype", args.dtype, "--tokens", str(tokens), "--repeats", str(repeats),
                   "--case-timeout-s", str(args.case_timeout_s)]
        if args.config:
            command += ["--config", args.config]
        started = time.monotonic()
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=args.case_timeout_s)
        except subprocess.TimeoutExpired:
            return {"ranks": ranks, "tokens": tokens, "error": f"timed out after {args.case_timeout_s} s"}
        wall = round(time.monotonic() - started, 1)
        if done.returncode == 0 and os.path.exists(path):
            with open(path) as f:
                result = json.load(f)
            result["wall_s"] = wall
            return result
        out = done.stdout + done.stderr
        reason = "out of memory" if "out of memory" in out else f"failed (exit {done.returncode})"
        lines = [line.strip() for line in out.splitlines() if line.strip()]
        tail = ([line for line in lines if "Error" in line] or lines)[-3:]
        return {"ranks": ranks, "tokens": tokens, "error": reason, "log_tail": tail, "wall_s": wall}


def summarize(results: list[dict], shape: Shape, config: NSAConfig, wholes: tuple = ()) -> None:
    """Adds throughput and efficiencies (against the R = 1 result, and against one GPU on the same sequence where
    `wholes` has it) to the timed results, in place."""
    one = next((r for r in results if r["ranks"] == 1 and not r["error"]), None)
    for r in results:
        if r["error"]:
            continue
        r["tokens_per_s"] = r["tokens"] / (r["fwd_bwd_ms"] / 1e3)
        r["tflops"] = 3.5 * sum(nsa_flops(shape, r["tokens"], config).values()) / (r["fwd_bwd_ms"] / 1e3) / 1e12
        if one is not None:
            r["token_efficiency"] = r["tokens_per_s"] / (r["ranks"] * one["tokens_per_s"])
            r["work_efficiency"] = r["tflops"] / (r["ranks"] * one["tflops"])
        whole = next((w for w in wholes if w["tokens"] == r["tokens"] and not w["error"]), None)
        if whole is not None and r["ranks"] > 1:
            r["same_length_efficiency"] = whole["fwd_bwd_ms"] / (r["ranks"] * r["fwd_bwd_ms"])


def cell(value, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def markdown(meta: dict, timed: list[dict], fits: list[dict]) -> str:
    lines = [f"# Context-parallel NSA: {meta['gpu']} x up to {meta['max_ranks']}, {meta['dtype']}, commit "
             f"{meta['commit']}", "",
             f"{meta['shape']} (Hq/Hkv/Dqk/Dv), batch 1, zigzag, {seqlen_label(meta['tokens_per_gpu'])} tokens per "
             f"GPU, NSA config {meta['config']}; median of {meta['repeats']} steps, the slowest rank. Work: NSA "
             "forward FLOPs x 3.5 (forward + backward).", "",
             "| ranks | tokens | fwd ms | fwd+bwd ms | tokens/s | TFLOP/s | token efficiency | work efficiency "
             "| same-length efficiency | peak GiB per rank |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in timed:
        if r["error"]:
            lines.append(f"| {r['ranks']} | {seqlen_label(r['tokens'])} | {r['error']} | | | | | | | |")
            continue
        lines.append(f"| {r['ranks']} | {seqlen_label(r['tokens'])} | {cell(r['fwd_ms'])} | {cell(r['fwd_bwd_ms'])} "
                     f"| {r['tokens_per_s']:,.0f} | {cell(r['tflops'])} | {cell(r.get('token_efficiency'), 2)} "
                     f"| {cell(r.get('work_efficiency'), 2)} | {cell(r.get('same_length_efficiency'), 2)} "
                     f"| {cell(r['peak_gib'])} |")
    if fits:
        lines += ["", "Fits (one forward + backward step each):", "",
                  "| ranks | tokens | runs | fwd+bwd ms | peak GiB per rank |", "|---|---|---|---|---|"]
        for r in fits:
            ran = "yes" if not r["error"] else f"no: {r['error']}"
            time_ms = cell(r["fwd_bwd_ms"]) if not r["error"] else "-"
            lines.append(f"| {r['ranks']} | {seqlen_label(r['tokens'])} | {ran} | {time_ms} "
                         f"| {cell(r.get('peak_gib'))} |")
    if meta.get("bars"):
        lines += ["", "| bar | measured | met |", "|---|---|---|"]
        lines += [f"| {b['bar']} | {b['measured']} | {b['met']} |" for b in meta["bars"]]
    return "\n".join(lines) + "\n"


def evaluate_bars(timed: list[dict], fits: list[dict]) -> list[dict]:
    bars = []
    four = next((r for r in timed if r["ranks"] == 4 and not r["error"]), None)
    if four is not None and "token_efficiency" in four:
        bars.append({"bar": f"4 GPUs: throughput >= {BARS['efficiency_4']:.2f} x 4 x one GPU's",
                     "measured": f"token efficiency {four['token_efficiency']:.2f}, work efficiency "
                                 f"{four['work_efficiency']:.2f}",
                     "met": "yes" if four["token_efficiency"] >= BARS["efficiency_4"] else
                            ("tokens no, work yes" if four["work_efficiency"] >= BARS["efficiency_4"] else "no")})
    fit = next((r for r in fits if r["ranks"] == 4 and r["tokens"] >= BARS["fit_4"]), None)
    if fit is not None:
        bars.append({"bar": f"{seqlen_label(BARS['fit_4'])} tokens fit on 4 GPUs",
                     "measured": f"{seqlen_label(fit['tokens'])}: " + ("ran" if not fit["error"] else fit["error"]),
                     "met": "yes" if not fit["error"] else "no"})
    return bars


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpus", nargs="+", type=int, default=None,
                        help="world sizes to time (default: 1 2 4, those the host has)")
    parser.add_argument("--tokens-per-gpu", type=parse_seqlen, default=256 * 1024)
    parser.add_argument("--heads", default="64/4", help="HQ/HKV")
    parser.add_argument("--dim", type=int, default=128, help="head dim of q, k and v")
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    parser.add_argument("--config", default="", help="NSAConfig fields, e.g. window=256,num_selected=8")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--fit", action="append", type=parse_fit, default=[], metavar="R:T",
                        help="also run one step of T tokens over R GPUs (repeatable)")
    parser.add_argument("--whole", action="store_true",
                        help="also time one GPU on each R > 1 sequence (R x tokens per GPU): the same-length "
                             "efficiency t_1(R x N) / (R x t_R)")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--case-timeout-s", type=int, default=600, help="limit of each process group")
    parser.add_argument("--out", default="bench/results")
    # internal: one rank of one configuration
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    parser.add_argument("--shape", help=argparse.SUPPRESS)
    parser.add_argument("--tokens", type=int, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: Optional[list[str]] = None) -> None:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return
    hq, hkv = (int(x) for x in args.heads.split("/"))
    args.shape = f"{hq}/{hkv}/{args.dim}/{args.dim}"
    shape, config = Shape.parse(args.shape), parse_config(args.config)
    if args.device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("the benchmark needs CUDA GPUs (or --device cpu)")
        available = torch.cuda.device_count()
        gpus = args.gpus or [r for r in DEFAULT_GPUS if r <= available]
        if max(gpus + [r for r, _ in args.fit]) > available:
            raise SystemExit(f"this host has {available} GPUs")
    else:
        gpus = args.gpus or [1, 2]
    started = time.monotonic()
    timed, fits = [], []
    for ranks in gpus:
        timed.append(run_group(args, ranks, ranks * args.tokens_per_gpu, args.repeats))
        print(f"[{time.monotonic() - started:.0f} s] {ranks} x {seqlen_label(args.tokens_per_gpu)}: {timed[-1]}",
              flush=True)
    wholes = []
    if args.whole:
        for ranks in gpus:
            if ranks > 1:
                wholes.append(run_group(args, 1, ranks * args.tokens_per_gpu, args.repeats))
                print(f"[{time.monotonic() - started:.0f} s] 1 x {seqlen_label(ranks * args.tokens_per_gpu)}: "
                      f"{wholes[-1]}", flush=True)
    for ranks, tokens in args.fit:
        fits.append(run_group(args, ranks, tokens, 0))
        print(f"[{time.monotonic() - started:.0f} s] fit {ranks}:{seqlen_label(tokens)}: {fits[-1]}", flush=True)
    summarize(timed, shape, config, wholes)
    gpu = next((r["gpu"] for r in timed + fits if r.get("gpu")), args.device)
    meta = {"gpu": gpu, "max_ranks": max(gpus + [r for r, _ in args.fit]), "date": datetime.date.today().isoformat(),
            "commit": git_commit(), "torch": torch.__version__, "dtype": args.dtype, "shape": args.shape,
            "tokens_per_gpu": args.tokens_per_gpu, "repeats": args.repeats,
            "config": dataclasses.asdict(config), "wall_s": round(time.monotonic() - started, 1)}
    meta["bars"] = evaluate_bars(timed, fits)
    stem = os.path.join(args.out, f"{gpu.replace(' ', '_')}_{meta['date']}_{meta['commit']}_distributed")
    os.makedirs(args.out, exist_ok=True)
    with open(stem + ".json", "w") as f:
        json.dump({"meta": meta, "timed": timed, "whole": wholes, "fits": fits}, f, indent=1)
    text = markdown(meta, timed, fits)
    with open(stem + ".md", "w") as f:
        f.write(text)
    print(text)
    print(f"wrote {stem}.json, {stem}.md")


if __name__ == "__main__":
    main()
