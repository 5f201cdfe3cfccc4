#!/usr/bin/env bash
# On a GPU machine: builds a base tree (BASE, a copy of another revision) and this working tree side by side, then
# compares them with scripts/ab_kernels.py: ROUNDS rounds of base then this tree, each a fresh process, and a report
# of every NSA kernel's time and whether the outputs and gradients agree bit for bit. Logs and JSON go to $OUT (or
# /tmp/sparseattn-gpu).
#
#   here:  rm -rf .stage/base && mkdir -p .stage/base && git archive main | tar -x -C .stage/base
#          (.stage/ in .git/info/exclude; name it in the device call's carry)
#   there: BASE=.stage/base bash scripts/gpu_ab.sh [CASE ...]        # e.g. 64/4@65536:random 32/32@65536:random
#
# ROUNDS (default 2) sets the rounds. The base is installed under /tmp/sparseattn-ab-base and imported through
# PYTHONPATH; this tree is installed into the interpreter's site-packages, as scripts/gpu_build.sh does, so the GPU
# tests can run on it afterwards in the same call.
base="${BASE:?set BASE to a copy of the base revision (e.g. .stage/base)}"
base_site=/tmp/sparseattn-ab-base
source "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh"
python3 -m pip install -q --no-build-isolation --no-deps --target "$base_site" "$base" >"$out/build-base.log" 2>&1 &
base_build=$!
python3 -m pip install -q --no-build-isolation --no-deps . >"$out/build.log" 2>&1 &
this_build=$!
wait "$base_build" || { tail -40 "$out/build-base.log"; exit 1; }
wait "$this_build" || { tail -40 "$out/build.log"; exit 1; }
echo "builds: $(( $(date +%s) - start )) s"
runs=()
for round in $(seq "${ROUNDS:-2}"); do
  PYTHONPATH="$base_site" python3 scripts/ab_kernels.py run A "$out/ab-A$round.json" "$@" || exit 1
  python3 scripts/ab_kernels.py run B "$out/ab-B$round.json" "$@" || exit 1
  runs+=("$out/ab-A$round.json" "$out/ab-B$round.json")
done
python3 scripts/ab_kernels.py report "${runs[@]}" | tee "$out/ab.txt"
echo "A/B done: $(( $(date +%s) - start )) s"
