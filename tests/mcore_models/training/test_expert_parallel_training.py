"""``pretrain`` with expert parallelism: EP = 2 trains the model EP = 1 trains on one process.

The oracle is the same configuration at EP = 1 on a single rank (fp32; the layouts differ only in
summation order, rtol 1e-4 as the other layout tests). Expert weights are initialized independently
of the EP size, so both runs start from the same model; parameters are compared through the final
checkpoints, read back into one process (experts by their global index).
"""

import dataclasses
import sys
from pathlib import Path

import pytest
import torch
from mcore_models.training import parse_train_args, pretrain, resolve_configs
from mcore_parallel import ConfigError

sys.path.insert(0, str(Path(__file__).parent))
from moe_training_checks import MOE, assert_same_training, train_losses


def _moe(configs, ep=1, **extra):
    configs.model = dataclasses.replace(configs.model, **MOE, expert_model_parallel_size=ep, **extra)
    return configs


def _run(run_distributed, configs, world_size):
    (report,) = [r for r in run_distributed(pretrain, world_size, configs, timeout=180) if r is not None]
    return report


@pytest.mark.parametrize(
    "distributed_optimizer, grouped, overlap",
    [(False, False, False), (True, True, False), (True, False, True)],
    ids=[
        "adamw-sequential-experts",
        "distributed-optimizer-grouped-experts",
        "distributed-optimizer-overlapped-reduction",
    ],
)
def test_ep2_trains_like_ep1(
    distributed_optimizer, grouped, overlap, run_distributed, tiny_configs, tmp_path
):
    layout = dict(distributed_optimizer=distributed_optimizer, sample_tokens=4)  # greedy sample too
    extra = dict(moe_grouped_gemm=grouped)
    runs = []
    for name, ep in (("ep1", 1), ("ep2", 2)):
        configs = _moe(tiny_configs(tmp_path / name, 3, **layout), ep, **extra)
        configs.ddp = dataclasses.replace(
            configs.ddp, overlap_grad_reduce=overlap, bucket_size=2000 if overlap else None
        )
        runs.append(_run(run_distributed, configs, ep))
    oracle, report = runs
    assert "EP=2 DP=2" in report["layout"]
    assert report["parameters"] == oracle["parameters"]
    assert report["sample"] == oracle["sample"] is not None
    assert_same_training(report, oracle)


@pytest.mark.parametrize(
    "layout",
    [
        dict(distributed_optimizer=True, global_batch=8),
        dict(pp=2),
        dict(pp=2, vpp=2, global_batch=8, distributed_optimizer=True),
        dict(tp=2),
        dict(cp=2),
    ],
    ids=[
        "ep2-expert-dp2-distributed-optimizer",
        "pp2-ep2",
        "pp2-vpp2-ep2-distributed-optimizer",
        "tp2-ep2",
        "cp2-ep2",
    ],
)
def test_ep2_on_four_ranks_trains_like_ep1(layout, run_distributed, tiny_configs, tmp_path):
    model_parallel = layout.get("tp", 1) * layout.get("pp", 1) * layout.get("cp", 1)
    oracle = _run(run_distributed, _moe(tiny_configs(tmp_path / "ep1", 3, **layout)), model_parallel)
    report = _run(run_distributed, _moe(tiny_configs(tmp_path / "ep2", 3, **layout), 2), 4)
    assert_same_training(report, oracle)


def test_checkpoint_saved_at_ep2_continues_at_ep1_and_back(
    run_distributed, tiny_configs, checkpoint_at, tmp_path
):
    """EP = 2 (distributed optimizer) -> EP = 1 (AdamW) at iteration 2 -> EP = 2 at iteration 4."""
    whole = _run(
        run_distributed,
        _moe(tiny_configs(tmp_path / "ep2", 5, save_interval=2, distributed_optimizer=True), 2),
        2,
    )
    source = checkpoint_at(tmp_path / "ep2" / "checkpoints", 2, tmp_path / "at-2")
    resumed = _run(
        run_distributed, _moe(tiny_configs(tmp_path / "ep1", 5, save_interval=2, load=str(source))), 1
    )
    assert resumed["resumed_from"] == 2
    torch.testing.assert_close(train_losses(resumed)[2:], train_losses(whole)[2:], rtol=1e-4, atol=0)
    at_4 = checkpoint_at(tmp_path / "ep1" / "checkpoints", 4, tmp_path / "at-4")
    again = _run(run_distributed, _moe(tiny_configs(tmp_path / "again", 5, load=str(at_4)), 2), 2)
    assert again["resumed_from"] == 4 and again["iterations_run"] == 1
    torch.testing.assert_close(train_losses(again)[4:], train_losses(whole)[4:], rtol=1e-4, atol=0)


@pytest.mark.parametrize("grouped", [False, True], ids=["sequential-experts", "grouped-experts"])
def test_fsdp_ep2_on_four_ranks_trains_like_ep1(grouped, run_distributed, tiny_configs, tmp_path):
    """mcore-fsdp shards experts over the expert-data-parallel group (EP = 2 x expert-DP = 2, dense
    DP = 4); the final checkpoint names experts globally, so it compares with one process's."""
    pytest.importorskip("mcore_fsdp")
    extra = dict(moe_grouped_gemm=grouped)
    layout = dict(sample_tokens=4, global_batch=8)
    oracle = _run(run_distributed, _moe(tiny_configs(tmp_path / "ep1", 3, **layout), **extra), 1)
    configs = tiny_configs(tmp_path / "fsdp-ep2", 3, fsdp=True, **layout)
    report = _run(run_distributed, _moe(configs, 2, **extra), 4)
    assert "EP=2 DP=4 FSDP(optim_grads_params)" in report["layout"]
    assert report["parameters"] == oracle["parameters"]
    assert report["sample"] == oracle["sample"]
    assert_same_training(report, oracle)


@pytest.mark.parametrize("grouped", [False, True], ids=["sequential-experts", "grouped-experts"])
def test_fsdp_checkpoint_saved_at_ep2_continues_at_ep1_and_back(
    grouped, run_distributed, tiny_configs, checkpoint_at, tmp_path
):
    """FSDP at EP = 2 x expert-DP = 2 -> FSDP at EP = 1 on 2 ranks (another strategy) at iteration
    2 -> EP = 2 again at iteration 4, each with the uninterrupted run's losses."""
    pytest.importorskip("mcore_fsdp")
    experts, layout = dict(moe_grouped_gemm=grouped), dict(global_batch=8, fsdp=True, save_interval=2)
    whole = _run(run_distributed, _moe(tiny_configs(tmp_path / "ep2", 5, **layout), 2, **experts), 4)
    source = checkpoint_at(tmp_path / "ep2" / "checkpoints", 2, tmp_path / "at-2")
    configs = tiny_configs(tmp_path / "ep1", 5, load=str(source), fsdp_strategy="optim", **layout)
    resumed = _run(run_distributed, _moe(configs, **experts), 2)
    assert resumed["resumed_from"] == 2
    torch.testing.assert_close(train_losses(resumed)[2:], train_losses(whole)[2:], rtol=1e-4, atol=0)
    assert_same_training(resumed, whole)
    at_4 = checkpoint_at(tmp_path / "ep1" / "checkpoints", 4, tmp_path / "at-4")
    again = _run(
        run_distributed, _moe(tiny_configs(tmp_path / "again", 5, load=str(at_4), **layout), 2, **experts), 4
    )
    assert again["resumed_from"] == 4 and again["iterations_run"] == 1
    torch.testing.assert_close(train_losses(again)[4:], train_losses(whole)[4:], rtol=1e-4, atol=0)
    assert_same_training(again, whole)


@pytest.mark.parametrize(
    "world, argv, fields",
    [
        (2, ["--num-moe-experts", "3"], "num_moe_experts, expert_model_parallel_size"),
        (
            4,
            ["--tensor-model-parallel-size", "2", "--expert-model-parallel-size", "4"],
            "expert_model_parallel_size, nproc_per_node",
        ),
        (2, ["--export-hf", "hf", "--moe-router-score-function", "sigmoid"], "export_hf"),
    ],
    ids=["experts-not-divisible", "ep-does-not-divide-dp", "export-hf-of-a-model-no-family-holds"],
)
def test_invalid_expert_parallel_layouts_are_refused_with_the_fields_named(world, argv, fields):
    base = ["--num-moe-experts", "4", "--moe-router-topk", "2", "--expert-model-parallel-size", "2"]
    with pytest.raises(ConfigError, match=f"^{fields}: "):
        resolve_configs(parse_train_args(base + argv), world)
