#!/usr/bin/env bash
# On a GPU machine: builds the package, records one Nsight Compute report (`--set full`, warp-state sampling per SASS
# line) of the calls that scripts/profile_target.py makes, and summarises it with scripts/ncu_source.py: the
# headline metrics of every kernel and, for the kernels whose name contains KERNEL (default: all), where their stall
# samples sit (stall reasons, instructions grouped by execution count, regions, top lines).
#
#   there: TARGET="attention 64/4@65536 --window 511" KERNEL=attention_ bash scripts/gpu_profile.sh
#          TARGET="nsa 64/4@65536 --inputs drifting" KERNEL=selected_ bash scripts/gpu_profile.sh
#
# Writes details.txt and source.txt (the summaries) and profile.tar.gz (both CSV exports) to $OUT (or
# /tmp/sparseattn-gpu); the report itself (too large to bring back) stays on the machine. LIMIT_S (default 300)
# bounds the profiled run.
source "$(dirname "${BASH_SOURCE[0]}")/gpu_build.sh"
ncu="$(command -v ncu || echo /usr/local/cuda/bin/ncu)"
usage="set TARGET to the arguments of scripts/profile_target.py, e.g. attention 64/4@65536 --window 511"
read -r -a target <<<"${TARGET:?$usage}"
timeout "${LIMIT_S:-300}" "$ncu" --profile-from-start off --set full --import-source no -f -o "$out/profile" \
  python3 scripts/profile_target.py "${target[@]}" >"$out/ncu.log" 2>&1 || { tail -20 "$out/ncu.log"; exit 1; }
"$ncu" -i "$out/profile.ncu-rep" --page details --csv >"$out/details.csv"
"$ncu" -i "$out/profile.ncu-rep" --page source --csv --print-source sass >"$out/source.csv"
python3 scripts/ncu_source.py details "$out/details.csv" --kernel "${KERNEL:-}" | tee "$out/details.txt"
python3 scripts/ncu_source.py source "$out/source.csv" --kernel "${KERNEL:-}" >"$out/source.txt"
head -40 "$out/source.txt"
tar -czf "$out/profile.tar.gz" -C "$out" details.csv source.csv && rm -f "$out/details.csv" "$out/source.csv"
echo "profile: $(( $(date +%s) - start )) s"
