#!/usr/bin/env bash
# On a GPU machine whose python3 already has torch, nanobind, scikit-build-core, cmake, ninja and pytest
# (no network needed): build the package with CUDA kernels, run the whole Python suite (GPU tests
# included) and the demo, and list the kernels in the built extension. Logs go to $OUT (or /tmp/sparseattn-gpu).
#
# The whole suite takes longer than one 10-minute device call on one H100/H200; split it with
#   SPARSEATTN_GPU_PART=1/2 bash scripts/gpu_check.sh     # then 2/2 in a second call
# which runs every other test file (sorted by name), part 1 with the demo, the last part with the kernel listing.
# Extra arguments go to pytest (e.g. -k flash).
source "$(dirname "${BASH_SOURCE[0]}")/gpu_build.sh"
python3 -c "import sparseattn, torch; print('sparseattn', sparseattn.__version__, 'cuda build:', \
sparseattn._C.built_with_cuda(), 'torch', torch.__version__, torch.cuda.get_device_name())"
status=0
part="${SPARSEATTN_GPU_PART:-1/1}"
index="${part%/*}" parts="${part#*/}"
mapfile -t files < <(ls tests/python/test_*.py | sort | awk -v i="$index" -v n="$parts" '(NR - 1) % n == i - 1')
echo "part $part: ${#files[@]} test files"
# The "big" tests need most of the GPU's memory, so they run one at a time after the parallel run.
# -v: one line per test as it finishes, so that a run cut short by the call's time limit still names its failures.
python3 -m pytest "${files[@]}" -v -n 8 -p no:cacheprovider -m "not big" --junitxml="$out/pytest.xml" "$@" \
  >"$out/pytest.log" 2>&1 || status=1
grep -E "^(FAILED|ERROR) |[0-9]+ (passed|failed)" "$out/pytest.log" | tail -40
grep -E "\] (FAILED|ERROR) " "$out/pytest.log" | head -40
python3 -m pytest "${files[@]}" -q -p no:cacheprovider -m big --junitxml="$out/pytest-big.xml" "$@" 2>&1 |
  tee "$out/pytest-big.log" | tail -10 || status=1
[[ ${PIPESTATUS[0]} -eq 0 || ${PIPESTATUS[0]} -eq 5 ]] || status=1  # 5: -k selected none of them
if [[ "$index" == 1 ]]; then
  python3 -m sparseattn.demo 2>&1 | tee "$out/demo.log" | tail -20
  [[ ${PIPESTATUS[0]} -eq 0 ]] || status=1
fi
if [[ "$index" == "$parts" ]]; then
  so="$(python3 -c 'import sparseattn._C as c; print(c.__file__)')"
  cuobjdump -lelf "$so" 2>/dev/null | head -5
  cuobjdump -sass "$so" 2>/dev/null | grep -E "Function :" | sed 's/.*Function : //' | c++filt | sort -u | head -20
fi
exit $status
