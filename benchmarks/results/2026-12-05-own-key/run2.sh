#!/usr/bin/env bash
# OUT=DIR bash benchmarks/results/2026-12-05-own-key/run2.sh, from the root of a checkout
# (FlashInfer's wheels in .whl/ for the peer rows): the final plan rule (own key as a vector on
# decode steps of up to one group an SM, release at entry from two requests) through the GPU
# tests and compute-sanitizer memcheck, then the whole hybrid_step benchmark (attnplug bench
# --only hybrid_step, FlashInfer as the peer).
set -u
export PYTHONUNBUFFERED=1 ATTNPLUG_CACHE_DIR=/tmp/attnplug-cache
out=${OUT:-own-key-out}; mkdir -p "$out"
python3 -m pip install -q --no-build-isolation --no-deps -e . >"$out/install.log" 2>&1 || { tail "$out/install.log"; exit 1; }
sum=()
run() { local n=$1 l=$2; shift 2; local t=$SECONDS; timeout "$l" "$@" >"$out/$n.log" 2>&1; sum+=("$n rc=$? $((SECONDS-t))s"); }
run gpu_tests 60 python3 -m pytest -q -p no:cacheprovider tests/cuda/test_cuda_kernels_store_attend.py \
  tests/cuda/test_cuda_one_launch_steps.py
run memcheck 60 compute-sanitizer --tool memcheck --error-exitcode 9 python3 benchmarks/sanitize_kernels.py
# FlashInfer as benchmarks/h200.sh bench installs it; the hybrid_step benchmark with a budget that fits
python3 -m pip install -q --no-deps --target /tmp/fi .whl/flashinfer_python-*.whl .whl/apache_tvm_ffi-*.whl \
  >"$out/flashinfer.log" 2>&1
export PYTHONPATH=/tmp/fi
run bench 240 attnplug bench --backend cuda --only hybrid_step --out "$out/bench" --budget-s 220
tail -2 "$out/gpu_tests.log"
grep -E "ERROR SUMMARY" "$out/memcheck.log"
python3 -m attnplug.bench.report "$out/bench/bench.json" --only hybrid_step
tail -1 "$out/bench.log"
printf '%s\n' "${sum[@]}"
(cd "$out" && rm -f bench/*.png && tar czf logs.tgz --exclude=logs.tgz . && find . -mindepth 1 ! -name logs.tgz -delete)
