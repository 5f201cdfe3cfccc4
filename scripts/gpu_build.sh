# Sourced by the scripts/gpu_*.sh on a GPU machine: goes to the repository root, sets $out (OUT, or
# /tmp/sparseattn-gpu) and the build environment, prints the GPU and builds the package with CUDA kernels (the log
# in $out/build.log; on failure its tail, then exit). $start is when it began.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out="${OUT:-/tmp/sparseattn-gpu}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1 SPARSEATTN_ARCHS="${SPARSEATTN_ARCHS:-90a}" CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)"
# The GPU image's default /opt/gcc g++ builds an extension whose array arguments crash (its libstdc++ is
# not the one torch loads); the system g++ works, for host code and as nvcc's host compiler alike.
if [[ -x /usr/bin/g++ ]]; then export CXX=/usr/bin/g++ CUDAHOSTCXX=/usr/bin/g++; fi
start=$(date +%s)
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"
python3 -m pip install -q --no-build-isolation --no-deps . >"$out/build.log" 2>&1 || {
  tail -60 "$out/build.log"; exit 1; }
echo "build: $(( $(date +%s) - start )) s"
