"""Memory bandwidth of flash_decode against PyTorch SDPA, timed in the same process.

    python scripts/bench_decode.py                       # Tq = 1, Tk = 128K, batch 1 and 32, 32/8 and 64/4 heads
    python scripts/bench_decode.py --tk 32768 --batch 1 --out bench/results/decode.json

Decode reads every key and value of the cache once, so its speed is bandwidth: GB/s = K and V bytes of the
sequences (B x Tk x Hkv x (Dqk + Dv) x 2 bytes) / median time, and its fraction of the GPU's peak memory bandwidth
(H100 SXM 3.35 TB/s, H200 4.8 TB/s, H100 PCIe 2.0 TB/s; none for other GPUs). Rows: flash_decode on the dense
cache [B, Tk, Hkv, D] (its heuristic split count), on the same memory as a paged cache (pages of each --page-size,
a shuffled block table), and SDPA on the dense cache ([B, H, T, D] views, enable_gqa) with each backend that takes
the shape (flash, cuDNN, efficient; a backend that refuses is listed with its reason). Tq = 1 is causal for every
row: the one query sits at the last position, so SDPA runs with is_causal=False.

Timing: CUDA events around each run, an L2 flush and a 1 ms GPU sleep before every timed run (the
sleep keeps the GPU busy while the host launches the run, so that a run of some tens of microseconds is timed by its
kernels, not by the Python and launch overhead of the call), median of --runs runs after --warmup untimed ones. The
flush (--flush) reads 512 MB (a sum: the L2 is left holding clean lines) or writes them (zero_, as
sparseattn.bench: the L2 is left full of dirty lines, whose write-back the timed run then pays for, tens of MB).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import warnings

import torch

SLEEP_CYCLES = 2_000_000  # about 1 ms at 1.75-1.98 GHz (as sparseattn.bench)
PEAK_TBPS = {"H200": 4.8, "H100 PCIe": 2.0, "H100": 3.35}  # first match of the device name wins


def peak_tbps(name: str):
    for key, value in PEAK_TBPS.items():
        if key in name:
            return value
    return None


class Timer:
    def __init__(self, runs: int, warmup: int, flush: str):
        self.runs, self.warmup, self.flush_mode = runs, warmup, flush
        self.flush = torch.ones(256 << 20, dtype=torch.bfloat16, device="cuda")  # 512 MB

    def median_ms(self, fn) -> float:
        for _ in range(self.warmup):
            fn()
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(self.runs)]
        for begin, end in events:
            if self.flush_mode == "read":
                self.flush.sum(dtype=torch.float32)
            else:
                self.flush.zero_()
            torch.cuda._sleep(SLEEP_CYCLES)
            begin.record()
            fn()
            end.record()
        torch.cuda.synchronize()
        return statistics.median(b.elapsed_time(e) for b, e in events)


def kernel_times(fn, runs: int = 5) -> dict:
    """Mean GPU microseconds of each kernel of one run of fn (torch.profiler over `runs` runs)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(runs):
            fn()
        torch.cuda.synchronize()
    times = {}
    for event in prof.key_averages():
        if event.device_type.name == "CUDA" and event.count:
            name = event.key.split("<")[0].split("(")[0][-40:]
            times[name] = round(event.device_time_total / runs, 1)
    return times


def sdpa_rows(q, k, v):
    """(name, callable or the reason it is unavailable) for each SDPA backend on the [B, H, T, D] views."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    qd, kd, vd = (x.transpose(1, 2) for x in (q, k, v))
    rows = []
    for name, backend in (("sdpa_flash", SDPBackend.FLASH_ATTENTION), ("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION),
                          ("sdpa_efficient", SDPBackend.EFFICIENT_ATTENTION)):
        def run(backend=backend):
            with sdpa_kernel([backend]):
                return torch.nn.functional.scaled_dot_product_attention(qd, kd, vd, is_causal=False, enable_gqa=True)

        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                run()
                torch.cuda.synchronize()
            rows.append((name, run))
        except Exception as error:  # noqa: BLE001 - a backend that does not take the shape is reported, not fatal
            why = "; ".join(str(w.message).splitlines()[0] for w in caught[:2]) if caught else ""
            rows.append((name, f"{type(error).__name__}: {str(error).splitlines()[0][:120]}" + (f" ({why[:200]})"
                                                                                            if why else "")))
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tk", type=int, default=131072, help="keys per sequence (default 128K)")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--heads", nargs="+", default=["32/8", "64/4"], help="Hq/Hkv pairs")
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--page-size", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--no-sdpa", action="store_true")
    parser.add_argument("--flush", choices=["read", "write"], default="read", help="how the L2 is flushed")
    parser.add_argument("--kernels", action="store_true",
                        help="also print the GPU time of each kernel of the flash_decode rows (torch.profiler)")
    parser.add_argument("--out", help="also write the results as JSON here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_decode: needs a CUDA GPU", file=sys.stderr)
        return 1
    import sparseattn
    from sparseattn.decode import flash_decode, flash_decode_plan

    name = torch.cuda.get_device_name()
    peak = peak_tbps(name)
    print(f"# flash_decode bandwidth on {name} (peak {peak} TB/s), torch {torch.__version__}, "
          f"sparseattn {sparseattn.__version__}; Tq = 1, Tk = {args.tk}, D = {args.dim}, bf16, L2 flush by "
          f"{args.flush}\n")
    print("| B | Hq/Hkv | kernel | splits | time (us) | GB/s | of peak |")
    print("|---|---|---|---|---|---|---|")
    timer = Timer(args.runs, args.warmup, args.flush)
    results = []
    for batch in args.batch:
        for heads in args.heads:
            hq, hkv = (int(x) for x in heads.split("/"))
            D, Tk = args.dim, args.tk
            opts = dict(dtype=torch.bfloat16, device="cuda")
            q = torch.randn(batch, 1, hq, D, **opts)
            try:
                k = torch.randn(batch, Tk, hkv, D, **opts)
                v = torch.randn(batch, Tk, hkv, D, **opts)
            except torch.OutOfMemoryError:
                print(f"| {batch} | {heads} | (cache does not fit) | | | | |")
                continue
            nbytes = 2 * batch * Tk * hkv * D * 2
            seqlens = torch.full((batch,), Tk, dtype=torch.int32, device="cuda")
            # The same memory as pages: [B * Tk / page, page, Hkv, D], each sequence's pages in shuffled order.
            rows = [("flash_decode", lambda: flash_decode(q, k, v, cache_seqlens=seqlens),
                     flash_decode_plan(q, k, v, cache_seqlens=seqlens)[0])]
            for page in args.page_size:
                pages_per_seq = Tk // page
                k_pages, v_pages = (x.view(batch * pages_per_seq, page, hkv, D) for x in (k, v))
                table = torch.randperm(batch * pages_per_seq, device="cuda").to(torch.int32).view(batch, -1)
                rows.append((f"flash_decode paged {page}",
                             lambda k_pages=k_pages, v_pages=v_pages, table=table: flash_decode(
                                 q, k_pages, v_pages, cache_seqlens=seqlens, block_table=table),
                             flash_decode_plan(q, k_pages, v_pages, cache_seqlens=seqlens, block_table=table)[0]))
            if not args.no_sdpa:
                rows += [(n, fn, "") for n, fn in sdpa_rows(q, k, v)]
            for kernel, fn, splits in rows:
                record = dict(batch=batch, heads=heads, tk=Tk, dim=D, kernel=kernel, splits=splits, bytes=nbytes)
                if isinstance(fn, str):
                    record["unavailable"] = fn
                    print(f"| {batch} | {heads} | {kernel} | | unavailable: {fn} | | |")
                else:
                    try:
                        ms = timer.median_ms(fn)
                    except torch.OutOfMemoryError as error:
                        record["unavailable"] = f"out of memory: {str(error).splitlines()[0][:100]}"
                        print(f"| {batch} | {heads} | {kernel} | | out of memory | | |")
                        results.append(record)
                        continue
                    gbps = nbytes / (ms * 1e-3) / 1e9
                    fraction = gbps / (peak * 1000) if peak else None
                    record.update(ms=ms, gbps=gbps, fraction_of_peak=fraction)
                    frac_text = f"{fraction:.1%}" if fraction is not None else "n/a"
                    print(f"| {batch} | {heads} | {kernel} | {splits} | {ms * 1000:.1f} | {gbps:.0f} | {frac_text} |",
                          flush=True)
                    if args.kernels and kernel.startswith("flash_decode"):
                        try:
                            record["kernels_us"] = kernel_times(fn)
                        except Exception as error:  # noqa: BLE001 - the breakdown is optional
                            record["kernels_us"] = f"profiler failed: {error}"
                        print(f"|   |   | kernels: {record['kernels_us']} | | | | |")
                results.append(record)
            del q, k, v, rows
            torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(device=name, peak_tbps=peak, torch=torch.__version__, flush=args.flush, results=results), f,
                      indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
