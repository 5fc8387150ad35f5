"""``pretrain`` on a model with MoE layers (DP=2, expert bias and the global load-balancing loss
on): it trains and logs the router losses of every iteration, and a resume continues it exactly
(the routers' expert biases travel in the checkpoint)."""

import dataclasses

from mcore_models.training import pretrain
from mcore_parallel import LoggerConfig
from mcore_testing.tensorboard_events import needs_tensorboard, read_scalars

MOE = dict(
    num_moe_experts=4,
    moe_router_topk=2,
    moe_ffn_hidden_size=16,
    moe_aux_loss_coeff=0.01,
    moe_router_load_balancing_type="global_aux_loss",
    moe_z_loss_coeff=0.001,
    moe_router_enable_expert_bias=True,
    moe_router_bias_update_rate=0.01,
)


@needs_tensorboard
def test_moe_model_trains_and_logs_router_losses(run_distributed, tiny_configs, tmp_path):
    configs = tiny_configs(tmp_path / "run", 2)
    configs.model = dataclasses.replace(configs.model, **MOE)
    configs.logger = LoggerConfig(log_interval=1, tensorboard_dir=str(tmp_path / "tb"))
    (report,) = [r for r in run_distributed(pretrain, 2, configs, timeout=120) if r is not None]
    assert report["iterations_run"] == 2
    scalars = read_scalars(tmp_path / "tb")
    assert set(scalars["moe/load_balancing_loss"]) == {1, 2}
    assert all(v > 0 for v in scalars["moe/z_loss"].values())


def test_resume_with_expert_biases_repeats_the_uninterrupted_run(
    run_distributed, tiny_configs, checkpoint_at, tmp_path
):
    def run(output, **checkpointing):
        configs = tiny_configs(tmp_path / output, 4, **checkpointing)
        configs.model = dataclasses.replace(configs.model, **MOE | dict(moe_router_bias_update_rate=0.1))
        (report,) = [r for r in run_distributed(pretrain, 2, configs, timeout=120) if r is not None]
        return dict(report["history"]["train"])

    whole = run("whole", save_interval=2)
    resumed = run(
        "resumed", load=str(checkpoint_at(tmp_path / "whole" / "checkpoints", 2, tmp_path / "at-2"))
    )
    assert [resumed[i] for i in (3, 4)] == [whole[i] for i in (3, 4)]
