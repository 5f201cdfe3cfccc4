"""scripts/sass_audit.py's parser (CPU): tensor-core instructions, R2UR moves and HGMMAs right after one, per
architecture and function of cuobjdump -sass text."""

from __future__ import annotations

from helpers import load_script

sass_audit = load_script("sass_audit")

SASS = """
	code for sm_90a
		Function : _Z6kernelv
        /*0000*/                   R2UR UR12, R6 ;                    /* 0x00000000060c72ca */
        /*0010*/                   MOV R1, c[0x0][0x28] ;             /* 0x00000a0000017a02 */
        /*0020*/                   HGMMA.64x64x16.F32.BF16 R24, gdesc[UR12], RZ, !UPT ; /* 0x00e0000 */
        /*0030*/                   IADD3 R2, R2, 0x1, RZ ;            /* 0x0000000102027810 */
        /*0040*/                   IADD3 R2, R2, 0x1, RZ ;            /* 0x0000000102027810 */
        /*0050*/                   IADD3 R2, R2, 0x1, RZ ;            /* 0x0000000102027810 */
        /*0060*/              @!P0 HGMMA.64x64x16.F32.BF16 R24, gdesc[UR8], R24 ; /* 0x00e0000 */
		Function : _Z5otherv
        /*0000*/                   HMMA.16816.F32.BF16 R4, R8, R12, R4 ; /* 0x000000 */
        /*0010*/               @P1 R2UR UR4, R3 ;                     /* 0x000000 */
	code for sm_80
		Function : _Z5otherv
        /*0000*/                   HMMA.16816.F32.BF16 R4, R8, R12, R4 ; /* 0x000000 */
"""


def test_counts_per_arch_and_function():
    kernels = sass_audit.audit(SASS)
    assert list(kernels) == [("sm_90a", "_Z6kernelv"), ("sm_90a", "_Z5otherv"), ("sm_80", "_Z5otherv")]
    first = kernels[("sm_90a", "_Z6kernelv")]
    assert (first.hgmma, first.hgmma_after_r2ur, first.r2ur, first.hmma) == (2, 1, 1, 0)
    other = kernels[("sm_90a", "_Z5otherv")]
    assert (other.hgmma, other.r2ur, other.hmma) == (0, 1, 1)  # a predicated R2UR counts too
    assert kernels[("sm_80", "_Z5otherv")].hmma == 1


def test_opcode_strips_predicates():
    assert sass_audit.opcode("@!UP0 HGMMA.64x64x16.F32.BF16 R24, gdesc[UR8], R24") == "HGMMA.64x64x16.F32.BF16"
    assert sass_audit.opcode("  R2UR UR12, R6") == "R2UR"
