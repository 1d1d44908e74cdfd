#!/usr/bin/env bash
# The run of 2026-12-06 (one H100), from the root of a checkout at commit c8b7e69, where
# benchmarks/layer_skeleton.py was named benchmarks/chain_floor.py (its default variants then:
# the first 13 of today's; no early=1 option): compute-sanitizer memcheck and racecheck of
# benchmarks/sanitize_kernels.py (both cut by their 40 s limit before any kernel ran), then the
# skeleton at bs 1 and 8 (chain_floor.log, chain_floor.json). Logs were packed into
# $OUT/logs.tgz; a summary printed last.
set -u
export PYTHONUNBUFFERED=1 ATTNPLUG_CACHE_DIR=/tmp/attnplug-cache
out=${OUT:-floor-out}; mkdir -p "$out/logs"
L=$out/logs
python3 -m pip install -q --no-build-isolation --no-deps -e . >"$L/install.log" 2>&1 || { tail "$L/install.log"; exit 1; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv >"$L/env.log" 2>&1
python3 -c "import torch, triton, sys; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, 'python', sys.version.split()[0]); print('sms', torch.cuda.get_device_properties(0).multi_processor_count)" >>"$L/env.log" 2>&1
sum=()
run() { local n=$1 l=$2; shift 2; local t=$SECONDS; timeout "$l" "$@" >"$L/$n.log" 2>&1; sum+=("$n rc=$? $((SECONDS-t))s"); }
run memcheck 40 compute-sanitizer --tool memcheck --error-exitcode 9 python3 benchmarks/sanitize_kernels.py
run racecheck 40 compute-sanitizer --tool racecheck --error-exitcode 9 python3 benchmarks/sanitize_kernels.py
run chain_floor 60 python3 benchmarks/chain_floor.py --bs 1 8 --json "$L/chain_floor.json" --mix 'swa_s8 full_s16'
tar czf "$out/logs.tgz" -C "$out" logs && rm -rf "$L"
tar xzf "$out/logs.tgz" -C /tmp
cat /tmp/logs/env.log
grep -hE "ERROR SUMMARY|RACECHECK SUMMARY|kernels ran" /tmp/logs/memcheck.log /tmp/logs/racecheck.log
grep -E "^bs=|^NVIDIA|^H" /tmp/logs/chain_floor.log
printf '%s\n' "${sum[@]}"
