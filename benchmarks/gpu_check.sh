#!/usr/bin/env bash
# nanolm on one CUDA GPU: the GPU-marked tests (bf16 autocast, fused AdamW, FlexAttention's
# document mask against the SDPA reference, torch.compile against eager), then the throughput
# of a 124M-parameter GPT at context 1024 with and without the document mask, eager and
# compiled: tokens/s and MFU (against an H100/H200's 989 TFLOP/s bf16 dense peak); then the
# output head and the loss at GPT-2's vocabulary, whole against fused: time and peak memory.
#
# Needs only PyTorch (with Triton, for torch.compile and FlexAttention): installs nothing, no
# network. Under 8 minutes on one H200. Run from anywhere:
#
#   bash benchmarks/gpu_check.sh
#   PEAK_TFLOPS=312 bash benchmarks/gpu_check.sh        # another GPU's peak (A100 bf16: 312)
#
# Without a CUDA GPU it stops at once with one line and exit status 2. Otherwise both parts run
# (a test failure does not hide the figures) and the status is 0 only if both succeeded. The
# benchmark's JSON is also written to $GPU_CHECK_OUT (default: gpu_check.json in the current
# directory) for docs/benchmarks.md.
set -uo pipefail
OUT_FILE="$(pwd)/${GPU_CHECK_OUT:-gpu_check.json}"
cd "$(dirname "$0")/.." || exit 2
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY="${PYTHON:-python}"

if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    echo "gpu_check: no CUDA GPU is visible to PyTorch (torch.cuda.is_available() is False); nothing was run" >&2
    exit 2
fi
"$PY" - <<'EOF'
import torch
p = torch.cuda.get_device_properties(0)
try:
    import triton
    triton_version = triton.__version__
except ImportError:
    triton_version = "missing (torch.compile and FlexAttention will fail)"
print(f"gpu_check: {p.name}, {p.total_memory / 2**30:.0f} GiB, compute capability {p.major}.{p.minor}, "
      f"{torch.cuda.device_count()} device(s) | torch {torch.__version__}, CUDA {torch.version.cuda}, "
      f"Triton {triton_version} | {__import__('time').strftime('%Y-%m-%d %H:%M')}")
EOF

status=0
echo "== GPU-marked tests (pytest -m gpu)"
timeout 180 "$PY" -m pytest -m gpu -q -p no:cacheprovider tests -rs || { echo "gpu_check: GPU tests FAILED" >&2; status=1; }

echo "== throughput: GPT-2 small shape (124M), context 1024, batch 16, --precision auto (bf16)"
if timeout 360 "$PY" benchmarks/throughput.py --device cuda --shapes gpt2 --no-reference --compile \
        --rounds 4 --steps 5 --warmup 2 --peak-tflops "${PEAK_TFLOPS:-989}" > "$OUT_FILE"; then
    "$PY" - "$OUT_FILE" <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))
s = r["shapes"]["gpt2"]
print(f"{r['device']} | {r['precision']} | {s['parameters'] / 1e6:.0f}M parameters | peak VRAM {r.get('peak_vram_mb', 0) / 1024:.1f} GiB")
for name in ("nanolm", "nanolm_mask_off", "nanolm_compiled", "nanolm_mask_off_compiled"):
    v = s[name]
    extra = f" (compile {v['compile_s']} s)" if "compile_s" in v else ""
    print(f"  {name:26s} {v['tokens_per_sec']:>9,d} tokens/s  MFU {100 * v['mfu']:5.1f} %{extra}")
print(f"  mask overhead, compiled: {100 * (s['time_ratios']['wall']['nanolm_compiled / nanolm_mask_off_compiled'] - 1):+.1f} %"
      f" | loader share of the eager step: {100 * s['loader_share_of_step']:.1f} %")
print(f"gpu_check: figures in {sys.argv[1]}")
EOF
else
    echo "gpu_check: throughput benchmark FAILED or ran out of time" >&2
    status=1
fi

echo "== the output head and the loss at GPT-2's vocabulary (50,304), 16 x 1024 positions, width 768: whole vs fused (--loss-chunk auto)"
if timeout 120 "$PY" benchmarks/head_and_loss.py --device cuda --vocab 50304 --tokens 16384 --width 768 --rounds 5 \
        > "${OUT_FILE%.json}_head.json"; then
    "$PY" - "${OUT_FILE%.json}_head.json" <<'EOF2'
import json, sys
for r in json.load(open(sys.argv[1]))["results"]:
    print(f"  head and loss: whole {r['whole_ms']} ms, {r['peak_mb_whole']} MiB peak | fused ({r['rows_per_chunk']} positions a chunk) "
          f"{r['fused_ms']} ms, {r['peak_mb_fused']} MiB | same gradients: {r['same_gradients']}")
    print(f"  a 4-block model's forward and backward: whole {r['step_whole_ms']} ms, fused {r['step_fused_ms']} ms")
EOF2
else
    echo "gpu_check: head-and-loss benchmark FAILED or ran out of time" >&2
    status=1
fi
exit $status
