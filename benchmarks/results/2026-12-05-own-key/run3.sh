#!/usr/bin/env bash
# OUT=DIR bash benchmarks/results/2026-12-05-own-key/run3.sh, from the root of a checkout: the final
# plan rule's kernels under compute-sanitizer memcheck (benchmarks/sanitize_kernels.py: its
# one-launch decode runs the own key as a vector), then their GPU tests.
set -u
export PYTHONUNBUFFERED=1 ATTNPLUG_CACHE_DIR=/tmp/attnplug-cache
out=${OUT:-own-key-out}; mkdir -p "$out"
python3 -m pip install -q --no-build-isolation --no-deps -e . >"$out/install.log" 2>&1 || { tail "$out/install.log"; exit 1; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader >"$out/env3.log" 2>&1
sum=()
run() { local n=$1 l=$2; shift 2; local t=$SECONDS; timeout "$l" "$@" >"$out/$n.log" 2>&1; sum+=("$n rc=$? $((SECONDS-t))s"); }
run memcheck 60 compute-sanitizer --tool memcheck --error-exitcode 9 python3 benchmarks/sanitize_kernels.py
run gpu_tests 60 python3 -m pytest -q -p no:cacheprovider tests/cuda/test_cuda_kernels_store_attend.py \
  tests/cuda/test_cuda_one_launch_steps.py
cat "$out/env3.log"
grep -E "ERROR SUMMARY|kernels ran" "$out/memcheck.log"
tail -2 "$out/gpu_tests.log"
printf '%s\n' "${sum[@]}"
rm -f "$out/install.log"
