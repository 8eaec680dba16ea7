#!/usr/bin/env bash
# The test suite against one PyTorch version, in a virtual environment of its own.
#
#   bash tools/torch_version.sh 2.11.0                  # install (once), then the whole suite
#   bash tools/torch_version.sh 2.6.0 tests/test_model.py -x    # pytest's arguments after the version
#   NANOLM_VENVS=/somewhere bash tools/torch_version.sh 2.11.0   # where the venvs live
#
# Why: pyproject.toml promises a range of PyTorch versions, and FlexAttention, torch.compile, the
# profiler, DCP and FSDP2 all moved inside it; a version that was never run is a promise nobody
# kept. The venv is kept (one per version) so a second run costs only the suite. From the
# package index, each version's default Linux wheel brings its CUDA libraries (~3 GB) and runs on
# the CPU: allow several minutes for the first install. The closing lines give the version and
# pytest's counts, as docs/gpu.md#pytorch-versions records them.
set -euo pipefail
if [[ $# -lt 1 || "$1" == -h || "$1" == --help ]]; then
    sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//'
    exit 2
fi
version="$1"; shift
cd "$(dirname "$0")/.."
venv="${NANOLM_VENVS:-$HOME/.cache/nanolm/venvs}/torch-$version"
if [[ ! -x "$venv/bin/python" ]] || ! "$venv/bin/python" -c "import torch, nanolm" 2>/dev/null; then
    python3 -m venv "$venv"
    "$venv/bin/pip" install --quiet "torch==$version"
    # the project and its test extras, with this torch pinned so nothing upgrades it
    "$venv/bin/pip" install --quiet -e ".[dev]" "torch==$version"
fi
"$venv/bin/python" -c "import torch; print('torch', torch.__version__, '| python', __import__('sys').version.split()[0])"
"$venv/bin/python" -m pytest "$@"
