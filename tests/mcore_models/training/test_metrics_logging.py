"""What ``LoggerConfig`` asks of a run: TensorBoard scalars (read back from the event file), timers
by level and across ranks, held-out perplexity and memory."""

import sys

import pytest
from mcore_models.training import main, pretrain
from mcore_parallel import LoggerConfig
from mcore_testing.tensorboard_events import needs_tensorboard, read_scalars


@needs_tensorboard
def test_fine_timers_min_max_perplexity_and_memory(run_distributed, tiny_configs, tmp_path):
    configs = tiny_configs(tmp_path / "run", 4)
    configs.training.eval_interval = 2
    configs.logger = LoggerConfig(
        log_interval=2,
        tensorboard_dir=str(tmp_path / "tb"),
        log_timers_to_tensorboard=True,
        log_validation_ppl_to_tensorboard=True,
        log_memory_to_tensorboard=True,
        timing_log_level=2,
        timing_log_option="minmax",
    )
    (report,) = [r for r in run_distributed(pretrain, 2, configs, timeout=120) if r is not None]
    scalars = read_scalars(tmp_path / "tb")

    train_loss, lrs = dict(report["history"]["train"]), dict(report["history"]["lr"])
    assert scalars["train/loss"] == pytest.approx({2: train_loss[2], 4: train_loss[4]})
    assert scalars["train/lr"] == pytest.approx({2: lrs[2], 4: lrs[4]})
    assert all(value > 0 for value in scalars["train/grad_norm"].values())
    assert set(scalars["train/tokens_per_second"]) == {2, 4}
    heldout = dict(report["history"]["heldout"])
    assert scalars["heldout/loss"] == pytest.approx({2: heldout[2], 4: heldout[4]})
    assert set(scalars["heldout/perplexity"]) == {2, 4}  # the evaluation at 2 and the final one
    assert all(value > 0 for value in scalars["memory/max_rss_bytes"].values())
    timed = ["iteration", "forward-backward", "optimizer", "batch", "sequence-parallel-grads"]
    for name in timed:
        for step in (2, 4):
            low, high = scalars[f"timers/{name}/min"][step], scalars[f"timers/{name}/max"][step]
            assert 0 < low <= high, name
    assert set(report["mean_seconds"]) == {*timed, "evaluation", "save"}


@needs_tensorboard
def test_default_level_times_the_iteration_only(run_distributed, tiny_configs, tmp_path):
    configs = tiny_configs(tmp_path / "run", 2)
    configs.logger = LoggerConfig(
        log_interval=1,
        tensorboard_dir=str(tmp_path / "tb"),
        log_timers_to_tensorboard=True,
        timing_log_option="all",
    )
    (report,) = [r for r in run_distributed(pretrain, 2, configs, timeout=120) if r is not None]
    scalars = read_scalars(tmp_path / "tb")

    assert {tag for tag in scalars if tag.startswith("timers/")} == {
        "timers/iteration/rank0",
        "timers/iteration/rank1",
    }
    assert set(scalars["train/loss"]) == {1, 2}
    assert "heldout/perplexity" not in scalars and set(scalars["heldout/loss"]) == {2}
    assert not any(tag.startswith("memory/") for tag in scalars)
    assert set(report["mean_seconds"]) == {"iteration"}


def test_tensorboard_dir_without_the_extra_is_a_clear_error(capsys, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # tensorboard not installed
    with pytest.raises(SystemExit):
        main(["--tensorboard-dir", str(tmp_path / "tb")])
    assert "mcore-models[tensorboard]" in capsys.readouterr().err
