"""Summaries of Nsight Compute's CSV exports, to read where a kernel's time goes without the GUI.

    python scripts/ncu_source.py source SOURCE.csv [--kernel TEXT] [--top N] [--regions PCT]
    python scripts/ncu_source.py details DETAILS.csv [--kernel TEXT]

SOURCE.csv is `ncu -i REPORT --page source --csv --print-source sass` (one block per kernel: a "Kernel Name" line,
then a header and one row per SASS instruction with its warp-state samples, stall reasons and execution count);
DETAILS.csv is `ncu -i REPORT --page details --csv`. `source` prints, per kernel whose name contains TEXT (each name
once): the samples and the stall reasons' shares; the shares of the instructions grouped by execution count (code
that runs once per tile against once per step); contiguous runs of instructions with one execution count above PCT
percent of the samples (regions: the prologue, a loop body, the epilogue), with their HGMMA count and top stall
reasons; and the TOP instructions with the most samples. `details` prints a few headline metrics per kernel launch
(duration, SM and memory throughput, issue slots, IPC, registers, shared memory).
scripts/gpu_profile.sh records the report on a GPU machine and writes both summaries.
"""
from __future__ import annotations

import argparse
import csv
import sys
from collections import defaultdict

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"
DETAIL_METRICS = ["Duration", "Compute (SM) Throughput", "Memory Throughput", "DRAM Throughput",
                  "L2 Cache Throughput", "Issue Slots Busy", "Executed Ipc Active",
                  "Warp Cycles Per Issued Instruction", "Registers Per Thread", "Dynamic Shared Memory Per Block"]


def number(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def source_blocks(lines) -> list[dict]:
    """The kernels of a source-page export: [{'name', 'header', 'rows': [{column: value}]}], in file order."""
    blocks: list[dict] = []
    header: list[str] | None = None
    for row in csv.reader(lines):
        if not row:
            continue
        if row[0] == "Kernel Name":
            blocks.append({"name": row[1] if len(row) > 1 else "", "header": [], "rows": []})
            header = None
        elif blocks and header is None and row[0] == "Address":
            header = row
            blocks[-1]["header"] = row
        elif blocks and header is not None:
            blocks[-1]["rows"].append(dict(zip(header, row)))
    return blocks


def stall_columns(header: list[str]) -> list[str]:
    return [h for h in header if h.startswith("stall_") and "Not Issued" not in h]


def shares(rows: list[dict], columns: list[str], total: float) -> list[tuple[str, float]]:
    """(stall reason, percent of total) for the columns, largest first, above 0.5%."""
    sums = [(c[len("stall_"):], 100.0 * sum(number(r.get(c, "")) for r in rows) / total) for c in columns]
    return [(name, pct) for name, pct in sorted(sums, key=lambda x: -x[1]) if pct >= 0.5]


def summarize_source(block: dict, top: int = 15, region_pct: float = 1.0) -> str:
    rows, columns = block["rows"], stall_columns(block["header"])
    total = sum(number(r.get(SAMPLES, "")) for r in rows) or 1.0
    out = [f"## {block['name']}",
           f"samples {total:.0f}, instructions executed {sum(number(r.get(EXECUTED, '')) for r in rows):.0f}",
           "stalls: " + ", ".join(f"{name} {pct:.1f}%" for name, pct in shares(rows, columns, total)), "",
           "samples by execution count (instructions that run as often):"]
    by_count: dict[float, float] = defaultdict(float)
    for r in rows:
        by_count[number(r.get(EXECUTED, ""))] += number(r.get(SAMPLES, ""))
    for count, samples in sorted(by_count.items(), key=lambda x: -x[1])[:10]:
        out.append(f"  {count:>14.0f} executions: {100.0 * samples / total:5.1f}%")
    out += ["", f"regions (contiguous instructions of one execution count, above {region_pct}% of the samples):"]
    start = 0
    while start < len(rows):
        count = number(rows[start].get(EXECUTED, ""))
        end = start
        while end + 1 < len(rows) and number(rows[end + 1].get(EXECUTED, "")) == count:
            end += 1
        region = rows[start:end + 1]
        samples = sum(number(r.get(SAMPLES, "")) for r in region)
        if 100.0 * samples / total > region_pct:
            hgmma = sum(1 for r in region if "HGMMA" in r.get("Source", ""))
            reasons = ", ".join(f"{name} {pct:.1f}" for name, pct in shares(region, columns, total)[:4])
            out.append(f"  lines {start:>5}-{end:<5} at {region[0].get('Address', '?')}:"
                       f" {100.0 * samples / total:5.1f}%  x{count:.0f}  {len(region)} instructions, {hgmma} HGMMA"
                       f"  [{reasons}]")
        start = end + 1
    out += ["", f"top {top} instructions:"]
    for r in sorted(rows, key=lambda r: -number(r.get(SAMPLES, "")))[:top]:
        reasons = sorted(((c[len("stall_"):], number(r.get(c, ""))) for c in columns), key=lambda x: -x[1])[:2]
        out.append(f"  {r.get('Address', '?'):>18} {100.0 * number(r.get(SAMPLES, '')) / total:5.1f}%"
                   f" x{number(r.get(EXECUTED, '')):<10.0f} {r.get('Source', '')[:64]:64s}"
                   f" {', '.join(f'{n} {v:.0f}' for n, v in reasons if v > 0)}")
    return "\n".join(out)


def summarize_details(lines, kernel: str = "") -> str:
    rows = list(csv.DictReader(lines))
    launches: dict[str, dict] = {}
    for r in rows:
        if kernel in r.get("Kernel Name", ""):
            launch = launches.setdefault(r.get("ID", ""), {"name": r.get("Kernel Name", "")})
            launch[r.get("Metric Name", "")] = f"{r.get('Metric Value', '')} {r.get('Metric Unit', '')}".strip()
    out = []
    for launch_id, metrics in launches.items():
        out.append(f"## {launch_id}: {metrics['name'][:150]}")
        out += [f"  {m}: {metrics[m]}" for m in DETAIL_METRICS if m in metrics]
    return "\n".join(out)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("page", choices=["source", "details"])
    parser.add_argument("csv")
    parser.add_argument("--kernel", default="", help="only kernels whose name contains this")
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--regions", type=float, default=1.0, help="print regions above this percent of samples")
    args = parser.parse_args(argv)
    with open(args.csv, newline="") as f:
        lines = f.read().splitlines()
    if args.page == "details":
        print(summarize_details(lines, args.kernel))
        return 0
    seen = set()
    for block in source_blocks(lines):
        if args.kernel in block["name"] and block["name"] not in seen and block["rows"]:
            seen.add(block["name"])
            print(summarize_source(block, args.top, args.regions))
            print()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
