#!/usr/bin/env bash
# OUT=DIR bash benchmarks/results/2026-12-04-h200-paired/compare_plans.sh, from the root of a git checkout
# the paired plan (this tree) against the plan before it (/tmp/old), alternating, step_paths.py
set -u
export PYTHONUNBUFFERED=1 ATTNPLUG_CACHE_DIR=/tmp/attnplug-cache
out=${OUT:-paired-out}; mkdir -p "$out"
python3 -m pip install -q --no-build-isolation --no-deps -e . >"$out/install.log" 2>&1
rm -rf /tmp/old && mkdir -p /tmp/old && cp -r core plugins benchmarks /tmp/old/
# the plan before pairing
git show 287be8a:plugins/cuda/attnplug_cuda/kernels/store_attend.py >/tmp/old/plugins/cuda/attnplug_cuda/kernels/store_attend.py
(cd /tmp/old && python3 -c "import sys; sys.path[:0]=['/tmp/old/plugins/cuda','/tmp/old/core']; import attnplug_cuda.kernels.store_attend as s; print('old tree:', s.__file__, 'paired' if hasattr(s,'PAIRED_PROGRAMS_PER_SM') else 'no paired rule')") >"$out/trees.log" 2>&1
python3 -c "import attnplug_cuda.kernels.store_attend as s; print('new tree:', s.__file__, 'paired' if hasattr(s,'PAIRED_PROGRAMS_PER_SM') else 'no paired rule')" >>"$out/trees.log" 2>&1
sum=()
run() { local n=$1 l=$2; shift 2; local t=$SECONDS; timeout "$l" "$@" >"$out/$n.log" 2>&1; sum+=("$n rc=$? $((SECONDS-t))s"); }
BS="1 2 4 5 6 7 8 12 16 24"
for r in 1 2; do
  run decode_new_$r 120 python3 benchmarks/step_paths.py --bs $BS --path 'plan one'
  run decode_old_$r 120 python3 /tmp/old/benchmarks/step_paths.py --bs $BS --path 'plan one'
done
run ctx4096_new 60 python3 benchmarks/step_paths.py --bs 1 8 --context 4096 --path 'plan one'
run ctx4096_old 60 python3 /tmp/old/benchmarks/step_paths.py --bs 1 8 --context 4096 --path 'plan one'
run draft_new 60 python3 benchmarks/step_paths.py --mode draft --bs 1 4 8 --path 'plan one'
run draft_old 60 python3 /tmp/old/benchmarks/step_paths.py --mode draft --bs 1 4 8 --path 'plan one'
cat "$out/trees.log"
for f in "$out"/decode_*.log "$out"/ctx4096_*.log "$out"/draft_*.log; do echo "== $(basename $f)"; grep -E "^(decode|draft) bs=" "$f" | sed -E 's/ \(plan\)//'; done
printf '%s\n' "${sum[@]}"
