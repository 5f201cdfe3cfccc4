# Sourced by the scripts/gpu_*.sh on a GPU machine: the environment of gpu_env.sh ($out, $start, the compilers),
# then builds the package with CUDA kernels (the log in $out/build.log; on failure its tail, then exit).
source "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh"
python3 -m pip install -q --no-build-isolation --no-deps . >"$out/build.log" 2>&1 || {
  tail -60 "$out/build.log"; exit 1; }
echo "build: $(( $(date +%s) - start )) s"
