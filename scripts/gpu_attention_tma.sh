#!/usr/bin/env bash
# On a GPU machine (as scripts/gpu_check.sh): build the package with CUDA kernels once, run the GPU tests of the
# attention forward's, dQ's and dK/dV's TMA producers (tests/python/test_cuda_attention_tma.py: against float64 and
# bit for bit against the cp.async producers), then time both producers (scripts/measure_attention_tma.py: NSA
# compressed and sliding window at 64/4, D = 128, T = 64K and 8K; flash_attention dense causal at 16K; with
# --backward the dQ and dK/dV kernels too), within about seven minutes on one H100. Logs go to $OUT (or /tmp/sparseattn-gpu). Extra arguments go to the
# timing script:
#   bash scripts/gpu_attention_tma.sh --backward
source "$(dirname "${BASH_SOURCE[0]}")/gpu_build.sh"
status=0
timeout "${SPARSEATTN_TMA_TEST_SECONDS:-240}" python3 -m pytest tests/python/test_cuda_attention_tma.py -v -n 8 \
  -p no:cacheprovider >"$out/pytest-attention-tma.log" 2>&1 || status=1
grep -E "^(FAILED|ERROR) |[0-9]+ (passed|failed|skipped)" "$out/pytest-attention-tma.log" | tail -30
grep -E "\] (FAILED|ERROR) " "$out/pytest-attention-tma.log" | head -30
grep -cE "\] PASSED " "$out/pytest-attention-tma.log" | sed 's/^/tests passed so far: /'
grep -E "\] SKIPPED " "$out/pytest-attention-tma.log" | head -5
echo "tests done: $(( $(date +%s) - start )) s"
timeout "${SPARSEATTN_TMA_TIMING_SECONDS:-200}" python3 scripts/measure_attention_tma.py "$@" 2>&1 |
  tee "$out/timing-attention-tma.log" || status=1
echo "total: $(( $(date +%s) - start )) s"
exit $status
