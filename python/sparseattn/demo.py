"""A small end-to-end check of sparseattn: ``python -m sparseattn.demo``.

Runs Native Sparse Attention forward and backward on the GPU where this build supports it (else on the CPU),
checks output and gradients against float64 references (the same op on float64 CPU copies, and a naive
PyTorch NSA written from the semantics below), checks the packed (varlen) layout against the batched one, and
prints shapes, timings, max errors and PASS/FAIL. Exits non-zero on failure.
"""

from __future__ import annotations

import argparse
import math
import sys
import time

import torch

import sparseattn
from sparseattn import NSAConfig, SparseAttnUnsupportedError, nsa_attention


def naive_nsa(q, k, v, g_cmp, g_slc, g_swa, cfg: NSAConfig):
    """NSA in plain PyTorch, batched [B, T, H, D], straight from docs/semantics.md (dense masks, O(T^2))."""
    B, T, Hq, D = q.shape
    Hkv, G = k.shape[2], q.shape[2] // k.shape[2]
    l, d, lp, w = cfg.cmp_block, cfg.cmp_stride, cfg.sel_block, cfg.window
    scale = cfg.scale if cfg.scale is not None else 1.0 / math.sqrt(D)
    pos = torch.arange(T, device=q.device)

    def attend(keys, values, allowed):  # keys [B, S, Hkv, D]; allowed broadcasts to [B, Hq, T, S]
        keys, values = keys.repeat_interleave(G, 2), values.repeat_interleave(G, 2)
        s = torch.einsum("bthd,bshd->bhts", q, keys) * scale
        allowed = allowed.expand_as(s)
        empty = ~allowed.any(-1, keepdim=True)  # rows that see no key: o = 0, lse = -inf, no gradient
        s = s.masked_fill(~allowed, float("-inf")).masked_fill(empty, 0.0)
        p = torch.softmax(s, -1).masked_fill(empty, 0.0)
        lse = torch.logsumexp(s, -1).masked_fill(empty[..., 0], float("-inf"))
        return torch.einsum("bhts,bshd->bthd", p, values), lse, p

    # 1. Compression: block j covers tokens [j*d, j*d + l); the mean of k and of v.
    Tc = (T - l) // d + 1 if T >= l else 0
    starts = torch.arange(Tc, device=q.device) * d
    k_cmp = torch.stack([k[:, s:s + l].mean(1) for s in starts.tolist()], 1) if Tc else k[:, :0]
    v_cmp = torch.stack([v[:, s:s + l].mean(1) for s in starts.tolist()], 1) if Tc else v[:, :0]
    # 2. Compressed attention: query t sees block j iff j*d + l - 1 <= t.
    o_cmp, _, p = attend(k_cmp, v_cmp, (starts[None, :] + l - 1 <= pos[:, None]))
    # 3. Importance: group-summed probabilities, pooled to selection blocks by token overlap / d.
    nb = (T + lp - 1) // lp
    blocks = torch.arange(nb, device=q.device)
    overlap = (torch.minimum(starts[:, None] + l, (blocks[None, :] + 1) * lp)
               - torch.maximum(starts[:, None], blocks[None, :] * lp)).clamp_min(0)
    scores = p.detach().view(B, Hkv, G, T, Tc).sum(2) @ (overlap.to(p.dtype) / d)  # [B, Hkv, T, nb]
    # 4. Selection: candidates b*l' <= t; forced initial and local blocks; top scores, ties to the lower index.
    cand = blocks[None, :] * lp <= pos[:, None]
    cur = (pos // lp)[:, None]
    forced = cand & ((blocks[None, :] < cfg.num_init) | ((blocks[None, :] <= cur) & (blocks[None, :] > cur - cfg.num_local)))
    scores = scores.masked_fill(~cand, float("-inf")).masked_fill(forced, float("inf"))
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices
    rank = torch.empty_like(order).scatter_(-1, order, blocks.expand_as(order).contiguous())
    selected = rank < torch.clamp(cand.sum(-1), max=cfg.num_selected)[:, None]  # [B, Hkv, T, nb]
    # 5. Selected attention: tokens of the selected blocks at positions <= t (shared by the group).
    allowed = selected[..., pos // lp] & (pos[None, :] <= pos[:, None])
    o_slc, _, _ = attend(k, v, allowed.repeat_interleave(G, 1))
    # 6. Sliding window: keys in [t - w + 1, t].
    o_swa, _, _ = attend(k, v, (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - w))
    # 7. Output.
    return g_cmp[..., None] * o_cmp + g_slc[..., None] * o_slc + g_swa[..., None] * o_swa


def _pick_device(requested: str) -> torch.device:
    if requested != "auto":
        return torch.device(requested)
    if torch.cuda.is_available() and sparseattn.built_with_cuda():
        try:  # does this build run the whole NSA pipeline on CUDA yet?
            x = torch.zeros(1, 64, 1, 64, device="cuda", dtype=torch.bfloat16)
            nsa_attention(x, x, x, torch.zeros(1, 64, 1, device="cuda", dtype=torch.bfloat16))
            return torch.device("cuda")
        except SparseAttnUnsupportedError as e:
            print(f"note: CUDA is available but not supported by this build for nsa_attention ({e}); using the CPU")
    return torch.device("cpu")


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda")
    parser.add_argument("--dtype", default=None, help="float32, bfloat16 or float16 (default: bf16 on GPU, fp32 on CPU)")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seqlen", type=int, default=300)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--window", type=int, default=128)
    parser.add_argument("--num-selected", type=int, default=16, help="n (default 16: at T=300 every block)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    device = _pick_device(args.device)
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    cfg = NSAConfig(window=args.window, num_selected=args.num_selected)
    B, T, Hq, Hkv, D = args.batch, args.seqlen, args.heads, args.kv_heads, args.head_dim
    print(f"sparseattn {sparseattn.__version__} (CUDA built: {sparseattn.built_with_cuda()}), torch {torch.__version__}")
    print(f"device {device}, dtype {str(dtype).removeprefix('torch.')}, {cfg}")
    print(f"q [{B}, {T}, {Hq}, {D}], k/v [{B}, {T}, {Hkv}, {D}], gates [{B}, {T}, {Hq}]")

    gen = torch.Generator().manual_seed(args.seed)
    inputs64 = [torch.randn(B, T, h, D, generator=gen, dtype=torch.float64) for h in (Hq, Hkv, Hkv)]
    inputs64 += [torch.sigmoid(torch.randn(B, T, Hq, generator=gen, dtype=torch.float64)) for _ in range(3)]
    d_o64 = torch.randn(B, T, Hq, D, generator=gen, dtype=torch.float64)
    names = ["o", "dq", "dk", "dv", "dg_cmp", "dg_slc", "dg_swa"]

    def run(fn, tensors, d_o):
        tensors = [t.detach().requires_grad_() for t in tensors]
        out = fn(*tensors)
        grads = torch.autograd.grad(out, tensors, d_o)
        return [out.detach(), *grads]

    # The op under test, on the chosen device and dtype (warm-up, then timed).
    inputs = [t.to(device=device, dtype=dtype) for t in inputs64]
    d_o = d_o64.to(device=device, dtype=dtype)
    op = lambda q, k, v, a, b, c: nsa_attention(q, k, v, a, b, c, config=cfg)  # noqa: E731
    run(op, inputs, d_o)
    tensors = [t.detach().requires_grad_() for t in inputs]
    _sync(device)
    t0 = time.perf_counter()
    out = op(*tensors)
    _sync(device)
    t1 = time.perf_counter()
    grads = torch.autograd.grad(out, tensors, d_o)
    _sync(device)
    t2 = time.perf_counter()
    results = [out.detach(), *grads]
    print(f"forward {1e3 * (t1 - t0):.2f} ms, backward {1e3 * (t2 - t1):.2f} ms")

    reference = run(op, inputs64, d_o64)  # the same op on float64 CPU copies
    naive = run(lambda *x: naive_nsa(*x, cfg), inputs64, d_o64)

    # Tolerances relative to each tensor's magnitude: float64 agreement is exact up to summation order;
    # low precision is judged by what rounding the inputs and intermediates to that dtype costs.
    tol = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 5e-2}.get(dtype, 1e-10)
    ok = True
    print(f"{'tensor':8} {'shape':>18} {'|ref|max':>10} {'err vs f64 op':>14} {'f64 op vs naive':>16}")
    for name, got, ref, nai in zip(names, results, reference, naive):
        scale = ref.abs().max().item() or 1.0
        err = (got.double().cpu() - ref).abs().max().item()
        err_naive = (ref - nai).abs().max().item()
        good = err <= tol * scale and err_naive <= 1e-9 * scale and bool(torch.isfinite(got).all())
        ok &= good
        print(f"{name:8} {str(list(got.shape)):>18} {scale:10.3g} {err:14.3g} {err_naive:16.3g}"
              f"{'' if good else '  <-- FAIL'}")

    # The packed (varlen) layout must give the batched result (sequences of T and T - 123 tokens).
    lengths = [T, max(T - 123, 1)] if B >= 2 else [T]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
    packed = [torch.cat([t[b, :n] for b, n in enumerate(lengths)]) for t in inputs]
    o_packed = nsa_attention(*packed, config=cfg, cu_seqlens=cu, max_seqlen=max(lengths))
    o_rows = [nsa_attention(*(t[b:b + 1, :n] for t in inputs), config=cfg)[0] for b, n in enumerate(lengths)]
    err_packed = (o_packed - torch.cat(o_rows)).abs().max().item()
    good = err_packed <= tol * (o_packed.abs().max().item() or 1.0)
    ok &= good
    print(f"packed [{sum(lengths)}, {Hq}, {D}] with cu_seqlens {cu.tolist()}: max diff to batched {err_packed:.3g}"
          f"{'' if good else '  <-- FAIL'}")

    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
