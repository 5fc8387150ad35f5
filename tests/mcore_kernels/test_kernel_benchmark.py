"""``benchmarks/kernel_benchmark.py``: without a GPU it says one is needed and exits 0; every op's case
builds, and its eager contender (mcore-kernels' reference) runs forward and backward, at a small
size on the CPU."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture
def benchmark_modules(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import kernel_benchmark as kernels
    import kernel_cases

    return kernel_cases, kernels


def test_without_a_gpu_it_says_so_and_exits_0():
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / "kernel_benchmark.py"), "--repeats", "1"],
        capture_output=True,
        text=True,
        timeout=300,
        env={"CUDA_VISIBLE_DEVICES": "", "PATH": "/usr/bin:/bin"},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "needs a CUDA GPU" in done.stdout


def test_every_case_runs_forward_and_backward_on_the_reference(benchmark_modules):
    kernel_cases, kernels = benchmark_modules
    cases = kernel_cases.all_cases("cpu", torch.float32, small=True)
    assert {case.name for case in cases} >= {
        "rms_norm",
        "rope",
        "softmax",
        "moe_permute",
        "paged_attention_prefill_chunk",
    }
    for case in cases:
        eager = kernel_cases.on_backend("reference", case.run)
        backward = bool(kernels._gradients(case))
        kernels._step(eager, case, backward)  # raises if a case's inputs do not fit its op
        assert backward == case.backward, case.name
