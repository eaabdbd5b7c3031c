#!/usr/bin/env bash
# Every GPU check in one device call, in stages, each under its own time limit and writing its results to $OUT as it
# goes (or to benchmarks/results/gpu-run): the Pallas kernel tests compiled for the GPU (no interpret mode); the
# `pallas` backend's greedy tokens against `xla` on tiny dummy-weight models of each family, with compiles after
# start counted; kernel timings (decode GB/s against the copy bandwidth, ragged prefill against jax's Mosaic GPU
# flash attention, a block/warp/stage sweep); the engine in bf16 on Llama-3-8B- and SmolLM2-shaped dummy weights
# (prefill tok/s, decode at batch 1, 64 and 256, 64 requests of uneven lengths against 64 equal ones, start-up with
# precompiling, compiles after start); weight-only int8/fp8 projections; q/k/v and gate/up as separate products or
# one; where the 8B-shaped engine's decode steps spend their time (each kernel's device time by the jitted piece
# that launched it, the device's busy time against the step's wall time and the host's time to dispatch it); that
# dispatch time with XLA's command buffers on or off and with several layers to a call; the host's own work per
# step on a near-free model.
# The default stages' limits add up to 9 minutes (tests, greedy, kernels, llama8b); STAGES (space-separated
# names) picks others: mosaic_tests, sweep, flash, decode, llama8b_mosaic, smollm2, quant, projections, profile,
# dispatch, host, host_thread, llama8b_tuned (after the three before it, or with TUNED_FROM=folder of their results;
# DISPATCH_BUDGET_S and HOST_ROWS shorten them), e.g. STAGES="tests greedy kernels llama8b" GREEDY_FAMILIES=phi3,gemma3,qwen2,qwen3_moe;
# the engine's JVLLM_* settings pass through (JVLLM_DISPATCH_THREAD=1 STAGES=llama8b). Everything printed goes to
# $out/log.txt, the results to one JSON file per stage (the device tool brings back 8 files at most).
# benchmarks/results/gpu_h100_2026-11-27/summary.md and gpu_h200_2026-12-04*/summary.md hold the runs' figures and
# what each stage took (on the H200: tests 150+ s, greedy with 4-5 families 49-62 s, kernels 44-73 s, llama8b 143 s,
# llama8b_mosaic 177 s, profile 62 s, host 60 s).
#
# Before a GPU run, on a machine with the embedded model:  python -m benchmarks.gpu_models .gpu
#   and the wheels the GPU image (Python 3.12) lacks in .whl (both folders are in .gitignore):
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .whl gguf llguidance
# On the GPU machine:      bash benchmarks/gpu_checks.sh   (from the repository root, with .gpu and .whl beside it)
set -uo pipefail
out=${OUT:-benchmarks/results/gpu-run}
mkdir -p "$out"
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || exit 1
fi
export PYTHONPATH="$PWD:/tmp/site" PYTHONUNBUFFERED=1 JVLLM_PALLAS_INTERPRET=0 JVLLM_CACHE_DIR=/tmp/jvllm-cache
export HF_HUB_OFFLINE=1 XLA_PYTHON_CLIENT_PREALLOCATE=false TRANSFORMERS_VERBOSITY=error
stages=" ${STAGES:-tests greedy kernels llama8b} "
status=0
log="$out/log.txt"
step() {  # step NAME LIMIT_S COMMAND...: run under a time limit, log, print the log's end, remember a failure, go on
    local name=$1 limit=$2; shift 2
    [[ $stages == *" $name "* ]] || return 0
    echo "=== $name (limit ${limit}s): $*" | tee -a "$log"
    local started=$SECONDS
    timeout --kill-after=5 "$limit" "$@" 2>&1 | tee -a "$log" > "/tmp/$name.log"
    local rc=${PIPESTATUS[0]}
    tail -n 25 "/tmp/$name.log"
    echo "=== $name: exit $rc after $((SECONDS - started)) s" | tee -a "$log"
    [ $rc -eq 0 ] || status=1
    # a stage cut short must not leave processes on the GPU to slow the next stage's timings (pytest's workers)
    pkill -9 -f "python3 -m (pytest|benchmarks)" 2>/dev/null
    pkill -9 -f "exec\(eval\(sys.stdin.readline" 2>/dev/null  # pytest-xdist's workers (execnet)
    local left
    left=$(nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader 2>/dev/null)
    [ -z "$left" ] || echo "=== still on the GPU after $name: $left" | tee -a "$log"
}
{
    date -u +%FT%TZ
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,clocks.max.mem --format=csv
    python3 -c "import jax, jaxlib, triton; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__, 'triton', triton.__version__, jax.devices())"
} 2>&1 | tee -a "$log"
# The kernels run compiled against their references (the CUDA-lowering and ptxas tests need no GPU: CI's
# GPU-versions leg runs them; test_pallas_engine.py needs the embedded SmolLM2 wheel, too big to travel).
# -v names each test as it ends, so a stage cut short still says which failed.
step tests 190 python3 -m pytest -v -n 12 -p no:cacheprovider -o addopts="" --timeout 40 -rfE --tb=short \
    tests/pallas_kernels/test_pallas_decode.py tests/pallas_kernels/test_pallas_ragged.py \
    tests/pallas_kernels/test_pallas_backend.py tests/pallas_kernels/test_pallas_qk_chunks.py \
    tests/pallas_kernels/test_pallas_grouped_matmul.py tests/pallas_kernels/test_quant_matmul_bench.py \
    tests/pallas_kernels/test_mosaic_decode.py tests/pallas_kernels/test_mosaic_ragged.py \
    tests/pallas_kernels/test_mosaic_backend.py
# the Mosaic GPU kernels' tests alone, compiled: their register route, the warp-specialized kernel's turns
step mosaic_tests 90 python3 -m pytest -v -n 4 -p no:cacheprovider -o addopts="" --timeout 40 -rfE --tb=short \
    tests/pallas_kernels/test_mosaic_ragged.py tests/pallas_kernels/test_mosaic_backend.py \
    tests/pallas_kernels/test_mosaic_decode.py
# nine processes compile at once: XLA's GEMM autotuning (timing candidate kernels on the shared GPU) is off here,
# as speed is not what this stage checks
# (GREEDY_FAMILIES, comma-separated, checks fewer families: each process compiles its step shapes on the shared CPUs)
families=${GREEDY_FAMILIES:-llama,gemma2,mistral,qwen3,mixtral,phi3,gemma3,qwen2,qwen3_moe}
step greedy 70 env XLA_FLAGS=--xla_gpu_autotune_level=0 python3 -m benchmarks.gpu_greedy --root .gpu \
    --families "$families" --jobs "$(tr -cd , <<< "$families" | wc -c | awk '{print $1 + 1}')" --json "$out/greedy_gpu.jsonl"
step kernels 75 python3 -m benchmarks.kernels --budget-s 55 --warmup 2 --iters 10 --json "$out/kernels_gpu.json"
# the block / split / warp / stage sweep at the target shapes
step sweep 120 python3 -m benchmarks.kernels --sweep --only decode --budget-s 90 --json "$out/sweep_gpu.json"
# jax's Mosaic GPU flash attention beside the ragged kernel at the prefill shapes, without the sweep
step flash 60 python3 -m benchmarks.kernels --only prefill --budget-s 35 --json "$out/flash_gpu.json"
# every decode shape (batch 1-256 x context 512-8192, GQA and head-dim variants), without the sweep
step decode 50 python3 -m benchmarks.kernels --only decode --budget-s 35 --json "$out/decode_gpu.json"
# the engine's scenarios: prefill; decode of one stream, of 64 equal requests and of 256 at once; 64 requests of
# uneven lengths (prompts 16-1024, outputs 16-256) against 64 equal ones with the same token totals
engine_scenarios=(--no-baseline --scenarios prefill,single,batch,wide,traffic --traffic-requests 64 --repeats 2
    --num-prompts 64 --input-len 128 --output-len 128 --wide 256)
step llama8b 190 python3 -m benchmarks.throughput --model .gpu/llama8b-shape --load-format dummy --dtype bfloat16 \
    --batched-weight-dtype none "${engine_scenarios[@]}" --json "$out/throughput_llama8b_gpu.json"
# the same engine on the Mosaic GPU kernels
step llama8b_mosaic 200 python3 -m benchmarks.throughput --model .gpu/llama8b-shape --load-format dummy \
    --dtype bfloat16 --attention-backend mosaic --batched-weight-dtype none "${engine_scenarios[@]}" \
    --json "$out/throughput_llama8b_mosaic_gpu.json"
step smollm2 90 python3 -m benchmarks.throughput --model .gpu/smollm2-shape --load-format dummy --dtype bfloat16 \
    --batched-weight-dtype none "${engine_scenarios[@]}" --json "$out/throughput_smollm2_gpu.json"
# decode steps of 64 and 1 sequences at ~140 tokens of context on the Mosaic GPU kernels, profiled; only the shapes
# they need are compiled
step profile 100 python3 -m benchmarks.step_profile --model .gpu/llama8b-shape --load-format dummy --dtype bfloat16 \
    --attention-backend mosaic --batched-weight-dtype none --no-precompile --rows 64,1 --prompt-len 128 \
    --output-len 12 --steps 5 --top 20 --json "$out/profile_llama8b_gpu.json"
# a decode step's dispatch and wall time on SmolLM2's shape, one process per way of calling it: XLA's command
# buffers (CUDA graphs) as set, off, for any run length; runs of 4 or 8 layers in one executable
step dispatch 170 python3 -m benchmarks.dispatch_variants --model .gpu/smollm2-shape --load-format dummy \
    --dtype bfloat16 --rows 1,64 --budget-s "${DISPATCH_BUDGET_S:-150}" --json "$out/dispatch_smollm2_gpu.json"
# the host's work per step on a near-free model with the 8B's 32 layers: the floor under every step's time
host_rows=${HOST_ROWS:-1,64,256}
step host 90 python3 -m benchmarks.host_loop --rows "$host_rows" --layers 32 --repeats 2 --no-precompile \
    --tokenizer-from .gpu/smollm2-shape --json "$out/host_loop_gpu.json"
# the same with each step's calls made on a dispatch thread (JVLLM_DISPATCH_THREAD=1) while the engine's thread
# plans and reads the steps: the wall time per step is the host's pace (run_call's phase is then that thread's CPU)
step host_thread 90 env JVLLM_DISPATCH_THREAD=1 python3 -m benchmarks.host_loop --rows "$host_rows" --layers 32 \
    --repeats 2 --no-precompile --tokenizer-from .gpu/smollm2-shape --json "$out/host_loop_thread_gpu.json"
# the 8B engine run the way the three stages above found fastest (benchmarks/gpu_settings.py: a run of layers or an
# XLA flag, the dispatch thread; the defaults where nothing beat them by 3%), or as TUNED_FROM's results say
if [[ $stages == *" llama8b_tuned "* ]]; then
    tuned=$(python3 -m benchmarks.gpu_settings "${TUNED_FROM:-$out}" 2>>"$log")
    echo "=== llama8b_tuned settings: ${tuned:-the defaults}" | tee -a "$log"
fi
# shellcheck disable=SC2086  # the settings are NAME=VALUE words for env
step llama8b_tuned 190 env ${tuned:-} python3 -m benchmarks.throughput --model .gpu/llama8b-shape --load-format dummy \
    --dtype bfloat16 --batched-weight-dtype none "${engine_scenarios[@]}" --json "$out/throughput_llama8b_tuned_gpu.json"
# bf16 vs per-channel int8 / fp8 weights at M = 1, 16, 64, 256 on Llama-3-8B projections
step quant 40 python3 -m benchmarks.gpu_quant_matmul --budget-s 30 --json "$out/quant_matmul_gpu.json"
# q/k/v and gate/up as separate bf16 products against one product of their joined weights (the loader's), and
# whether XLA concatenates the separate products' weights inside the step
step projections 40 python3 -m benchmarks.gpu_projections --budget-s 30 --json "$out/projections_gpu.json"
exit $status
