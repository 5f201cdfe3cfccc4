"""Triage of gated flash_attention on CUDA: for the configurations of tests/python/test_cuda_flash_gated.py that
combine the gate with other terms, prints per output (o, lse, dq, dk, dv, dalpha, ddelta, dbias) the largest error
over the test's bound (a ratio above 1 fails the test) and where it lies, and whether two backward runs agree bit
for bit (the first differing index otherwise). Both kernel families (SPARSEATTN_ATTENTION_MMA unset: wgmma where it
runs; "sync": mma.sync).

    python scripts/gate_triage.py [--only mask_bias_tiles|gate_alone] [--seed 0]

Needs a CUDA build of sparseattn. One line per (case, family, output); the failing ones are marked FAIL.
"""
import argparse
import os

import torch

import sparseattn
from sparseattn import _ops

EPS = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}
FACTOR = {"o": 4, "dq": 8, "dk": 8, "dv": 8, "dalpha": 16, "ddelta": 16, "dbias": 8}


def cpu_copy(t):
    if t is None:
        return None
    return t.detach().cpu().float() if t.is_floating_point() else t.detach().cpu()


def forward_backward(fn, tensors, d_o, device):
    move = (lambda t: t) if device == "cuda" else cpu_copy
    leaves = [None if t is None else move(t).detach().clone().requires_grad_() for t in tensors]
    o, lse = fn(*leaves)
    given = [t for t in leaves if t is not None]
    return o, lse, torch.autograd.grad(o, given, move(d_o))


def report(case, family, names, got, ref, dtype):
    for name, g, r in zip(names, got, ref):
        g, r = g.detach().float().cpu(), r.detach().float().cpu()
        if name == "lse":
            inf_ok = torch.equal(torch.isinf(g), torch.isinf(r))
            fin = torch.isfinite(r) & torch.isfinite(g)
            err = (g[fin] - r[fin]).abs().max().item() if fin.any() else 0.0
            ratio = err / 2e-3 / (1 + r[fin].abs().max().item()) if fin.any() else 0.0
            bad = not inf_ok or ratio > 1 or torch.isnan(g).any().item()
            print(f"{'FAIL' if bad else 'ok  '} {case} {family} lse: -inf positions match {inf_ok}, ratio {ratio:.2f}")
            continue
        nan = torch.isnan(g).any().item()
        diff = (g - r).abs().nan_to_num(float("inf"))
        bound = FACTOR[name] * EPS[dtype] * r.abs().max().item() + 1e-4
        at = tuple(int(i) for i in torch.unravel_index(diff.argmax(), diff.shape)) if diff.numel() else ()
        ratio = diff.max().item() / bound if diff.numel() else 0.0
        bad = nan or ratio > 1
        print(f"{'FAIL' if bad else 'ok  '} {case} {family} {name}: error/bound {ratio:.2f} at {at}"
              f"{' NaN' if nan else ''} (got {g[at].item() if at else 0:.4g}, ref {r[at].item() if at else 0:.4g})")


def mask_bias_tiles(gate, dims, bias_code):
    """test_gated_with_mask_bias_tiles' inputs and functions."""
    B, T, S, Hq, Hkv, (Dqk, Dv), dtype = 2, 150, 190, 4, 2, dims, torch.float16
    bq, bk = 64, 48
    q = torch.randn(B, T, Hq, Dqk, dtype=dtype, device="cuda")
    k = torch.randn(B, S, Hkv, Dqk, dtype=dtype, device="cuda")
    v = torch.randn(B, S, Hkv, Dv, dtype=dtype, device="cuda")
    alpha = torch.randn(B, T, Hq, device="cuda").to(dtype)
    delta = torch.randn(B, S, Hkv, device="cuda").to(dtype)
    mask = torch.rand(B, Hq, T, S, device="cuda") < 0.8
    mask[..., 3, :] = False
    shape = {"1K1S": [1, Hkv, 1, S], "BHTS": [B, Hq, T, S]}[bias_code]
    bias = torch.randn(shape, device="cuda").to(dtype)
    blocks = torch.randint(0, 3, (B, Hkv, -(-T // bq), -(-S // bk)), dtype=torch.uint8, device="cuda")

    def fn(mask, blocks):
        return lambda q, k, v, a, d, b: _ops.flash_attention(
            q, k, v, mask, b, None, None, 0, 0, True, -1, -1, None, alpha=a, delta=d, gate=gate,
            block_mask=blocks, block_q=bq, block_k=bk)

    return fn(mask, blocks), fn(cpu_copy(mask), cpu_copy(blocks)), [q, k, v, alpha, delta, bias], dtype


def gate_alone(gate, dims, heads):
    """A gate without other terms (FlashGateMask), causal, T > S, GQA heads (head splits of the dK/dV kernels)."""
    B, T, S, (Hq, Hkv), (Dqk, Dv), dtype = 2, 300, 260, heads, dims, torch.bfloat16
    q = torch.randn(B, T, Hq, Dqk, dtype=dtype, device="cuda")
    k = torch.randn(B, S, Hkv, Dqk, dtype=dtype, device="cuda")
    v = torch.randn(B, S, Hkv, Dv, dtype=dtype, device="cuda")
    alpha, delta = torch.randn(B, T, Hq, device="cuda"), torch.randn(B, S, Hkv, device="cuda")

    def fn(q, k, v, a, d, b):
        return sparseattn.flash_attention(q, k, v, causal=True, alpha=a, delta=d, gate=gate, return_lse=True)

    return fn, fn, [q, k, v, alpha, delta, None], dtype


def compare(case, family, fn_gpu, fn_cpu, tensors, dtype):
    d_o = torch.randn_like(fn_gpu(*tensors)[0])
    o, lse, grads = forward_backward(fn_gpu, tensors, d_o, "cuda")
    o_ref, lse_ref, grads_ref = forward_backward(fn_cpu, tensors, d_o, "cpu")
    names = ["o", "lse"] + [n for n, t in zip(("dq", "dk", "dv", "dalpha", "ddelta", "dbias"), tensors) if t is not None]
    report(case, family, names, [o, lse, *grads], [o_ref, lse_ref, *grads_ref], dtype)
    again = forward_backward(fn_gpu, tensors, d_o, "cuda")
    for name, a, b in zip(names, [o, lse, *grads], [again[0], again[1], *again[2]]):
        if not torch.equal(a.nan_to_num(), b.nan_to_num()):
            at = tuple(int(i) for i in torch.nonzero(a.nan_to_num() != b.nan_to_num())[0])
            print(f"FAIL {case} {family} {name}: differs between two runs, first at {at}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", choices=["mask_bias_tiles", "gate_alone"], default=None)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    for family in ("auto", "sync"):
        if family == "sync":
            os.environ["SPARSEATTN_ATTENTION_MMA"] = "sync"
        else:
            os.environ.pop("SPARSEATTN_ATTENTION_MMA", None)
        for gate in ("logsigmoid", "product"):
            for dims in ((128, 128), (256, 256)):
                if args.only in (None, "mask_bias_tiles"):
                    for bias_code in ("1K1S", "BHTS"):
                        torch.manual_seed(args.seed)
                        case = f"mask_bias_tiles[{gate}-D{dims[0]}-{bias_code}]"
                        compare(case, family, *mask_bias_tiles(gate, dims, bias_code))
                if args.only in (None, "gate_alone"):
                    for heads in ((8, 1), (8, 2)):
                        torch.manual_seed(args.seed)
                        case = f"gate_alone[{gate}-D{dims[0]}-H{heads[0]}-{heads[1]}]"
                        compare(case, family, *gate_alone(gate, dims, heads))


if __name__ == "__main__":
    main()
