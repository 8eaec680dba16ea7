#!/usr/bin/env bash
# Prove nanolm on one CUDA GPU, in one command. By default the first contact, ~6 minutes on a
# cold H200 by the parts' estimates: the real `nanolm train` loop end to end, kill -9 and a
# bit-identical resume, FlexAttention's document mask against SDPA forward and backward, bf16
# against fp32. `--parts second` and `--parts timing` are the rest (number formats, the NaN
# guard, Muon, --compile, the GPU-marked tests; then FlexAttention's cost, tokens/s and MFU at
# GPT-2 small's shape, the head and the loss). Each part prints PASS or FAIL with its figure;
# the last line is the verdict; the exit status is 1 if any part failed.
#
# Needs only what a GPU machine has: the machine's python3 with PyTorch (and Triton), pytest,
# safetensors, tokenizers, numpy and tqdm. Installs nothing, no network. Run from anywhere:
#
#   timeout 420 bash benchmarks/gpu_check.sh --out /tmp/gpu_check   # figures, logs: one directory
#   PYTHON=/opt/venv/bin/python bash benchmarks/gpu_check.sh         # another interpreter
#   PEAK_TFLOPS=312 bash benchmarks/gpu_check.sh --parts timing      # MFU against a GPU nanolm does not know
#
# Every option goes to benchmarks/gpu_check.py (--parts, --jobs, --budget, --timeout; see its
# --help and docs/gpu.md). Without a CUDA GPU it stops at once, with one line and exit status 2.
set -uo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python3}"
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"

if ! why="$("$PY" -c '
import sys
try:
    import torch
except Exception as e:
    sys.exit(f"PyTorch cannot be imported by {sys.executable} ({type(e).__name__}: {e})")
if not torch.cuda.is_available():
    sys.exit(f"no CUDA GPU is visible to PyTorch {torch.__version__} (torch.cuda.is_available() is False)")
' 2>&1)"; then
    echo "gpu_check: ${why##*$'\n'}; nothing was run" >&2
    exit 2
fi
exec "$PY" "$repo/benchmarks/gpu_check.py" "$@"
