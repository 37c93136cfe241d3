#!/usr/bin/env bash
# The prepared GPU check, as one short script for a lent GPU machine (under 10 minutes).
# With vLLM's CUDA release (.venv-vllm, `make setup-vllm`): profile vLLM's step times on the GPU,
# then the plug-in against vLLM's fixed budgets on that profile, with energy per SLO-meeting
# request from NVML. Without it (a machine that cannot install vLLM): profile transformers'
# kernels on the GPU (`sloweave profile --device cuda`, the 8B model's shape with random bf16
# weights) and fit it, time one prompt's prefill alone by chunk size, and what a token count's
# first forward costs (gpu_step_size_warmup.py); $PYTHON (default
# python3) needs torch with CUDA and transformers 5.20.2.
# Results under $OUT (or results/gpu).
#     bash benchmarks/gpu_device_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-results/gpu}"
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,power.draw --format=csv | tee "$OUT/gpu.csv"
if [ -x .venv-vllm/bin/python ]; then
    timeout 200 .venv-vllm/bin/python benchmarks/vllm_gpu_profile.py --out "$OUT/gpu_profile.csv" --repeats 2 | tail -20
    timeout 330 .venv-vllm/bin/python benchmarks/vllm_gpu_bench.py --profile "$OUT/gpu_profile.csv" --requests 400 --out "$OUT/bench"
else
    echo "no .venv-vllm here: profiling transformers' kernels on the GPU instead of vLLM's" >&2
    # transformers' paged SDPA attends each query over the whole batch's keys: its decode-context
    # cost is not a serving engine's, so the contexts stay short; the n = 0 rows are exact.
    PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}" timeout 420 "${PYTHON:-python3}" -c 'from sloweave.cli import main; main()' \
        profile --model benchmarks/models/llama-3.1-8b --device cuda --dtype bfloat16 \
        --decodes 0,8,32,128 --chunks 0,256,512,1024,2048,4096 --contexts 256,1024 --repeats 3 --holdout 3 \
        --out "$OUT/gpu_transformers_profile.csv" | tee "$OUT/gpu_transformers_fit.json"
    PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}" timeout 120 "${PYTHON:-python3}" benchmarks/gpu_prefill_curve.py \
        --out "$OUT/prefill_curve.csv"
    PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}" timeout 180 "${PYTHON:-python3}" benchmarks/gpu_prefill_curve.py \
        --cuda-graph --out "$OUT/prefill_curve_graph.csv"
    # a token count's first forward: with SDPA as torch picks it (cuDNN on Hopper) and kept off cuDNN
    PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}" timeout 120 "${PYTHON:-python3}" benchmarks/gpu_step_size_warmup.py \
        --sizes 60 --occurrences 4 --out "$OUT/warmup"
    PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}" timeout 120 "${PYTHON:-python3}" benchmarks/gpu_step_size_warmup.py \
        --sizes 60 --occurrences 4 --no-cudnn-attention --out "$OUT/warmup-no-cudnn"
    # the same through the CPU runtime's engine (transformers' continuous batching, paged attention)
    PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}" timeout 150 "${PYTHON:-python3}" benchmarks/gpu_step_size_warmup.py \
        --engine runtime --sizes 60 --occurrences 4 --out "$OUT/warmup-runtime"
fi
