"""``--optimizer-cpu-offload``: every optimizer of ``mcore-train`` keeps (a fraction of) its float32
state on the CPU and trains as before; settings a layout cannot honour are refused up front."""

import dataclasses

import pytest
import torch
from mcore_models.training import LocalOptimizer, pretrain, resolve_configs
from mcore_parallel import (
    ConfigError,
    DistributedDataParallel,
    OptimizerConfig,
    destroy_model_parallel,
    initialize_model_parallel,
)


def _local_optimizer_steps(offload_fraction):
    destroy_model_parallel()
    initialize_model_parallel()
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    model = DistributedDataParallel(module)
    config = OptimizerConfig(
        lr=1e-2,
        optimizer_cpu_offload=offload_fraction is not None,
        optimizer_offload_fraction=offload_fraction or 1.0,
    )
    optimizer = LocalOptimizer(model, config)
    for step in range(3):
        optimizer.zero_grad()
        model(torch.randn(5, 8, generator=torch.Generator().manual_seed(step))).square().sum().backward()
        optimizer.step()
    total = sum(p.numel() for p in module.parameters())
    offloaded = [main for main in optimizer.main_params if main.device.type == "cpu"]
    assert sum(main.numel() for main in offloaded) >= optimizer.offloaded_numel
    return optimizer.offloaded_numel, total, [p.detach().clone() for p in module.parameters()]


def test_local_optimizer_offloads_up_to_the_fraction(run_distributed):
    (none,) = run_distributed(_local_optimizer_steps, 1, None)
    (half,) = run_distributed(_local_optimizer_steps, 1, 0.5)
    (whole,) = run_distributed(_local_optimizer_steps, 1, 1.0)
    assert none[0] == 0
    assert 0 < half[0] <= 0.5 * half[1]
    assert whole[0] == whole[1]
    for offloaded in (half, whole):
        for param, reference in zip(offloaded[2], none[2], strict=True):
            torch.testing.assert_close(param, reference, rtol=0, atol=0)


def _train_losses(run_distributed, configs):
    (report,) = [r for r in run_distributed(pretrain, 2, configs, timeout=120) if r is not None]
    return torch.tensor([loss for _, loss in report["history"]["train"]])


def _offloaded(configs, fraction=1.0):
    optimizer = dataclasses.replace(
        configs.optimizer, optimizer_cpu_offload=True, optimizer_offload_fraction=fraction
    )
    return dataclasses.replace(configs, optimizer=optimizer)


def test_mcore_train_with_offload_has_the_losses_of_the_plain_run(run_distributed, tiny_configs, tmp_path):
    plain = _train_losses(run_distributed, tiny_configs(tmp_path / "plain", 3))
    local = _train_losses(run_distributed, _offloaded(tiny_configs(tmp_path / "local", 3), 0.5))
    torch.testing.assert_close(local, plain, rtol=0, atol=0)
    pytest.importorskip("mcore_fsdp")
    fsdp = _train_losses(run_distributed, _offloaded(tiny_configs(tmp_path / "fsdp", 3, fsdp=True)))
    torch.testing.assert_close(fsdp, plain, rtol=1e-5, atol=0)  # as in test_fsdp: another summation order


@pytest.mark.parametrize(
    ("section", "changes", "field"),
    [
        ("ddp", {"bucket_size": 1000}, "bucket_size"),
        ("ddp", {"grad_reduce_op": "sum"}, "grad_reduce_op"),
        ("optimizer", {"optimizer_cpu_offload": True, "optimizer_offload_fraction": 0.5}, "offload_fraction"),
    ],
    ids=["bucket-size", "summed-gradients", "partial-offload"],
)
def test_fsdp_refuses_what_it_would_ignore(tiny_configs, tmp_path, section, changes, field):
    configs = tiny_configs(tmp_path, fsdp=True)
    changed = dataclasses.replace(getattr(configs, section), **changes)
    with pytest.raises(ConfigError, match=field):
        resolve_configs(dataclasses.replace(configs, **{section: changed}), 2)


def test_only_torch_dist_checkpoints(tiny_configs, tmp_path):
    configs = tiny_configs(tmp_path)
    configs.checkpoint = dataclasses.replace(configs.checkpoint, ckpt_format="fsdp_dtensor")
    with pytest.raises(ConfigError, match="ckpt_format"):
        resolve_configs(configs, 2)
