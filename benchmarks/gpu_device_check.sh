#!/usr/bin/env bash
# The prepared GPU check, as one short script for a lent GPU machine (under 10 minutes):
# profile vLLM's step times on the GPU, then the plug-in against vLLM's fixed budgets on that
# profile, with energy per SLO-meeting request from NVML. Results under $OUT (or results/gpu).
#     bash benchmarks/gpu_device_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-results/gpu}"
mkdir -p "$OUT"
test -x .venv-vllm/bin/python || { echo "needs .venv-vllm (make setup-vllm) on this machine" >&2; exit 2; }
nvidia-smi --query-gpu=name,memory.total,power.draw --format=csv | tee "$OUT/gpu.csv"
timeout 200 .venv-vllm/bin/python benchmarks/vllm_gpu_profile.py --out "$OUT/gpu_profile.csv" --repeats 2 | tail -20
timeout 330 .venv-vllm/bin/python benchmarks/vllm_gpu_bench.py --profile "$OUT/gpu_profile.csv" --requests 400 --out "$OUT/bench"
