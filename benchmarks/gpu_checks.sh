#!/usr/bin/env bash
# Every GPU check in one device call: the Pallas kernel tests compiled for the GPU (no interpret mode), the
# weight-only int8/fp8 projections against bf16 (< 60 s, capped at 90), the kernel timings with a block/split
# sweep, and offline throughput on SmolLM2- and Llama-3-8B-shaped dummy models in bf16. Results land in $OUT (the
# device tool brings them back) or benchmarks/results/gpu-run.
#
# Here, once per session:  python -m benchmarks.gpu_models .gpu && echo /.gpu/ >> .git/info/exclude
# Device call:             run(command="bash benchmarks/gpu_checks.sh", carry=[".gpu"], timeout_s=600)
set -uo pipefail
out=${OUT:-benchmarks/results/gpu-run}
mkdir -p "$out"
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || exit 1
fi
export PYTHONPATH="$PWD:/tmp/site" PYTHONUNBUFFERED=1 JVLLM_PALLAS_INTERPRET=0 JVLLM_CACHE_DIR=/tmp/jvllm-cache
export HF_HUB_OFFLINE=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
status=0
step() {  # step NAME COMMAND...: run, log to $out/NAME.log, remember a failure, keep going
    local name=$1; shift
    echo "=== $name: $*"
    "$@" 2>&1 | tee "$out/$name.log" || status=1
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
python3 -c "import jax; print(jax.__version__, jax.devices())"
# The engine-level Pallas tests need the embedded SmolLM2 wheel, which is too big to travel.
step pallas_tests python3 -m pytest -q tests/pallas_kernels --ignore=tests/pallas_kernels/test_pallas_engine.py
# bf16 vs per-channel int8 / fp8 weights at M = 1, 16, 64, 256 on Llama-3-8B projections: GB/s against the
# roofline, whether XLA fused the codes' convert into the GEMM, and jax's Mosaic int8 x bf16 kernel where M allows
step quant_matmul timeout 90 python3 -m benchmarks.gpu_quant_matmul --budget-s 55 --json "$out/quant_matmul_gpu.json"
step kernels python3 -m benchmarks.kernels --sweep --json "$out/kernels_gpu.json"
for shape in smollm2 llama8b; do
    step "throughput_$shape" python3 -m benchmarks.throughput --model ".gpu/$shape-shape" --load-format dummy \
        --dtype bfloat16 --batched-weight-dtype none --no-baseline --num-prompts 64 --input-len 128 \
        --output-len 128 --wide 256 --json "$out/throughput_${shape}_gpu.json"
done
# the same 8B shape with fp8 weights (per-channel codes, bf16 activations): single stream and the 64-prompt batch
step throughput_llama8b_fp8 python3 -m benchmarks.throughput --model .gpu/llama8b-shape --load-format dummy \
    --dtype bfloat16 --quantization fp8 --batched-weight-dtype none --no-baseline --scenarios single,batch \
    --num-prompts 64 --input-len 128 --output-len 128 --json "$out/throughput_llama8b_fp8_gpu.json"
exit $status
