"""scripts/ncu_source.py (CPU): the summaries of Nsight Compute's source and details exports, and the argument
parsing of scripts/profile_target.py, on small hand-made exports."""

from __future__ import annotations

from helpers import load_script

ncu_source = load_script("ncu_source")
profile_target = load_script("profile_target")

HEADER = ('"Address","Source","Warp Stall Sampling (All Samples)","Instructions Executed",'
          '"stall_wait","stall_barrier","stall_long_sb","stall_wait (Not Issued)"')


def source_export() -> list[str]:
    """Two kernels: the first with a once-per-tile prologue (x10), a loop body (x40) and an epilogue (x10); the second
    exported twice, as ncu does for some kernels."""
    rows = [
        ('"0x10","HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4]","10","10","6","4","0","99"'),
        ('"0x20","WARPGROUP.DEPBAR.LE gsb0, 0x0","20","10","0","20","0","0"'),
        ('"0x30","FFMA R1, R2, R3, R4","30","40","30","0","0","0"'),
        ('"0x40","HGMMA.64x128x16.F32.BF16 R88, gdesc[UR8]","20","40","10","10","0","0"'),
        ('"0x50","STG.E [R2.64], R5","20","10","0","0","20","0"'),
    ]
    kernel = '"Kernel Name","void fwd_kernel<128>(Args)"'
    other = '"Kernel Name","void other_kernel(Args)"'
    other_row = '"0x10","EXIT","5","1","5","0","0","0"'
    return [kernel, HEADER, *rows, other, HEADER, other_row, other, HEADER, other_row]


def test_source_blocks_and_summary():
    blocks = ncu_source.source_blocks(source_export())
    assert [b["name"] for b in blocks] == ["void fwd_kernel<128>(Args)", "void other_kernel(Args)",
                                           "void other_kernel(Args)"]
    text = ncu_source.summarize_source(blocks[0], top=2, region_pct=1.0)
    lines = text.splitlines()
    assert lines[1] == "samples 100, instructions executed 110"
    # stall reasons over all samples (100): wait 46, barrier 34, long_sb 20; not-issued columns left out
    assert lines[2] == "stalls: wait 46.0%, barrier 34.0%, long_sb 20.0%"
    assert "              40 executions:  50.0%" in lines
    assert "              10 executions:  50.0%" in lines  # the prologue and the epilogue together
    regions = [line for line in lines if line.startswith("  lines")]
    assert len(regions) == 3  # prologue (x10), loop (x40), epilogue (x10)
    assert "30.0%  x10  2 instructions, 1 HGMMA" in regions[0]
    assert "50.0%  x40  2 instructions, 1 HGMMA" in regions[1]
    assert "20.0%  x10  1 instructions, 0 HGMMA  [long_sb 20.0]" in regions[2]
    top = lines[lines.index("top 2 instructions:") + 1:]
    assert len(top) == 2 and "FFMA" in top[0] and "30.0%" in top[0]


def test_source_main_prints_each_kernel_once(capsys):
    import os
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "source.csv")
        with open(path, "w") as f:
            f.write("\n".join(source_export()) + "\n")
        assert ncu_source.main(["source", path, "--kernel", "other"]) == 0
    printed = capsys.readouterr().out
    assert printed.count("## void other_kernel(Args)") == 1
    assert "fwd_kernel" not in printed


def test_details_summary():
    header = '"ID","Kernel Name","Section Name","Metric Name","Metric Unit","Metric Value"'
    rows = [header,
            '"0","fwd_kernel","SpeedOfLight","Duration","ms","3.80"',
            '"0","fwd_kernel","SpeedOfLight","Compute (SM) Throughput","%","49.15"',
            '"0","fwd_kernel","SpeedOfLight","Something Else","","1"',
            '"1","bwd_kernel","SpeedOfLight","Duration","ms","4.49"']
    text = ncu_source.summarize_details(rows, "fwd")
    assert text.splitlines() == ["## 0: fwd_kernel", "  Duration: 3.80 ms", "  Compute (SM) Throughput: 49.15 %"]


def test_profile_target_arguments():
    args = profile_target.parse_args(["attention", "64/4@65536", "--window", "511"])
    assert args.case == (64, 4, 65536) and args.window == 511 and args.causal and not args.forward
    args = profile_target.parse_args(["nsa", "32/8@8192", "--inputs", "drifting", "--forward"])
    assert args.op == "nsa" and args.inputs == "drifting" and args.forward
