"""Where the time of a CUDA-graph replay of nsa_decode goes: each kernel's start (from the first kernel's) and
duration inside the replay, after an L2 flush (reading 512 MB, which also evicts the kernels' instructions) and
without one, from the profiler's timestamps. 64/4 heads, D = 128, NSA defaults, bf16, paged cache; batch 1 at 128K
and 32K, batch 64 at 32K.

    python scripts/decode_graph_timeline.py
"""
import statistics

import torch
from torch.profiler import ProfilerActivity, profile

import sparseattn as sa
from sparseattn.bench_inference import capture_graph, paged_view, random_gates

CASES = ((1, 131072), (1, 32768), (64, 32768))
REPLAYS = 8


def decode_step(batch, ctx, config):
    """A callable running one nsa_decode step of `batch` queries against `ctx` cached keys each."""
    opts = dict(device="cuda", dtype=torch.bfloat16)
    q = torch.randn(batch, 1, 64, 128, **opts)
    k = torch.randn(batch, ctx, 4, 128, **opts)
    v = torch.randn(batch, ctx, 4, 128, **opts)
    k_cmp, v_cmp = sa.compress_kv(k, v, block=config.cmp_block, stride=config.cmp_stride)
    gates = random_gates(batch, 1, 64, "cuda", torch.bfloat16)
    k_pages, v_pages, table = paged_view(k, v)
    lengths = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    return lambda: sa.nsa_decode(q, k_pages, v_pages, block_table=table, cache_seqlens=lengths, k_cmp=k_cmp,
                                 v_cmp=v_cmp, g_cmp=gates[0], g_slc=gates[1], g_swa=gates[2], config=config)


def replay_timelines(graph, flush_buffer):
    """The kernels of each replay (profiler events), each replay after a 1 ms GPU sleep (and a flush if given)."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(REPLAYS):
            if flush_buffer is not None:
                flush_buffer.sum()
            torch.cuda._sleep(1_000_000)
            graph.replay()
        torch.cuda.synchronize()
    events = sorted((e for e in prof.profiler.kineto_results.events()
                     if e.device_type() == torch.autograd.DeviceType.CUDA), key=lambda e: e.start_ns())
    runs, current = [], None
    for event in events:
        name = event.name()
        if "spin_kernel" in name or "sleep" in name.lower():  # the sleep before a replay
            if current:
                runs.append(current)
            current = []
        elif "reduce" not in name.lower() and current is not None:  # not the flush
            current.append(event)
    if current:
        runs.append(current)
    return runs[2:]  # the first replays warm up the profiler


def main():
    flush_buffer = torch.empty(512 * 2**20 // 4, dtype=torch.float32, device="cuda")
    config = sa.NSAConfig()
    print(torch.cuda.get_device_name())
    for batch, ctx in CASES:
        graph, _ = capture_graph(decode_step(batch, ctx, config))
        for label, buffer in (("read flush", flush_buffer), ("no flush", None)):
            runs = replay_timelines(graph, buffer)
            spans = [(run[-1].start_ns() + run[-1].duration_ns() - run[0].start_ns()) / 1000 for run in runs if run]
            print(f"\n## B={batch} S={ctx}, {label}: first kernel start to last kernel end, median of {len(spans)}: "
                  f"{statistics.median(spans):.1f} us (the last replay:)")
            t0 = runs[-1][0].start_ns()
            for event in runs[-1]:
                print(f"  +{(event.start_ns() - t0) / 1000:7.1f} us  {event.duration_ns() / 1000:6.1f} us  "
                      f"{event.name()[:80]}")
        del graph
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
