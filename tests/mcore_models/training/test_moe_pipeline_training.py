"""An MoE model's checkpoint from one process continues at pipeline-parallel layouts (PP = 2 and
PP = 2 x VPP = 2, each also with EP = 2) exactly as on the one process.

Pipeline stages draw their initial weights from other seeds than one process, so the layouts start
from the one-process run's checkpoint of iteration 2: iterations 3-4 must then give its losses and
its final weights (fp32; summation order differs, rtol 1e-4 as the expert-parallel tests).
"""

import dataclasses
import sys
from pathlib import Path

import pytest
from mcore_models.training import pretrain

sys.path.insert(0, str(Path(__file__).parent))
from moe_training_checks import MOE, assert_same_training

LAYOUTS = {
    "pp2": (2, dict(pp=2)),
    "pp2-vpp2": (2, dict(pp=2, vpp=2)),
    "pp2-ep2": (4, dict(pp=2, ep=2)),
    "pp2-vpp2-ep2-distributed-optimizer": (4, dict(pp=2, vpp=2, ep=2, distributed_optimizer=True)),
}


def _moe(configs, ep=1):
    # z-loss and expert bias too: every router state must reach the stage that holds the layer
    extra = dict(moe_z_loss_coeff=1e-3, moe_router_enable_expert_bias=True, moe_router_bias_update_rate=1e-2)
    configs.model = dataclasses.replace(configs.model, **MOE, **extra, expert_model_parallel_size=ep)
    return configs


def _run(run_distributed, configs, world_size):
    (report,) = [r for r in run_distributed(pretrain, world_size, configs, timeout=180) if r is not None]
    return report


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_one_process_moe_checkpoint_continues_at_pipeline_layouts(
    name, run_distributed, run_once, tiny_configs, checkpoint_at, tmp_path
):
    batch = dict(global_batch=8, save_interval=2, sample_tokens=4)
    # the same one-process run for every layout: run once, its checkpoints copied from where it saved them
    whole = run_once(_run, run_distributed, _moe(tiny_configs(tmp_path / "one", 4, **batch)), 1)
    source = checkpoint_at(Path(whole["output_dir"]) / "checkpoints", 2, tmp_path / "at-2")
    world, layout = LAYOUTS[name][0], dict(LAYOUTS[name][1])
    ep = layout.pop("ep", 1)
    resumed = _run(
        run_distributed,
        _moe(tiny_configs(tmp_path / name, 4, load=str(source), **batch, **layout), ep),
        world,
    )
    assert resumed["resumed_from"] == 2 and resumed["iterations_run"] == 2
    assert "PP=2" in resumed["layout"] and ("EP=2" in resumed["layout"]) == (ep == 2)
    assert_same_training(resumed, whole)
    assert resumed["sample"] == whole["sample"] is not None
