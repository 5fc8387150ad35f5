"""``mcore-train --moe-router-replay``: a run replaying a recording trains with the recording run's
losses bitwise, although its expert biases move elsewhere (a much larger bias update rate, which
shifts the experts picked but not the weights); the same run without replay gives other losses.
Replay checks the recording against the run before training, with typed errors.
"""

import dataclasses
import importlib.util

import pytest
from mcore_models.training import TrainingConfig, pretrain
from mcore_models.training.loop import resolve_configs
from mcore_parallel import ConfigError

MOE = dict(
    num_moe_experts=4,
    moe_router_topk=2,
    moe_ffn_hidden_size=16,
    moe_aux_loss_coeff=0.01,
    moe_router_enable_expert_bias=True,
    moe_router_bias_update_rate=0.001,
)
RECOMPUTE = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
LAYOUTS = {
    "dp2": ({}, {}),
    "pp2-vpp2-recompute": (dict(pp=2, vpp=2), RECOMPUTE),
    "ep2": ({}, dict(expert_model_parallel_size=2)),
    "ep2-fsdp": (dict(fsdp=True), dict(expert_model_parallel_size=2)),
}
NEEDS_FSDP = pytest.mark.skipif(importlib.util.find_spec("mcore_fsdp") is None, reason="needs mcore-fsdp")


def _configs(tiny_configs, output, train_iters, layout, model_fields, bias_rate, **replay):
    configs = tiny_configs(output, train_iters, **layout, **replay)
    configs.model = dataclasses.replace(
        configs.model, **MOE | model_fields | dict(moe_router_bias_update_rate=bias_rate)
    )
    return configs


def _train_losses(run_distributed, configs):
    (report,) = [r for r in run_distributed(pretrain, 2, configs, timeout=180) if r is not None]
    return [loss for _, loss in report["history"]["train"]]


@pytest.mark.parametrize(
    "layout", [pytest.param(name, marks=[NEEDS_FSDP] if "fsdp" in name else []) for name in LAYOUTS]
)
def test_replayed_run_repeats_the_recorded_losses(layout, run_distributed, tiny_configs, tmp_path):
    layout_fields, model_fields = LAYOUTS[layout]
    recording = str(tmp_path / "routing")

    def run(output, bias_rate, **replay):
        configs = _configs(
            tiny_configs, tmp_path / output, 4, layout_fields, model_fields, bias_rate, **replay
        )
        return _train_losses(run_distributed, configs)

    recorded = run("record", 0.001, moe_router_replay="record", moe_router_replay_dir=recording)
    assert sorted(p.name for p in (tmp_path / "routing").iterdir()) == [
        "routing-rank00000.pt",
        "routing-rank00001.pt",
        "routing.json",
    ]
    replayed = run("replay", 1.0, moe_router_replay="replay", moe_router_replay_dir=recording)
    fresh = run("fresh", 1.0)
    assert replayed == recorded
    assert fresh[0] == recorded[0] and fresh != recorded  # control: the moved biases route elsewhere


def test_replay_refuses_a_recording_of_another_run(run_distributed, tiny_configs, tmp_path):
    recording = tmp_path / "routing"
    record = _configs(
        tiny_configs,
        tmp_path / "record",
        2,
        {},
        {},
        0.001,
        moe_router_replay="record",
        moe_router_replay_dir=str(recording),
    )
    _train_losses(run_distributed, record)

    def replay(train_iters=2, directory=recording, world_size=2, global_batch=4, **model_fields):
        configs = _configs(
            tiny_configs,
            tmp_path / "replay",
            train_iters,
            dict(global_batch=global_batch),
            model_fields,
            0.001,
            moe_router_replay="replay",
            moe_router_replay_dir=str(directory),
        )
        return resolve_configs(configs, world_size)

    replay()  # the recording fits its own run
    with pytest.raises(ConfigError, match=r"made with moe_router_topk=2; this run has moe_router_topk=1"):
        replay(moe_router_topk=1)
    with pytest.raises(ConfigError, match=r"num_layers=4, num_moe_experts=4; this run has num_layers=2, num"):
        replay(num_layers=2, num_moe_experts=8)
    with pytest.raises(
        ConfigError, match=r"world_size=2, global_batch_size=4; this run has world_size=4, glo"
    ):
        replay(world_size=4, global_batch=8)
    with pytest.raises(ConfigError, match="ends at iteration 2, this run trains to 3"):
        replay(train_iters=3)
    with pytest.raises(ConfigError, match="no recorded routing in"):
        replay(directory=tmp_path / "nothing-here")
    (recording / "routing-rank00001.pt").unlink()
    with pytest.raises(ConfigError, match="lacks the routing of ranks"):
        replay()


def test_router_replay_needs_a_directory_and_moe_layers(tiny_configs, tmp_path):
    with pytest.raises(
        ConfigError, match="moe_router_replay_dir, moe_router_replay: --moe-router-replay record"
    ):
        TrainingConfig(moe_router_replay="record")
    dense = tiny_configs(tmp_path, moe_router_replay="record", moe_router_replay_dir=str(tmp_path / "r"))
    with pytest.raises(ConfigError, match="router replay needs MoE layers"):
        resolve_configs(dense, 2)


def test_a_resumed_run_records_and_replays_its_iterations(run_distributed, tiny_configs, tmp_path):
    """Record 2 iterations, resume the run to 4 recording into the same directory (it adds
    iterations 3 and 4); replaying the same two legs gives the recorded losses."""

    def legs(name, bias_rate, mode):
        def run(leg, train_iters, **checkpointing):
            configs = _configs(
                tiny_configs,
                tmp_path / name / leg,
                train_iters,
                checkpointing,
                {},
                bias_rate,
                moe_router_replay=mode,
                moe_router_replay_dir=str(tmp_path / "routing"),
            )
            return _train_losses(run_distributed, configs)

        run("first", 2)
        return run("resumed", 4, load=str(tmp_path / name / "first" / "checkpoints"))

    recorded = legs("record", 0.001, "record")
    assert len(recorded) == 4
    assert legs("replay", 1.0, "replay") == recorded
