"""Checkpoints of ``pretrain``: a resumed run repeats the uninterrupted one exactly, and a checkpoint
saved at one parallel layout continues at another with the same losses (fp32; only summation order
differs between layouts, rtol 1e-4)."""

import pytest
import torch
from mcore_models.training import pretrain


def _train_losses(run_distributed, configs, world_size=2):
    (report,) = [r for r in run_distributed(pretrain, world_size, configs, timeout=120) if r is not None]
    return {iteration: loss for iteration, loss in report["history"]["train"]}, report


@pytest.mark.parametrize(
    "distributed_optimizer, async_save",
    [(False, False), (True, False), (False, True)],
    ids=["adamw", "distributed-optimizer", "adamw-async-save"],
)
def test_resume_repeats_the_uninterrupted_run_exactly(
    distributed_optimizer, async_save, run_distributed, tiny_configs, checkpoint_at, tmp_path
):
    layout = dict(
        distributed_optimizer=distributed_optimizer, dropout=0.1
    )  # dropout: the RNG must resume too
    # an asynchronous save of iteration 2 is written while iterations 3-4 train, completed by the next
    whole, _ = _train_losses(
        run_distributed, tiny_configs(tmp_path / "whole", 5, save_interval=2, async_save=async_save, **layout)
    )
    assert (tmp_path / "whole" / "checkpoints" / "latest_checkpointed_iteration.txt").read_text() == "5"
    resume_from = checkpoint_at(tmp_path / "whole" / "checkpoints", 2, tmp_path / "at-2")
    resumed, report = _train_losses(
        run_distributed, tiny_configs(tmp_path / "resumed", 5, load=str(resume_from), **layout)
    )
    assert report["resumed_from"] == 2 and report["iterations_run"] == 3
    assert [resumed[i] for i in (3, 4, 5)] == [whole[i] for i in (3, 4, 5)]
    assert [resumed[i] for i in (1, 2)] == [whole[i] for i in (1, 2)]  # history came with the checkpoint
    assert len(set(whole.values())) == 5


def test_checkpoint_continues_at_other_layouts(run_distributed, tiny_configs, checkpoint_at, tmp_path):
    saved_at = dict(tp=2, sp=True, distributed_optimizer=True)  # TP=2 x DP=1 on 2 ranks
    whole, _ = _train_losses(run_distributed, tiny_configs(tmp_path / "tp2", 4, save_interval=2, **saved_at))
    source = checkpoint_at(tmp_path / "tp2" / "checkpoints", 2, tmp_path / "at-2")
    expected = torch.tensor([whole[3], whole[4]])
    for name, layout in {
        "dp2-adamw": dict(),
        "pp2-vpp2-distopt": dict(pp=2, vpp=2, distributed_optimizer=True),
    }.items():
        resumed, _ = _train_losses(
            run_distributed, tiny_configs(tmp_path / name, 4, load=str(source), **layout)
        )
        torch.testing.assert_close(
            torch.tensor([resumed[3], resumed[4]]), expected, rtol=1e-4, atol=0, msg=name
        )
