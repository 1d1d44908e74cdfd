#!/usr/bin/env bash
# The GPU proof run (an H100 or H200, sm_90), in stages that each take under 10 minutes:
#   bash benchmarks/h200.sh check   # install, conformance on cuda (360 s and more on a cold machine)
#   bash benchmarks/h200.sh sanitize  # compute-sanitizer memcheck and racecheck over every kernel
#   bash benchmarks/h200.sh pdl     # the PDL proof: twin worlds bit-identical, programmatic graph edges
#   bash benchmarks/h200.sh bench   # benchmarks (attnplug bench --backend cuda): table, JSON, PNG plots,
#                                   # the figures appended to $OUT/history.jsonl; FlashInfer from .whl/
#                                   # when its wheels are there; hybrid_step's draft steps (its decode steps:
#                                   # the fp8 stage; HYBRID_MODES=decode,draft_extend for both); hybrid_step table last
#   bash benchmarks/h200.sh trust   # GPU tests, conformance on cuda, the engine-loop example
#   bash benchmarks/h200.sh soak    # 20,000-step soak of the cuda backend (graphs, PDL)
#   bash benchmarks/h200.sh models  # transformers models through Engine on cuda, generate
#   bash benchmarks/h200.sh validate  # the trust catalogue on the GPU, a soak with ATTNPLUG_VALIDATE=1,
#                                     # what validation costs a step (bench --only batch_validation)
#   bash benchmarks/h200.sh worlds  # the sampled worlds and the 2**31-element layer buffer on cuda,
#                                   # the kernels' world tests, then the whole conformance suite
#   bash benchmarks/h200.sh fp8     # hybrid_step DECODE steps (bs 1-128) with a bf16 and an FP8 KV cache in one
#                                   # run, FlashInfer's decode on both caches in its best configuration (page size,
#                                   # layout, tensor cores, graph mode searched); FP8 table last
#   bash benchmarks/h200.sh prefill # paged causal prefill (D 128/256, 1k-16k tokens and 8 x 1k, page 1/16): the
#                                   # cuda EXTEND path vs FlashInfer's batch prefill, TFLOP/s; table last
#   bash benchmarks/h200.sh engine-prefill  # model_decode's prefill rows alone: the 1B-class Gemma3 through
#                                   # Engine.generate(prompts, 1), compiled and eager, vs transformers' sdpa forward
# BENCH_ONLY="hybrid_step model_decode" limits the bench stage to those benchmarks; HYBRID_MODES the modes of its
# hybrid_step (default draft_extend).
# Logs and JSON go to $OUT (or ./h200-out); a short summary prints last.
set -u
stage="${1:-check}"
out="${OUT:-h200-out}"; mkdir -p "$out"
export PYTHONUNBUFFERED=1 COLUMNS=150 ATTNPLUG_CACHE_DIR="${ATTNPLUG_CACHE_DIR:-/tmp/attnplug-cache}"
python3 -m pip install -q --no-build-isolation --no-deps -e . >"$out/install.log" 2>&1 || { tail "$out/install.log"; exit 1; }
summary=()
install_flashinfer() {  # FlashInfer, the peer, from wheels carried in .whl/ (never a dependency):
  # flashinfer_python 0.5.0 + apache_tvm_ffi 0.1.x (+ ninja when the machine has none, for its JIT)
  local fi_dir="${FLASHINFER_TARGET:-/tmp/attnplug-flashinfer}"
  if ls .whl/flashinfer_python-*.whl .whl/apache_tvm_ffi-*.whl >/dev/null 2>&1; then
    local wheels=(.whl/flashinfer_python-*.whl .whl/apache_tvm_ffi-*.whl)
    command -v ninja >/dev/null 2>&1 || wheels+=(.whl/ninja-*.whl)
    python3 -m pip install -q --no-deps --target "$fi_dir" "${wheels[@]}" >"$out/flashinfer.log" 2>&1
    export PYTHONPATH="$fi_dir${PYTHONPATH:+:$PYTHONPATH}" PATH="$fi_dir/bin:$PATH"
  else
    echo "no FlashInfer wheels in .whl/: the flashinfer peer rows will say not installed" >"$out/flashinfer.log"
  fi
  python3 -c "import flashinfer; print('flashinfer', flashinfer.__version__, 'importable')" >>"$out/flashinfer.log" 2>&1
}
gpu_env() {
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader >"$out/env.log" 2>&1
  python3 -c "import torch, triton, sys; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, 'python', sys.version.split()[0])" >>"$out/env.log" 2>&1
}
run() {  # run NAME TIMEOUT CMD...: log to $out/NAME.log, remember the exit status
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  timeout "$limit" "$@" >"$out/$name.log" 2>&1
  local rc=$?
  summary+=("$(printf '%-12s rc=%-3s %4ss' "$name" "$rc" "$((SECONDS - t0))")")
}
if [ "$stage" = check ]; then
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv >"$out/env.log" 2>&1
  python3 -c "import torch, triton, sys; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, 'python', sys.version.split()[0])" >>"$out/env.log" 2>&1
  python3 -m attnplug.cli info >>"$out/env.log" 2>&1
  run conformance 540 python3 -m attnplug.cli conformance --backend cuda --report "$out/conformance.json"
  cat "$out/env.log"
  grep -E "^│|passed|failed|PASSED|FAILED|error" "$out/conformance.log" | tail -25
elif [ "$stage" = sanitize ]; then
  gpu_env
  run sanitize_warm 300 python3 benchmarks/sanitize_kernels.py  # compiles its kernels outside the sanitizer
  run memcheck 90 compute-sanitizer --tool memcheck --error-exitcode 9 python3 benchmarks/sanitize_kernels.py
  run racecheck 150 compute-sanitizer --tool racecheck --error-exitcode 9 python3 benchmarks/sanitize_kernels.py
  cat "$out/env.log"
  grep -E "ERROR SUMMARY|RACECHECK SUMMARY|kernels ran|Error" "$out/memcheck.log" "$out/racecheck.log" | tail -6
elif [ "$stage" = pdl ]; then
  gpu_env
  run pdl_proof 300 python3 benchmarks/pdl_proof.py --steps 1000 --json "$out/pdl_proof.json"
  cat "$out/env.log"
  tail -4 "$out/pdl_proof.log"
elif [ "$stage" = trust ]; then
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader >"$out/env.log" 2>&1
  python3 -c "import torch, triton, sys; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, 'python', sys.version.split()[0])" >>"$out/env.log" 2>&1
  run gpu_tests 150 python3 -m pytest -q -x -p no:cacheprovider tests/cuda/test_cuda_kernels_kv_store.py \
    tests/cuda/test_cuda_kernels_paged_attention.py tests/cuda/test_cuda_kernels_paged_store.py \
    tests/cuda/test_cuda_kernels_store_attend.py tests/cuda/test_cuda_kernels_step_metadata.py \
    tests/cuda/test_cuda_replay_copy.py tests/cuda/test_cuda_softcap_sinks_interpreted.py \
    tests/cuda/test_cuda_csrc_build.py tests/cuda/test_cuda_one_launch_steps.py \
    tests/cuda/test_allocator_never_waits.py tests/core/test_memory_slot_rules.py tests/core/test_bad_input_batches.py \
    tests/cuda/test_cuda_ops.py tests/ops
  run conformance 280 python3 -m attnplug.cli conformance --backend cuda --report "$out/conformance.json"
  run sanitize_warm 150 python3 benchmarks/sanitize_kernels.py  # compiles its kernels outside the sanitizer
  run memcheck 70 compute-sanitizer --tool memcheck --error-exitcode 9 python3 benchmarks/sanitize_kernels.py
  run engine_loop 60 python3 examples/engine_loop.py --backend cuda --device cuda
  cat "$out/env.log"
  tail -3 "$out/gpu_tests.log"
  grep -E "passed|failed|PASSED|FAILED|error" "$out/conformance.log" | tail -6
  grep -E "ERROR SUMMARY|kernels ran|Error" "$out/memcheck.log" | tail -3
  tail -2 "$out/engine_loop.log"
elif [ "$stage" = models ]; then
  run gpu_check 150 python3 tests/integrations/gpu_check.py --backend cuda
  run generate 60 python3 -m attnplug.cli generate --tiny gemma3_text --backend cuda --dtype bfloat16 --tokens 5,6,7,8,9,10,11,12 \
    --max-new-tokens 16 --graphs
  tail -16 "$out/gpu_check.log"
  tail -3 "$out/generate.log"
elif [ "$stage" = validate ]; then
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader >"$out/env.log" 2>&1
  python3 -c "import torch, triton, sys; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, 'python', sys.version.split()[0])" >>"$out/env.log" 2>&1
  run catalogue 240 python3 -m pytest -q -p no:cacheprovider -n 4 tests/catalogue tests/core/test_bad_input_batches.py \
    tests/core/test_graph_runner.py tests/cuda/test_cuda_kernels_store_attend.py \
    tests/cuda/test_cuda_kernels_step_metadata.py tests/cuda/test_cuda_ops.py tests/ops
  run soak_validate 150 env ATTNPLUG_VALIDATE=1 python3 -m attnplug.cli soak --backend cuda --steps "${SOAK_STEPS:-1500}" --seed 1 \
    --progress 60 --json "$out/soak_validate.json"
  run validation_cost 150 python3 -m attnplug.cli bench --backend cuda --only batch_validation --out "$out/validation"
  cat "$out/env.log"
  tail -3 "$out/catalogue.log"
  tail -2 "$out/soak_validate.log"
  grep -E "batch_validation: bs=" "$out/validation_cost.log"
elif [ "$stage" = worlds ]; then
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader >"$out/env.log" 2>&1
  python3 -c "import torch, triton, hypothesis, sys; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, 'hypothesis', hypothesis.__version__, 'python', sys.version.split()[0])" >>"$out/env.log" 2>&1
  # the whole suite (the sampled worlds and the 2**31-element buffer included), then that buffer
  # with the C++ KV store, then the kernels' world tests
  run conformance 280 python3 -m attnplug.cli conformance --backend cuda --report "$out/conformance.json"
  run large_cpp 90 env ATTNPLUG_KV_STORE=cpp python3 -m attnplug.cli conformance --backend cuda -k check_large_kv_buffers
  run world_tests 170 python3 -m pytest -q -p no:cacheprovider -n 4 tests/cuda/test_cuda_worlds_interpreted.py \
    tests/conformance/test_sampled_worlds.py
  cat "$out/env.log"
  grep -E "passed|failed|PASSED|FAILED|error" "$out/conformance.log" | tail -4
  python3 -c "import json,sys,collections; d=json.load(open(sys.argv[1])); t=collections.Counter(); [t.update({x['check']: x['duration']}) for b in d['backends'] for x in b['tests']]; print('\n'.join(f'{k:38s} {v:7.1f} s' for k,v in t.most_common())); print('total', round(d['duration'],1), 's')" "$out/conformance.json"
  grep -E "check_sampled|check_large" "$out/conformance.log" | tail -3
  grep -E "passed|failed|PASSED|FAILED|error" "$out/large_cpp.log" | tail -3
  tail -3 "$out/world_tests.log"
elif [ "$stage" = fp8 ]; then
  # ~480 s of the call: Triton compiles for both caches, FlashInfer's 8 decode modules (bf16 and FP8, tensor cores
  # on/off, window or not) compiled at once, 16 configurations searched a batch size, DECODE steps only
  gpu_env
  install_flashinfer
  run fp8 490 python3 -m attnplug.cli bench --backend cuda --only hybrid_step --set hybrid_modes=decode --set flex_budget_s=0 \
    --out "$out/fp8" --budget-s 470 --history "$out/history.jsonl"
  cat "$out/env.log"
  tail -2 "$out/flashinfer.log"
  grep -E "configurations:|compiled or loaded|cannot run|FAILED" "$out/fp8.log" | cut -c1-400
  # last: the table (new vs new-fp8 and their floors, the FP8 ratio, FlashInfer's best configurations and checks)
  python3 -m attnplug.bench.report "$out/fp8/bench.json" --only hybrid_step
  tail -1 "$out/fp8.log"
elif [ "$stage" = prefill ]; then
  # ~400 s of the call: FlashInfer's fa3 / fa2 prefill modules for D 128 and 256 compiled at once, 24 cases
  gpu_env
  install_flashinfer
  run prefill 490 python3 -m attnplug.cli bench --backend cuda --only prefill --out "$out/prefill" --budget-s 470 \
    --history "$out/history.jsonl"
  cat "$out/env.log"
  tail -2 "$out/flashinfer.log"
  grep -E "compiled or loaded|FAILED" "$out/prefill.log" | cut -c1-400
  python3 -m attnplug.bench.report "$out/prefill/bench.json" --only prefill
  grep -m1 "published anchors" "$out/prefill.log" | sed 's/^\[ *[0-9.]*s\] *//'
  tail -1 "$out/prefill.log"
elif [ "$stage" = engine-prefill ]; then
  # ~200 s of the call: the model built once, the compiled Engine's first call compiles its EXTEND steps
  gpu_env
  run engine_prefill 400 python3 -m attnplug.cli bench --backend cuda --only model_decode --set model_decode_series=prefill \
    --out "$out/engine_prefill" --budget-s 380 --history "$out/history.jsonl"
  cat "$out/env.log"
  grep -E "model_decode: prefill|FAILED|Error" "$out/engine_prefill.log" | cut -c1-300
  python3 -m attnplug.bench.report "$out/engine_prefill/bench.json" --only model_decode
  tail -1 "$out/engine_prefill.log"
elif [ "$stage" = soak ]; then
  run soak 330 python3 -m attnplug.cli soak --backend cuda --steps "${SOAK_STEPS:-20000}" --seed 0 --progress 60 --json "$out/soak.json"
  tail -30 "$out/soak.log"
else
  install_flashinfer
  # hybrid_step's decode steps (bf16 and FP8, the FlashInfer peers' search) are the fp8 stage's: this stage times
  # its draft steps unless HYBRID_MODES says otherwise (both modes and the rest of the suite overrun one call)
  # shellcheck disable=SC2086
  run bench 480 python3 -m attnplug.cli bench --backend cuda ${BENCH_ONLY:+--only $BENCH_ONLY} --out "$out/bench" --budget-s 460 \
    --set flex_budget_s=60 --set hybrid_modes="${HYBRID_MODES:-draft_extend}" --history "$out/history.jsonl"
  grep -v "hybrid_step" "$out/bench.log" | tail -40
  tail -2 "$out/flashinfer.log"
  # last: the hybrid_step table (floors and % of floor, PDL on/off, FlashInfer ratios, replay prep)
  python3 -m attnplug.bench.report "$out/bench/bench.json" --only hybrid_step
  tail -1 "$out/bench.log"
fi
printf '%s\n' "${summary[@]}"
