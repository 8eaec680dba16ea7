#!/usr/bin/env bash
# The checks that need CUDA, as one short script: every test marked `gpu` (NCCL data
# parallelism under torchrun, DDP and FSDP2, against one process).
# Run from anywhere: bash benchmarks/gpu_check.sh [pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi -L
python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.device_count(), 'GPU(s)')"
python -m pytest -m gpu -q -p no:cacheprovider tests "$@"
