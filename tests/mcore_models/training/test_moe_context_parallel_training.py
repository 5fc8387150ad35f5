"""``pretrain`` of an MoE model with context parallelism against the same run at CP = 1 on one process.

Each CP rank routes only its share of every sequence, so the router's balance losses and the
expert-bias counts must be those of the whole sequences: the losses of every iteration, the
held-out loss, the greedy sample and the final weights (experts by their global index) equal the
one-process run's (fp32; summation order differs, rtol 1e-4 as the expert-parallel tests).
"""

import dataclasses
import sys
from pathlib import Path

import pytest
from mcore_models.training import pretrain

sys.path.insert(0, str(Path(__file__).parent))
from moe_training_checks import MOE, assert_same_training

# every router loss and the expert bias at once: a CP rank that balanced its own tokens moves them
BALANCED = dict(
    moe_aux_loss_coeff=0.1,  # large enough that a wrong balance loss shows in the losses
    moe_z_loss_coeff=1e-3,
    moe_router_enable_expert_bias=True,
    moe_router_bias_update_rate=1e-2,
)


def _moe(configs, ep=1, load_balancing="aux_loss"):
    configs.model = dataclasses.replace(
        configs.model,
        **(MOE | BALANCED),
        moe_router_load_balancing_type=load_balancing,
        expert_model_parallel_size=ep,
    )
    return configs


def _run(run_distributed, configs, world_size):
    (report,) = [r for r in run_distributed(pretrain, world_size, configs, timeout=180) if r is not None]
    return report


def _assert_same_run(report, oracle):
    assert "CP=2" in report["layout"]
    assert_same_training(report, oracle)
    assert report["final_heldout"]["loss"] == pytest.approx(oracle["final_heldout"]["loss"], rel=1e-4)
    assert report["sample"] == oracle["sample"] is not None


@pytest.mark.parametrize("load_balancing", ["aux_loss", "seq_aux_loss", "global_aux_loss"])
def test_moe_at_cp2_trains_like_one_process(load_balancing, run_distributed, tiny_configs, tmp_path):
    layout = dict(sample_tokens=4)
    oracle = _run(run_distributed, _moe(tiny_configs(tmp_path / "cp1", 3, **layout), 1, load_balancing), 1)
    report = _run(
        run_distributed, _moe(tiny_configs(tmp_path / "cp2", 3, cp=2, **layout), 1, load_balancing), 2
    )
    _assert_same_run(report, oracle)


@pytest.mark.parametrize("fsdp", [False, True], ids=["ddp", "fsdp"])
def test_moe_at_cp2_ep2_trains_like_one_process(fsdp, run_distributed, run_once, tiny_configs, tmp_path):
    """CP = 2 x DP = 2 with EP = 2 taken from the data x context parallel ranks; with ``--fsdp`` the
    dense parameters shard over all four, the experts over expert-DP = 2."""
    if fsdp:
        pytest.importorskip("mcore_fsdp")
    layout = dict(sample_tokens=4, global_batch=8)
    oracle = run_once(_run, run_distributed, _moe(tiny_configs(tmp_path / "one", 3, **layout)), 1)
    configs = tiny_configs(tmp_path / "cp2-ep2", 3, cp=2, fsdp=fsdp, **layout)
    report = _run(run_distributed, _moe(configs, 2), 4)
    assert "EP=2" in report["layout"] and ("FSDP" in report["layout"]) == fsdp
    _assert_same_run(report, oracle)
