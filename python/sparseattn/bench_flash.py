"""The flash-sparse family benchmark: sparseattn.flash_attention's dense, block-sparse, key-bias, gated and
decode-shaped calls against PyTorch SDPA (cuDNN and flash backends) and FlexAttention, timed in one process.

    python -m sparseattn.bench_flash                                  # every section, the default cases
    python -m sparseattn.bench_flash --time-budget-s 300              # ... fitted into about 5 minutes
    python -m sparseattn.bench_flash --dense 32/8:8K --block-sparse --bias --gated --decode 32/8:128K:32
    python -m sparseattn.bench_flash --from-json bench/results/X_flash.json --out /tmp/x   # reports, no GPU
    python -m sparseattn.bench_flash --device cpu --dtype float32 --head-dim 16 --dense 4/2:256 ...  # smoke run

A case is HQ/HKV:T[:B] (query heads, KV heads, sequence length or, for decode, the KV-cache length, batch,
default 1); head dim --head-dim (128) for q, k and v; dtype --dtype (bf16). A section given without cases
(e.g. `--gated` alone) is left out. Sections, default cases, and what each measures (fwd and fwd+bwd, except
decode, which is forward only):

  dense         32/8:8K 32/8:16K 64/4:8K   causal: sparseattn.flash_attention(causal=True), SDPA cuDNN, SDPA
                                           flash (torch.nn.attention.sdpa_kernel). TFLOP/s, and the speed
                                           relative to cuDNN (cuDNN time / time; > 1: faster than cuDNN).
  block_sparse  32/8:32K                   causal, a block-sparse tile mask keeping --density of the causal
                                           (--tile x --tile) tiles (below): our dense causal, flash_attention
                                           with the dense tile mask (block_mask=bool tiles, block_size=(t, t)),
                                           with the same mask as a FlexAttention BlockMask, and FlexAttention
                                           (torch.compile'd flex_attention with that BlockMask). Bars: each
                                           sparseattn form's fwd+bwd time / our dense causal fwd+bwd <= 0.2.
  bias          32/8:16K                   causal, a key bias [B, Hkv, 1, T] requiring grad: our dense causal,
                                           flash_attention(bias=...), SDPA with a float attn_mask (the causal
                                           -inf mask plus the bias, [B, Hq, T, T]; the first backend of cuDNN,
                                           efficient, flash, math that runs fwd+bwd is used, and recorded), and
                                           FlexAttention with a score_mod reading the bias and a causal
                                           BlockMask. Bar: bias fwd+bwd / our dense fwd+bwd <= 1.25.
  gated         32/8:16K                   causal, alpha [B, T, Hq] and delta [B, T, Hkv] requiring grad, no
                                           threshold: our dense causal, flash_attention(alpha=, delta=) with
                                           gate="logsigmoid" and with gate="product"; and the logsigmoid gate
                                           with gate_threshold=-1 (128 x 128 tiles; with random gates it skips
                                           almost no tile, so it shows what the threshold's tile map costs).
                                           Bar: the logsigmoid gate's fwd+bwd / dense fwd+bwd <= 1.3.
  decode        32/8:128K:1 32/8:128K:32 64/4:128K:1 64/4:128K:32
                                           --decode-queries (1) queries against a KV cache of T keys, causal
                                           (bottom-right: the queries are the last ones): flash_attention,
                                           sparseattn.flash_decode where the package has it, SDPA cuDNN, flash
                                           and efficient (no mask for one query, else a bool lower-right mask).
                                           Time, K/V bytes read per second (B*T*Hkv*(Dqk+Dv)*element size /
                                           time; q and o are not counted) and its fraction of the GPU's peak
                                           HBM bandwidth (PEAK_HBM_BYTES_PER_S).

Block-sparse tile mask (causal_tile_mask): with n = ceil(T / tile) query and key tiles, the causal tiles are the
n(n+1)/2 tiles (i, j) with j <= i. Each KV head keeps round(density * n(n+1)/2) of them (at least the n
diagonal tiles): the n diagonal tiles always, and the rest drawn uniformly without replacement from the tiles
strictly below the diagonal, by torch.randperm on a CPU torch.Generator seeded with --seed (heads drawn in
order), so the mask depends only on (n, heads, density, seed). The query heads of a KV head share its mask
(sparseattn gets [1, Hkv, n, n]; the BlockMask, which FlexAttention reads per query head, [1, Hq, n, n] with
the diagonal tiles partial and the others full, and a mask_mod of the whole rule: causal and the tile kept).

Timing and failures are bench.py's (its docstring says how): CUDA events, L2 flush and GPU sleep before every
timed run, median; --time-budget-s shares the budget among the measurements left, and cases not started within
it are recorded as skipped. A measurement that fails is recorded ("unsupported": no CUDA kernel for it in this
build; "OOM"; "unavailable": e.g. an SDPA backend that does not take the call, no FlexAttention or no
flash_decode; "skipped") and the run goes on. Peak memory: the most allocated on top of the inputs during
fwd+bwd (decode: during the forward). --device cpu runs the same cases on the CPU reference with a wall-clock
timer and no peak memory, to check the benchmark itself.

FLOP counts: dense causal as bench.py (4 * Hq * D * T^2 / 2 per batch element, D = (Dqk + Dv) / 2, the
backward 2.5 x the forward); the bias and gate terms are not counted; the block-sparse forms count the
(query, key) pairs their kept tiles leave visible under the causal rule, exactly.

Reports: <out>/<GPU>_<date>_<commit>_flash.json, .md and .png (bench.py's stem plus "_flash"), rewritten after
every case; the bars are printed with met / not met at the end.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Callable, Optional

import torch

from . import bench
from .bench import Case, Shape, fmt_number, ratio, seqlen_label, time_cell
from .functional import flash_attention

SECTIONS = ("dense", "block_sparse", "bias", "gated", "decode")
DEFAULT_CASES = {
    "dense": ["32/8:8K", "32/8:16K", "64/4:8K"],
    "block_sparse": ["32/8:32K"],
    "bias": ["32/8:16K"],
    "gated": ["32/8:16K"],
    "decode": ["32/8:128K:1", "32/8:128K:32", "64/4:128K:1", "64/4:128K:32"],
}
METHODS = {
    "dense": ("sparseattn", "sdpa_cudnn", "sdpa_flash"),
    "block_sparse": ("sparseattn", "sparseattn_tiles", "sparseattn_blockmask", "flex"),
    "bias": ("sparseattn", "sparseattn_bias", "sdpa_bias", "flex_bias"),
    "gated": ("sparseattn", "sparseattn_gated", "sparseattn_gated_product", "sparseattn_gated_threshold"),
    "decode": ("sparseattn", "flash_decode", "sdpa_cudnn", "sdpa_flash", "sdpa_efficient"),
}
METHOD_LABELS = {
    "sparseattn": "sparseattn dense",
    "sdpa_cudnn": "SDPA cuDNN",
    "sdpa_flash": "SDPA flash",
    "sdpa_efficient": "SDPA efficient",
    "sparseattn_tiles": "sparseattn tile mask",
    "sparseattn_blockmask": "sparseattn BlockMask",
    "flex": "FlexAttention BlockMask",
    "sparseattn_bias": "sparseattn bias",
    "sdpa_bias": "SDPA float attn_mask",
    "flex_bias": "FlexAttention score_mod",
    "sparseattn_gated": "sparseattn gated",
    "sparseattn_gated_product": "sparseattn gated (product)",
    "sparseattn_gated_threshold": "sparseattn gated, gate_threshold -1",
    "flash_decode": "sparseattn flash_decode",
}
SECTION_TITLES = {
    "dense": "Dense causal attention",
    "block_sparse": "Block-sparse tile mask, causal",
    "bias": "Key bias [B, Hkv, 1, T] with its gradient, causal",
    "gated": "Gated attention (logsigmoid, no threshold), causal",
    "decode": "Decode: a few queries against a long KV cache",
}
SDPA_BIAS_BACKENDS = ("cudnn", "efficient", "flash", "math")


@dataclass(frozen=True)
class Bar:
    """A target: method's fwd+bwd time / our dense causal fwd+bwd time at most `limit`, per case of `section`."""
    section: str
    method: str
    limit: float

    def name(self) -> str:
        return f"{self.section}: {METHOD_LABELS[self.method]} fwd+bwd / sparseattn dense fwd+bwd <= {self.limit:g}"


BARS = (Bar("block_sparse", "sparseattn_tiles", 0.2), Bar("block_sparse", "sparseattn_blockmask", 0.2),
        Bar("bias", "sparseattn_bias", 1.25), Bar("gated", "sparseattn_gated", 1.3))

#: Peak HBM bandwidth by GPU name (first match of a substring of torch.cuda.get_device_name()), bytes/s. Source:
#: NVIDIA's data sheets: "NVIDIA H100 Tensor Core GPU" (H100 SXM 3.35 TB/s, H100 PCIe 2 TB/s, H100 NVL
#: 3.9 TB/s) and "NVIDIA H200 Tensor Core GPU" (H200 SXM and NVL 4.8 TB/s). The SXM H100 reports itself as
#: "NVIDIA H100 80GB HBM3".
PEAK_HBM_BYTES_PER_S = (("H100 PCIe", 2.0e12), ("H100 NVL", 3.9e12), ("H100", 3.35e12), ("H200", 4.8e12))


def peak_hbm_bytes_per_s(gpu_name: str) -> Optional[float]:
    for pattern, peak in PEAK_HBM_BYTES_PER_S:
        if pattern in gpu_name:
            return peak
    return None


# ---------------------------------------------------------------------------------------------- cases


@dataclass(frozen=True)
class CaseSpec:
    heads_q: int
    heads_kv: int
    seqlen: int
    batch: int = 1

    @staticmethod
    def parse(text: str) -> "CaseSpec":
        """HQ/HKV:T[:B], e.g. 32/8:16K or 32/8:128K:32."""
        parts = text.split(":")
        if len(parts) not in (2, 3) or parts[0].count("/") != 1:
            raise argparse.ArgumentTypeError(f"{text!r} is not HQ/HKV:T[:B] (e.g. 32/8:16K or 32/8:128K:32)")
        try:
            hq, hkv = (int(x) for x in parts[0].split("/"))
            seqlen = bench.parse_seqlen(parts[1])
            batch = int(parts[2]) if len(parts) == 3 else 1
        except ValueError as error:
            raise argparse.ArgumentTypeError(f"{text!r} is not HQ/HKV:T[:B]: {error}") from None
        if min(hq, hkv, seqlen, batch) < 1 or hq % hkv:
            raise argparse.ArgumentTypeError(f"{text!r}: sizes must be positive and HKV must divide HQ")
        return CaseSpec(hq, hkv, seqlen, batch)

    def label(self) -> str:
        return f"{self.heads_q}/{self.heads_kv}, T={seqlen_label(self.seqlen)}, B={self.batch}"


def case_label(result: dict) -> str:
    shape = result["shape"]
    return CaseSpec(shape["heads_q"], shape["heads_kv"], result["seqlen"], result["batch"]).label()


def passes(section: str) -> tuple[str, ...]:
    return ("fwd",) if section == "decode" else ("fwd", "fwd_bwd")


def measurement_count(section: str) -> int:
    return len(METHODS[section]) * len(passes(section))


# ------------------------------------------------------------------------------------- tile-mask generator


def causal_tile_mask(num_tiles: int, heads: int, density: float, seed: int) -> torch.Tensor:
    """bool [1, heads, n, n] (CPU): per head, the n diagonal tiles and random tiles strictly below the diagonal,
    round(density * n(n+1)/2) tiles in all (at least the diagonal); the module docstring says how they are
    drawn."""
    n = num_tiles
    causal_tiles = n * (n + 1) // 2
    extra = min(causal_tiles, max(n, round(density * causal_tiles))) - n
    below = torch.tril_indices(n, n, offset=-1)
    generator = torch.Generator().manual_seed(seed)
    mask = torch.zeros(1, heads, n, n, dtype=torch.bool)
    diagonal = torch.arange(n)
    mask[0, :, diagonal, diagonal] = True
    for head in range(heads):
        pick = torch.randperm(below.shape[1], generator=generator)[:extra]
        mask[0, head, below[0, pick], below[1, pick]] = True
    return mask


def visible_pairs(tiles: torch.Tensor, seqlen: int, tile: int) -> torch.Tensor:
    """float64 [heads]: the (query, key) pairs that a causal tile mask [1, heads, n, n] leaves visible, T = S."""
    n = tiles.shape[-1]
    lengths = torch.tensor([min(tile, seqlen - i * tile) for i in range(n)], dtype=torch.float64)
    per_tile = torch.outer(lengths, lengths).tril(-1) + torch.diag(lengths * (lengths + 1) / 2)
    return (tiles[0].to(torch.float64) * per_tile).sum((-2, -1))


def tile_lists(tiles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A bool tile mask [..., nQ, nK] as FlexAttention's (kv_num_blocks, kv_indices): int32, the kept tiles of each
    row first, ascending."""
    counts = tiles.sum(-1, dtype=torch.int32)
    indices = torch.sort((~tiles).to(torch.int8), dim=-1, stable=True).indices.to(torch.int32)
    return counts, indices


def causal_mask_mod(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def flex_block_mask(tiles: torch.Tensor, tile: int, seqlen: int):
    """A FlexAttention BlockMask of a causal tile mask [1, H, n, n] (H: the query heads): the diagonal tiles partial,
    the others full, and a mask_mod that is the whole rule (causal and the tile kept), so that FlexAttention's
    eager path, which reads only the mask_mod, computes the same attention as its kernels, which read the lists
    and the mask_mod on partial tiles."""
    from torch.nn.attention.flex_attention import BlockMask

    diagonal = torch.eye(tiles.shape[-1], dtype=torch.bool, device=tiles.device)
    kept = tiles[0]

    def mask_mod(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & kept[h, q_idx // tile, kv_idx // tile]

    return BlockMask.from_kv_blocks(*tile_lists(tiles & diagonal), *tile_lists(tiles & ~diagonal),
                                    BLOCK_SIZE=(tile, tile), mask_mod=mask_mod, seq_lengths=(seqlen, seqlen))


def bias_score_mod(bias: torch.Tensor, group: int):
    """FlexAttention score_mod adding a key bias [B, Hkv, 1, S] (query head h reads bias head h // group)."""
    def score_mod(score, b, h, q_idx, kv_idx):
        return score + bias[b, h // group, 0, kv_idx]
    return score_mod


def sdpa_bias_mask(causal_minus_inf: torch.Tensor, bias: torch.Tensor, group: int) -> torch.Tensor:
    """SDPA's float attn_mask [B, Hq, T, S] for a causal call with a key bias [B, Hkv, 1, S]: causal_minus_inf
    ([T, S], -inf above the diagonal, else 0) plus the bias repeated over the query heads of each group."""
    return causal_minus_inf + bias.repeat_interleave(group, dim=1)


def decode_sdpa_mask(queries: int, keys: int, device) -> Optional[torch.Tensor]:
    """SDPA's attn_mask for `queries` queries at the end of `keys` keys: none for one query (it sees every key),
    else a bool bottom-right causal mask [queries, keys] (is_causal is top-left aligned)."""
    if queries == 1:
        return None
    return torch.ones(queries, keys, dtype=torch.bool, device=device).tril(keys - queries)


# ------------------------------------------------------------------------------------------------- timing


class WallClockTimer(bench.Timer):
    """bench.Timer's interface for --device cpu: wall-clock median, no L2 flush, no GPU sleep, no peak memory."""

    def measure(self, fn: Callable[[], object], peak_memory: bool = False):
        start = time.perf_counter()
        value = fn()
        first_ms = max((time.perf_counter() - start) * 1000, 1e-3)
        target = self.target_ms()
        self.measurements_left = max(1, self.measurements_left - 1)
        times = []
        for _ in range(max(1, min(self.max_reps, int(target / first_ms)))):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1000)
        return statistics.median(times), len(times), None, value


def guarded(fn: Callable[[], object]) -> Callable[[], object]:
    """fn, with errors that bench.Case does not catch (e.g. torch.compile's) raised as RuntimeError, so that the
    measurement is recorded as failed and the run goes on."""
    def run():
        try:
            return fn()
        except (RuntimeError, NotImplementedError, ValueError):
            raise
        except Exception as error:  # noqa: BLE001 - recorded with its type, never swallowed
            raise RuntimeError(f"{type(error).__name__}: {error}") from error
    return run


def measure_method(case: Case, method: str, forward: Callable[[], torch.Tensor], inputs, d_o,
                   section: str) -> None:
    """Times `forward` under torch.no_grad() as method_fwd and, unless decode, forward + torch.autograd.grad of
    `inputs` as method_fwd_bwd (with its peak memory; decode: the forward's)."""
    with torch.no_grad():
        case.measure(f"{method}_fwd", guarded(forward), peak_memory=section == "decode")
    if section != "decode":
        case.measure(f"{method}_fwd_bwd", guarded(lambda: torch.autograd.grad(forward(), inputs, d_o)),
                     peak_memory=True)


def fail_method(case: Case, method: str, section: str, reason: str) -> None:
    for suffix in passes(section):
        case.fail(f"{method}_{suffix}", reason)


_COMPILED: dict = {}


def flex_functions():
    """(compiled flex_attention, create_block_mask), or raises ImportError."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if "flex" not in _COMPILED:
        _COMPILED["flex"] = torch.compile(flex_attention, dynamic=False)
    return _COMPILED["flex"], create_block_mask


def flex_or_reason(args) -> tuple[Optional[tuple], Optional[str]]:
    if not args.flex:
        return None, "skipped: --no-flex"
    try:
        return flex_functions(), None
    except ImportError as error:
        return None, f"unavailable: this torch has no FlexAttention ({error})"


def heads_first(*tensors):
    """[B, T, H, D] -> [B, H, T, D] views (SDPA's and FlexAttention's layout)."""
    return tuple(t.transpose(1, 2) for t in tensors)


# ------------------------------------------------------------------------------------------------ sections


def run_dense(case: Case, spec: CaseSpec, q, k, v, d_o, args) -> None:
    measure_method(case, "sparseattn", lambda: flash_attention(q, k, v, causal=True), (q, k, v), d_o, "dense")
    bench.measure_dense(case, q, k, v, d_o)


def run_block_sparse(case: Case, spec: CaseSpec, q, k, v, d_o, args) -> None:
    section = "block_sparse"
    tile, group = args.tile, spec.heads_q // spec.heads_kv
    num_tiles = -(-spec.seqlen // tile)
    tiles = causal_tile_mask(num_tiles, spec.heads_kv, args.density, args.seed)
    pairs = visible_pairs(tiles, spec.seqlen, tile)
    sparse_flops = 4 * spec.batch * group * float(pairs.sum()) * args.head_dim
    case.result["flops"].update(sparseattn_tiles=sparse_flops, sparseattn_blockmask=sparse_flops, flex=sparse_flops)
    case.result["notes"]["tiles_kept_per_kv_head"] = tiles[0].sum((-2, -1)).tolist()
    case.result["notes"]["tile_density"] = float(tiles.sum()) / (spec.heads_kv * num_tiles * (num_tiles + 1) / 2)
    tiles = tiles.to(q.device)
    inputs = (q, k, v)

    measure_method(case, "sparseattn", lambda: flash_attention(q, k, v, causal=True), inputs, d_o, section)
    measure_method(case, "sparseattn_tiles", lambda: flash_attention(q, k, v, causal=True, block_mask=tiles,
                                                                     block_size=(tile, tile)), inputs, d_o, section)
    try:
        block_mask = flex_block_mask(tiles.repeat_interleave(group, dim=1), tile, spec.seqlen)
    except ImportError as error:
        for method in ("sparseattn_blockmask", "flex"):
            fail_method(case, method, section, f"unavailable: this torch has no FlexAttention BlockMask ({error})")
        return
    measure_method(case, "sparseattn_blockmask", lambda: flash_attention(q, k, v, causal=True, block_mask=block_mask),
                   inputs, d_o, section)
    flex, reason = flex_or_reason(args)
    if flex is None:
        fail_method(case, "flex", section, reason)
        return
    qh, kh, vh, d_oh = heads_first(q, k, v, d_o)
    measure_method(case, "flex", lambda: flex[0](qh, kh, vh, block_mask=block_mask, enable_gqa=True),
                   inputs, d_oh, section)


def run_bias(case: Case, spec: CaseSpec, q, k, v, d_o, args) -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    section = "bias"
    group, seqlen = spec.heads_q // spec.heads_kv, spec.seqlen
    bias = torch.randn(spec.batch, spec.heads_kv, 1, seqlen, device=q.device, dtype=q.dtype, requires_grad=True)
    inputs = (q, k, v, bias)
    measure_method(case, "sparseattn", lambda: flash_attention(q, k, v, causal=True), (q, k, v), d_o, section)
    measure_method(case, "sparseattn_bias", lambda: flash_attention(q, k, v, causal=True, bias=bias), inputs, d_o,
                   section)

    qh, kh, vh, d_oh = heads_first(q, k, v, d_o)
    try:
        causal_minus_inf = torch.full((seqlen, seqlen), -math.inf, device=q.device, dtype=q.dtype).triu(1)
    except torch.OutOfMemoryError as error:
        fail_method(case, "sdpa_bias", section, bench.failure_reason(error, []))
    else:
        backends = {"cudnn": SDPBackend.CUDNN_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
                    "flash": SDPBackend.FLASH_ATTENTION, "math": SDPBackend.MATH}
        rejected = {}
        for name in SDPA_BIAS_BACKENDS:
            def forward(backend=backends[name]):
                attn_mask = sdpa_bias_mask(causal_minus_inf, bias, group)
                with sdpa_kernel([backend]):
                    return torch.nn.functional.scaled_dot_product_attention(qh, kh, vh, attn_mask=attn_mask,
                                                                            enable_gqa=True)

            case.measure("sdpa_bias_fwd_bwd", guarded(lambda: torch.autograd.grad(forward(), inputs, d_oh)),
                         peak_memory=True)
            if case.result["times_ms"]["sdpa_bias_fwd_bwd"] is not None:
                case.result["notes"]["sdpa_bias_backend"] = name
                with torch.no_grad():
                    case.measure("sdpa_bias_fwd", guarded(forward))
                break
            rejected[name] = case.result["errors"].pop("sdpa_bias_fwd_bwd")
        else:
            fail_method(case, "sdpa_bias", section, "unavailable: no SDPA backend ran fwd+bwd with the float "
                                                    "attn_mask (see notes)")
        if rejected:
            case.result["notes"]["sdpa_bias_rejected"] = rejected
        del causal_minus_inf

    flex, reason = flex_or_reason(args)
    if flex is None:
        fail_method(case, "flex_bias", section, reason)
        return
    compiled_flex, create_block_mask = flex

    try:
        causal_blocks = create_block_mask(causal_mask_mod, None, None, seqlen, seqlen, device=q.device)
    except (RuntimeError, torch.OutOfMemoryError) as error:
        fail_method(case, "flex_bias", section, bench.failure_reason(error, []))
        return
    measure_method(case, "flex_bias", lambda: compiled_flex(qh, kh, vh, score_mod=bias_score_mod(bias, group),
                                                            block_mask=causal_blocks, enable_gqa=True),
                   inputs, d_oh, section)


def run_gated(case: Case, spec: CaseSpec, q, k, v, d_o, args) -> None:
    alpha = torch.randn(spec.batch, spec.seqlen, spec.heads_q, device=q.device, dtype=q.dtype, requires_grad=True)
    delta = torch.randn(spec.batch, spec.seqlen, spec.heads_kv, device=q.device, dtype=q.dtype, requires_grad=True)
    measure_method(case, "sparseattn", lambda: flash_attention(q, k, v, causal=True), (q, k, v), d_o, "gated")
    measure_method(case, "sparseattn_gated", lambda: flash_attention(q, k, v, causal=True, alpha=alpha, delta=delta),
                   (q, k, v, alpha, delta), d_o, "gated")
    measure_method(case, "sparseattn_gated_product",
                   lambda: flash_attention(q, k, v, causal=True, alpha=alpha, delta=delta, gate="product"),
                   (q, k, v, alpha, delta), d_o, "gated")
    measure_method(case, "sparseattn_gated_threshold",
                   lambda: flash_attention(q, k, v, causal=True, alpha=alpha, delta=delta, gate_threshold=-1.0),
                   (q, k, v, alpha, delta), d_o, "gated")


def run_decode(case: Case, spec: CaseSpec, q, k, v, d_o, args) -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import sparseattn

    section = "decode"
    measure_method(case, "sparseattn", lambda: flash_attention(q, k, v, causal=True), (), None, section)
    flash_decode = getattr(sparseattn, "flash_decode", None)
    if flash_decode is None:
        fail_method(case, "flash_decode", section, "unavailable: this sparseattn has no flash_decode")
    else:
        measure_method(case, "flash_decode", lambda: flash_decode(q, k, v, causal=True), (), None, section)
    attn_mask = decode_sdpa_mask(q.shape[1], k.shape[1], q.device)
    qh, kh, vh = heads_first(q, k, v)
    backends = {"sdpa_cudnn": SDPBackend.CUDNN_ATTENTION, "sdpa_flash": SDPBackend.FLASH_ATTENTION,
                "sdpa_efficient": SDPBackend.EFFICIENT_ATTENTION}
    for method, backend in backends.items():
        def forward(backend=backend):
            with sdpa_kernel([backend]):
                return torch.nn.functional.scaled_dot_product_attention(qh, kh, vh, attn_mask=attn_mask,
                                                                        enable_gqa=True)

        measure_method(case, method, forward, (), None, section)


RUNNERS = {"dense": run_dense, "block_sparse": run_block_sparse, "bias": run_bias, "gated": run_gated,
           "decode": run_decode}


def new_result(section: str, spec: CaseSpec, args) -> dict:
    """The result dict of one case before its measurements: bench.Case's keys, the section, batch and query count,
    and the forward FLOPs of each method (dense causal; block_sparse overwrites its sparse forms') or, for decode,
    the K/V bytes."""
    shape = Shape(spec.heads_q, spec.heads_kv, args.head_dim, args.head_dim)
    result = {"section": section, "shape": asdict(shape), "seqlen": spec.seqlen, "batch": spec.batch,
              "queries": args.decode_queries if section == "decode" else spec.seqlen, "times_ms": {}, "reps": {},
              "peak_memory_gb": {}, "errors": {}, "notes": {}}
    if section == "decode":
        element_bytes = getattr(torch, args.dtype).itemsize
        result["kv_bytes"] = spec.batch * spec.seqlen * spec.heads_kv * (shape.dim_qk + shape.dim_v) * element_bytes
    else:
        result["flops"] = {m: spec.batch * bench.dense_flops(shape, spec.seqlen) for m in METHODS[section]}
    return result


def run_case(section: str, spec: CaseSpec, args, timer: bench.Timer, device: str) -> dict:
    shape = Shape(spec.heads_q, spec.heads_kv, args.head_dim, args.head_dim)
    case = Case(shape, spec.seqlen, timer)
    case.result = new_result(section, spec, args)
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(args.seed)
    queries = case.result["queries"]
    grad = section != "decode"
    try:
        q = torch.randn(spec.batch, queries, spec.heads_q, args.head_dim, device=device, dtype=dtype,
                        requires_grad=grad)
        k, v = (torch.randn(spec.batch, spec.seqlen, spec.heads_kv, args.head_dim, device=device, dtype=dtype,
                            requires_grad=grad) for _ in range(2))
        d_o = torch.randn_like(q) if grad else None
    except torch.OutOfMemoryError as error:
        case.result["errors"]["case"] = bench.failure_reason(error, [])
        return case.result
    RUNNERS[section](case, spec, q, k, v, d_o, args)
    return case.result


# ------------------------------------------------------------------------------------ derived numbers, bars


def summarize(result: dict, peak_bytes_per_s: Optional[float]) -> dict:
    """Adds TFLOP/s and ratios (dense: cuDNN time / time; block_sparse, bias, gated: time / our dense time), or
    for decode the K/V bytes per second and their fraction of the peak HBM bandwidth."""
    section, times = result["section"], result["times_ms"]
    if section == "decode":
        result["kv_bytes_per_s"] = {}
        result["fraction_of_peak_hbm"] = {}
        for method in METHODS[section]:
            ms = times.get(f"{method}_fwd")
            rate = None if ms is None else result["kv_bytes"] / (ms * 1e-3)
            result["kv_bytes_per_s"][method] = rate
            result["fraction_of_peak_hbm"][method] = ratio(rate, peak_bytes_per_s)
        return result
    result["tflops"], result["ratios"] = {}, {}
    reference = "sdpa_cudnn" if section == "dense" else "sparseattn"
    for method in METHODS[section]:
        flops = result["flops"].get(method)
        for suffix, work in (("fwd", 1.0), ("fwd_bwd", 1 + bench.BACKWARD_FLOPS)):
            key, ms = f"{method}_{suffix}", times.get(f"{method}_{suffix}")
            result["tflops"][key] = None if ms is None or flops is None else work * flops / (ms * 1e-3) / 1e12
            other = times.get(f"{reference}_{suffix}")
            result["ratios"][key] = ratio(other, ms) if section == "dense" else ratio(ms, other)
    return result


def evaluate_bars(results: list[dict]) -> list[dict]:
    """One row per bar and case of its section: value (fwd+bwd time ratio), limit, status met / not met / not
    measured (with the reason)."""
    rows = []
    for bar in BARS:
        for result in (r for r in results if r["section"] == bar.section):
            value = result.get("ratios", {}).get(f"{bar.method}_fwd_bwd")
            row = {"bar": bar.name(), "section": bar.section, "method": bar.method, "case": case_label(result),
                   "limit": bar.limit, "value": value}
            if value is None:
                errors = result.get("errors", {})
                reason = (errors.get(f"{bar.method}_fwd_bwd") or errors.get("sparseattn_fwd_bwd")
                          or errors.get("case") or "no time")
                row["status"] = f"not measured ({reason.split(':')[0]})"
            else:
                row["status"] = "met" if value <= bar.limit else "not met"
            rows.append(row)
    return rows


# ------------------------------------------------------------------------------------------------- reports


def peak_cell(result: dict, key: str) -> str:
    return fmt_number(result["peak_memory_gb"].get(key))


def fmt_rate(value: Optional[float]) -> str:
    """TFLOP/s or TB/s: whole numbers from 10 up, else two decimals."""
    return fmt_number(value, 0 if value is not None and value >= 10 else 2)


def section_table(section: str, results: list[dict]) -> list[str]:
    rows = []
    if section == "decode":
        rows += ["| case | Tq | K/V GB | method | ms | K/V TB/s | % of peak HBM | peak GB |",
                 "|---|---|---|---|---|---|---|---|"]
        for r in results:
            for method in METHODS[section]:
                rate, fraction = r.get("kv_bytes_per_s", {}).get(method), r.get("fraction_of_peak_hbm", {}).get(method)
                rows.append(f"| {case_label(r)} | {r['queries']} | {r['kv_bytes'] / 1e9:.2f} | {METHOD_LABELS[method]} "
                            f"| {time_cell(r, f'{method}_fwd')} | {fmt_number(None if rate is None else rate / 1e12)} "
                            f"| {fmt_number(None if fraction is None else 100 * fraction, 0)} "
                            f"| {peak_cell(r, f'{method}_fwd')} |")
        return rows
    ratio_header = "speed vs cuDNN fwd, fwd+bwd" if section == "dense" else "time / sparseattn dense fwd, fwd+bwd"
    rows += [f"| case | method | fwd ms | fwd+bwd ms | TFLOP/s fwd, fwd+bwd | {ratio_header} | peak GB fwd+bwd |",
             "|---|---|---|---|---|---|---|"]
    for r in results:
        tflops, ratios = r.get("tflops", {}), r.get("ratios", {})
        for method in METHODS[section]:
            fwd, fwd_bwd = f"{method}_fwd", f"{method}_fwd_bwd"
            rows.append(f"| {case_label(r)} | {METHOD_LABELS[method]} | {time_cell(r, fwd)} | {time_cell(r, fwd_bwd)} "
                        f"| {fmt_rate(tflops.get(fwd))}, {fmt_rate(tflops.get(fwd_bwd))} "
                        f"| {fmt_number(ratios.get(fwd))}, {fmt_number(ratios.get(fwd_bwd))} "
                        f"| {peak_cell(r, method)} |")
    return rows


def section_notes(section: str, meta: dict, results: list[dict]) -> list[str]:
    lines = []
    if section == "block_sparse":
        lines.append(f"Tile mask: {meta['tile']}x{meta['tile']} tiles, density {meta['density']:g} of the causal "
                     f"tiles (diagonal always kept, the rest random, seed {meta['seed']}); TFLOP/s of the sparse "
                     "forms count the visible (query, key) pairs.")
        for r in results:
            if "tile_density" in r.get("notes", {}):
                lines.append(f"- {case_label(r)}: {r['notes']['tile_density']:.4f} of the causal tiles kept, per KV "
                             f"head {r['notes']['tiles_kept_per_kv_head']}")
    if section == "bias":
        for r in results:
            notes = r.get("notes", {})
            used = notes.get("sdpa_bias_backend", "none")
            line = f"- {case_label(r)}: SDPA with the float attn_mask ran on backend `{used}`"
            rejected = notes.get("sdpa_bias_rejected", {})
            if rejected:
                line += "; not taken by " + "; ".join(f"`{name}` ({reason})" for name, reason in rejected.items())
            lines.append(line)
    if section == "decode":
        peak = meta.get("peak_hbm_bytes_per_s")
        lines.append(f"Peak HBM bandwidth of {meta['gpu']}: "
                     + (f"{peak / 1e12:g} TB/s (NVIDIA data sheet)." if peak else "not in the table (no fraction)."))
    return [""] + lines if lines else []


def not_measured_lines(results: list[dict], label: Callable[[dict], str]) -> list[str]:
    """The report's "Not measured" list: each failed measurement with its reason and the cases it failed in."""
    failures: dict[tuple[str, str], list[str]] = {}
    for r in results:
        for key, reason in r.get("errors", {}).items():
            failures.setdefault((f"{r['section']}: {key}", reason), []).append(label(r))
    if not failures:
        return []
    return ["", "Not measured:", ""] + [f"- `{key}` at {'; '.join(cases)}: {reason}"
                                        for (key, reason), cases in failures.items()]


def markdown(meta: dict, results: list[dict], bars: list[dict]) -> str:
    lines = [f"# sparseattn flash-sparse benchmark: {meta['gpu']}, {meta['date']}, commit {meta['commit']}", "",
             f"dtype {meta['dtype']}, head dim {meta['head_dim']}, device {meta['device']}. Times in ms (median); "
             "fwd runs under torch.no_grad(), fwd+bwd includes the gradients of every input that requires grad. "
             "Peak memory: the most allocated on top of the inputs during fwd+bwd (decode: the forward). "
             "`python -m sparseattn.bench_flash --help` says what each section measures."]
    if bars:
        lines += ["", "## Bars", "", "| bar | case | value | status |", "|---|---|---|---|"]
        lines += [f"| {b['bar']} | {b['case']} | {fmt_number(b['value'])} | {b['status']} |" for b in bars]
    for number, section in enumerate(SECTIONS, 1):
        rows = [r for r in results if r["section"] == section]
        if rows:
            lines += ["", f"## {number}. {SECTION_TITLES[section]}", ""] + section_table(section, rows)
            lines += section_notes(section, meta, rows)
    lines += not_measured_lines(results, case_label)
    return "\n".join(lines) + "\n"


def plot(meta: dict, results: list[dict], path: str) -> None:
    """One panel per section: horizontal bars of the fwd+bwd times (decode: fwd), log scale. Needs matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = []
    for section in SECTIONS:
        suffix = passes(section)[-1]
        bars = [(f"{case_label(r)} | {METHOD_LABELS[m]}", r["times_ms"][f"{m}_{suffix}"])
                for r in results if r["section"] == section for m in METHODS[section]
                if r["times_ms"].get(f"{m}_{suffix}") is not None]
        if bars:
            panels.append((section, suffix, bars))
    if not panels:
        return
    fig, axes = plt.subplots(len(panels), 1, figsize=(9, sum(1 + 0.25 * len(b) for _, _, b in panels)),
                             squeeze=False)
    for ax, (section, suffix, bars) in zip(axes[:, 0], panels):
        labels, values = zip(*bars)
        ax.barh(range(len(values)), values, color=["C0" if "sparseattn" in label else "C1" for label in labels])
        ax.set_yticks(range(len(values)), labels, fontsize=7)
        ax.invert_yaxis()
        ax.set_xscale("log")
        ax.set_title(f"{SECTION_TITLES[section]} ({suffix.replace('_', '+')}, ms)", fontsize=9)
        ax.grid(True, axis="x", which="both", alpha=0.3)
    fig.suptitle(f"sparseattn flash-sparse: {meta['gpu']}, {meta['dtype']}, commit {meta['commit']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def report_stem(out: str, meta: dict) -> str:
    return bench.report_stem(out, meta) + "_flash"


def write_reports(stem: str, meta: dict, results: list[dict], with_plot: bool) -> list[str]:
    """stem.json (meta, results, bars), stem.md and (with_plot, if matplotlib is there) stem.png; returns the paths.
    Creates the output folder only here."""
    bars = evaluate_bars(results)
    os.makedirs(os.path.dirname(stem) or ".", exist_ok=True)
    with open(stem + ".json", "w") as f:
        json.dump({"meta": meta, "results": results, "bars": bars}, f, indent=1)
    with open(stem + ".md", "w") as f:
        f.write(markdown(meta, results, bars))
    written = [stem + ".json", stem + ".md"]
    if with_plot and results:
        try:
            plot(meta, results, stem + ".png")
            if os.path.exists(stem + ".png"):
                written.append(stem + ".png")
        except ImportError as error:
            print(f"no plot ({error}); pip install matplotlib, then rerun with --from-json {stem}.json")
    return written


def bar_lines(bars: list[dict]) -> list[str]:
    return [f"bar {b['bar']} at {b['case']}: {fmt_number(b['value'])}: {b['status']}" for b in bars]


# ---------------------------------------------------------------------------------------------------- main


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m sparseattn.bench_flash", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    for section in SECTIONS:
        parser.add_argument(f"--{section.replace('_', '-')}", dest=section, nargs="*", type=CaseSpec.parse,
                            default=[CaseSpec.parse(text) for text in DEFAULT_CASES[section]], metavar="HQ/HKV:T[:B]",
                            help=f"cases of the {section} section (default {' '.join(DEFAULT_CASES[section])}); "
                                 "none: leave the section out")
    parser.add_argument("--head-dim", type=int, default=128, help="head dim of q, k and v")
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    parser.add_argument("--density", type=float, default=0.1, help="block_sparse: kept fraction of the causal tiles")
    parser.add_argument("--tile", type=int, default=128, help="block_sparse: tile size (queries and keys)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the tile mask and of the inputs")
    parser.add_argument("--decode-queries", type=int, default=1, help="decode: queries per sequence (1..16)")
    parser.add_argument("--flex", action=argparse.BooleanOptionalAction, default=True,
                        help="measure FlexAttention (torch.compile'd) where a section has it")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                        help="cpu: the CPU reference with a wall-clock timer, to check the benchmark itself")
    parser.add_argument("--out", default="bench/results", help="folder for the JSON, markdown and PNG files")
    parser.add_argument("--time-budget-s", type=float, default=None,
                        help="wall-clock seconds the run should fit in: fewer timed runs per measurement, and "
                             "cases not started in time are recorded as skipped")
    parser.add_argument("--rep-ms", type=float, default=100.0, help="timed milliseconds per measurement")
    parser.add_argument("--warmup-ms", type=float, default=25.0, help="untimed milliseconds before timing")
    parser.add_argument("--max-reps", type=int, default=100, help="most timed runs per measurement")
    parser.add_argument("--from-json", metavar="JSON",
                        help="rewrite the markdown and plot of an earlier run into --out (no GPU needed)")
    args = parser.parse_args(argv)
    if not 0 < args.density <= 1:
        parser.error("--density must be in (0, 1]")
    if args.tile < 1 or args.head_dim < 1 or not 1 <= args.decode_queries:
        parser.error("--tile, --head-dim and --decode-queries must be positive")
    return args


def planned_cases(args) -> list[tuple[str, CaseSpec]]:
    return [(section, spec) for section in SECTIONS for spec in getattr(args, section)]


def main(argv: Optional[list[str]] = None) -> None:
    args = parse_args(argv)
    if args.from_json:
        with open(args.from_json) as f:
            saved = json.load(f)
        meta = saved["meta"]
        results = [summarize(r, meta.get("peak_hbm_bytes_per_s")) for r in saved["results"]]
        written = write_reports(report_stem(args.out, meta), meta, results, with_plot=True)
        print("\n".join(bar_lines(evaluate_bars(results))))
        print("wrote " + ", ".join(written))
        return
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("the benchmark needs a CUDA GPU (or --device cpu to check it on the CPU reference)")
    started = time.monotonic()
    timer_class = bench.Timer if args.device == "cuda" else WallClockTimer
    timer = timer_class(args.rep_ms, args.warmup_ms, args.max_reps, args.time_budget_s)
    gpu = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    meta = {"gpu": gpu, "date": datetime.date.today().isoformat(), "commit": bench.git_commit(),
            "torch": torch.__version__, "dtype": args.dtype, "head_dim": args.head_dim, "device": args.device,
            "density": args.density, "tile": args.tile, "seed": args.seed, "decode_queries": args.decode_queries,
            "flex": args.flex, "peak_hbm_bytes_per_s": peak_hbm_bytes_per_s(gpu),
            "cases": {s: [f"{c.heads_q}/{c.heads_kv}:{c.seqlen}:{c.batch}" for c in getattr(args, s)]
                      for s in SECTIONS},
            "timing": {"rep_ms": args.rep_ms, "warmup_ms": args.warmup_ms, "max_reps": args.max_reps,
                       "time_budget_s": args.time_budget_s}}
    stem = report_stem(args.out, meta)
    cases = planned_cases(args)
    results = []
    for index, (section, spec) in enumerate(cases):
        if timer.out_of_time():
            result = new_result(section, spec, args)
            result["errors"]["case"] = "skipped: time budget exhausted"
        else:
            timer.measurements_left = sum(measurement_count(s) for s, _ in cases[index:])
            result = run_case(section, spec, args, timer, args.device)
        results.append(summarize(result, meta["peak_hbm_bytes_per_s"]))
        if args.device == "cuda":
            torch.cuda.empty_cache()
        meta["wall_s"] = round(time.monotonic() - started, 1)
        write_reports(stem, meta, results, with_plot=False)
        times = ", ".join(f"{m} {time_cell(result, f'{m}_{passes(section)[-1]}')}" for m in METHODS[section])
        print(f"[{meta['wall_s']:.0f} s] {section} {spec.label()}: {passes(section)[-1].replace('_', '+')} ms: "
              f"{times}", flush=True)
    written = write_reports(stem, meta, results, with_plot=True)
    print(markdown(meta, results, evaluate_bars(results)))
    print("\n".join(bar_lines(evaluate_bars(results))))
    print("wrote " + ", ".join(written))


if __name__ == "__main__":
    main()
