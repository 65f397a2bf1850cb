#!/usr/bin/env bash
# One GPU check, about 4 minutes on one H200 for steps 1-5 (their parts' times; not yet run whole) and an
# estimated 2-3 more for step 6 (never run yet):
#   1. the CUDA-marked tests (FP8 GEMM, CUDA-graph capture and replay vs eager) and the triton kernels
#      compiled for the GPU (not interpreted), alone and wired into whole tiny models;
#   2. decode tokens/s at batch 1 and 64 of a random-weight ~8B Llama in BF16 and FP8 (triton kernels,
#      CUDA graphs), with achieved HBM bandwidth as a fraction of the card's (4.8 TB/s on an H200),
#      and batch 1 again without graphs: what the graphs buy;
#   3. decode tokens/s at batch 1 and 64 of a DeepSeek-V3-shaped random MoE (4 layers at full width, MLA,
#      256 experts top 8, FP8 projections), as one rank of EP 8, with achieved HBM bandwidth (bench/gpu_moe.py);
#   4. where those steps' time goes: a graph replay's device time against the step's wall time, and the
#      kernels of an eager step ranked by CUDA time (bench/gpu_profile.py);
#   5. the triton kernels' tiles swept at those decode shapes, then decode measured with the winners
#      (bench/gpu_tune.py --apply): whether the defaults in each kernel module still win on this card;
#   6. llama.cpp's GPU placement (bench/gpu_placement.py): a random 12 GB Q8_0 MoE GGUF under a 6 GB memory
#      budget on the card, opened with the plan's placement (--n-gpu-layers 999 --n-cpu-moe N): the GPU memory
#      it holds and decode tokens/s at batch 1, beside every expert on the GPU and every expert in host memory.
#      Needs a CUDA build of llama-cpp-python; with the CPU-only wheel it prints SKIP and how to build one.
# Usage: bash bench/gpu_check.sh [--dry-run]   (--dry-run: CPU, tiny model; what CI runs)
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
DRY=${1:-}
if [[ "$DRY" != "--dry-run" ]]; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python - <<'PY'
import torch
assert torch.cuda.is_available(), "no CUDA device visible to torch"
print("torch", torch.__version__, "cuda", torch.version.cuda, "capability", torch.cuda.get_device_capability())
PY
  echo "== CUDA tests (cuda marker: formats, CUDA graphs; triton kernels compiled) =="
  TRITON_INTERPRET=0 timeout 240 python -m pytest -q tests/test_cuda_formats.py tests/test_cuda_graphs.py \
    tests/test_triton_kernels.py
  echo "== decode throughput =="
  timeout 240 python bench/gpu_decode.py --batches 1,64 --formats bf16,fp8 --context 1024 --steps 32
  timeout 90 python bench/gpu_decode.py --batches 1 --formats bf16 --context 1024 --steps 32 --no-cuda-graphs
  echo "== DeepSeek-V3-shaped MoE decode (FP8, EP 8 rank) =="
  timeout 180 python bench/gpu_moe.py --layers 4 --ep 8 --batches 1,64 --formats fp8 --context 1024 --steps 16
  echo "== where the time goes (graph replay vs step wall; kernels of an eager step) =="
  timeout 200 python bench/gpu_profile.py --top 14
  echo "== kernel tiles: sweep, then decode with the winners =="
  timeout 300 python bench/gpu_tune.py --apply
  echo "== llama.cpp placement: an MoE bigger than its GPU budget, experts of the first N layers in host memory =="
  timeout 300 python bench/gpu_placement.py --gb 12 --memory-budget 6GB
else
  python bench/gpu_decode.py --dry-run
  python bench/gpu_moe.py --dry-run --batches 1,4
  python bench/gpu_profile.py --dry-run --cases llama:bf16:1,moe:fp8:4 --top 3
  python bench/gpu_tune.py --dry-run --apply
  python bench/gpu_placement.py --dry-run
fi
