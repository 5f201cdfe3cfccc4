# Sourced by the scripts/gpu_*.sh on a GPU machine (through gpu_build.sh, or directly by gpu_ab.sh, which builds
# two trees): goes to the repository root, sets $out (OUT, or /tmp/sparseattn-gpu), the build environment and
# $start (when it began), and prints the GPU (also to $out/gpu.txt).
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
