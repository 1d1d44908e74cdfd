#!/usr/bin/env bash
# OUT=DIR bash benchmarks/results/2026-12-04-h200-paired-drafts/compare_plans.sh, from the root of a git checkout
# 4-draft steps: the plan that pairs their programs (this tree) against the plan before it
# (/tmp/old: the tree with store_attend.py of 5421419, or the file OLD_STORE_ATTEND names),
# alternating, benchmarks/step_paths.py; then the plan's stage rule at 2 stages on full layers
set -u
export PYTHONUNBUFFERED=1 ATTNPLUG_CACHE_DIR=/tmp/attnplug-cache
out=${OUT:-paired-drafts-out}; mkdir -p "$out"
rm -rf /tmp/old && mkdir -p /tmp/old && cp -r core plugins benchmarks /tmp/old/
old=/tmp/old/plugins/cuda/attnplug_cuda/kernels/store_attend.py
if [ -n "${OLD_STORE_ATTEND:-}" ]; then cp "$OLD_STORE_ATTEND" "$old"
else git show 5421419:plugins/cuda/attnplug_cuda/kernels/store_attend.py >"$old"; fi
sum=()
run() { local n=$1 l=$2; shift 2; local t=$SECONDS; timeout "$l" "$@" >"$out/$n.log" 2>&1; sum+=("$n rc=$? $((SECONDS-t))s"); }
run draft_new_1 120 python3 benchmarks/step_paths.py --mode draft --bs 1 2 4 5 6 8 12 16 24 --path 'plan one'
run draft_old_1 120 python3 /tmp/old/benchmarks/step_paths.py --mode draft --bs 1 2 4 5 6 8 12 16 24 --path 'plan one'
run draft_new_2 90 python3 benchmarks/step_paths.py --mode draft --bs 6 8 12 16 --path 'plan one'
run draft_old_2 90 python3 /tmp/old/benchmarks/step_paths.py --mode draft --bs 6 8 12 16 --path 'plan one'
run ctx4096_new 60 python3 benchmarks/step_paths.py --mode draft --bs 1 8 --context 4096 --path 'plan one'
run ctx4096_old 60 python3 /tmp/old/benchmarks/step_paths.py --mode draft --bs 1 8 --context 4096 --path 'plan one'
run stages_draft 90 python3 benchmarks/step_paths.py --mode draft --bs 5 8 12 16 --path 'plan one' --path 'full2stages one full.num_stages=2'
run stages_decode 90 python3 benchmarks/step_paths.py --bs 8 12 16 --path 'plan one' --path 'full2stages one full.num_stages=2'
for f in "$out"/draft_*.log "$out"/ctx4096_*.log "$out"/stages_*.log; do echo "== $(basename $f)"; grep -E "^(decode|draft) bs=" "$f" | sed -E 's/ \(plan\)//'; done
printf '%s\n' "${sum[@]}"
