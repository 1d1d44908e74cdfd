#!/usr/bin/env bash
# OUT=DIR bash benchmarks/results/2026-12-05-own-key/run.sh, from the root of a checkout with
# .cmp/store_attend_before.py and .cmp/relaunch_before.py (those files at commit 2381687):
# GPU tests of the one-launch kernel and the replay launch; decode steps through this tree's
# store_attend (the own key folded as a vector) against the one before, alternating
# (benchmarks/step_paths.py, plan and own_block / release_entry overrides); replay preparation
# with the step-metadata launch's arguments as addresses against tensors.
set -u
export PYTHONUNBUFFERED=1 ATTNPLUG_CACHE_DIR=/tmp/attnplug-cache
out=${OUT:-own-key-out}; mkdir -p "$out"
here=benchmarks/results/2026-12-05-own-key
python3 -m pip install -q --no-build-isolation --no-deps -e . >"$out/install.log" 2>&1 || { tail "$out/install.log"; exit 1; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv >"$out/env.log" 2>&1
python3 -c "import torch, triton, sys; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, 'python', sys.version.split()[0])" >>"$out/env.log" 2>&1
rm -rf /tmp/old && mkdir -p /tmp/old && cp -r core plugins benchmarks /tmp/old/
cp .cmp/store_attend_before.py /tmp/old/plugins/cuda/attnplug_cuda/kernels/store_attend.py
sum=()
run() { local n=$1 l=$2; shift 2; local t=$SECONDS; timeout "$l" "$@" >"$out/$n.log" 2>&1; sum+=("$n rc=$? $((SECONDS-t))s"); }
run gpu_tests 170 python3 -m pytest -q -p no:cacheprovider tests/cuda/test_cuda_kernels_store_attend.py \
  tests/cuda/test_cuda_one_launch_steps.py tests/cuda/test_cuda_replay_copy.py tests/cuda/test_cuda_kernels_step_metadata.py
P=(--path 'plan one' --path 'own one own_block=1' --path 'ownentry one own_block=1 release_entry=1')
run paths_new_1 130 python3 benchmarks/step_paths.py --bs 1 2 4 5 8 12 16 "${P[@]}"
run paths_old_1 130 python3 /tmp/old/benchmarks/step_paths.py --bs 1 2 4 5 8 12 16 "${P[@]}"
run prep 70 python3 "$here/prep_ab.py" .cmp/relaunch_before.py
run paths_new_2 60 python3 benchmarks/step_paths.py --bs 1 8 "${P[@]}"
run paths_old_2 60 python3 /tmp/old/benchmarks/step_paths.py --bs 1 8 "${P[@]}"
run paths_warps 60 python3 benchmarks/step_paths.py --bs 1 --path 'plan one' --path 'own one own_block=1' \
  --path 'own2w one own_block=1 num_warps=2' --path 'own2wswa one own_block=1 swa.num_warps=2'
cat "$out/env.log"
tail -2 "$out/gpu_tests.log"
for f in "$out"/paths_*.log; do echo "== $(basename "$f")"; grep -E "^decode +[0-9]+ " "$f"; done
grep -E "^PREP|equal|arguments" "$out/prep.log"
printf '%s\n' "${sum[@]}"
