"""``pretrain`` on a GPU: the model, its batches and its optimizer on CUDA, and (in float32) the
losses of the same run on the CPU."""

import os

import pytest
import torch
from mcore_models.training import pretrain


def _losses(configs, hide_gpu: bool) -> tuple[str, dict]:
    if hide_gpu:  # the forked rank has not initialized CUDA: this hides it from the run
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    report = pretrain(configs)
    return report["device"], dict(report["history"]["train"])


@pytest.mark.gpu
def test_pretrain_on_a_gpu_matches_the_cpu_run(run_distributed, tiny_configs, tmp_path):
    configs = tiny_configs(tmp_path / "gpu", train_iters=4, fp32=True)
    [(device, on_gpu)] = run_distributed(_losses, 1, configs, False, backend="nccl", timeout=180)
    configs = tiny_configs(tmp_path / "cpu", train_iters=4, fp32=True)
    [(cpu_device, on_cpu)] = run_distributed(_losses, 1, configs, True, timeout=180)
    assert device.startswith("cuda") and cpu_device == "cpu"
    assert on_gpu.keys() == on_cpu.keys() == {1, 2, 3, 4}
    for iteration, loss in on_cpu.items():
        assert on_gpu[iteration] == pytest.approx(loss, rel=1e-4), iteration


@pytest.mark.gpu
def test_pretrain_on_a_gpu_defaults_to_bf16_and_learns(run_distributed, tiny_configs, tmp_path):
    configs = tiny_configs(tmp_path / "bf16", train_iters=8)
    [(device, losses)] = run_distributed(_losses, 1, configs, False, backend="nccl", timeout=180)
    assert device.startswith("cuda")
    assert all(torch.isfinite(torch.tensor(loss)) for loss in losses.values())
    assert losses[8] < losses[1]
