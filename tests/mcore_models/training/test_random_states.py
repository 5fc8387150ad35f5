"""Random-number states in training checkpoints: each rank's own are saved and restored, so a resumed
run with dropout repeats the uninterrupted one; ``no_save_rng`` / ``no_load_rng`` and a changed
parallel layout keep the freshly seeded states (the latter with a warning)."""

import dataclasses
import random
import warnings

import numpy as np
import pytest
import torch
import torch.distributed as dist
from mcore_models.training import (
    build_optimizer,
    build_train_model,
    load_training_checkpoint,
    pretrain,
    save_training_checkpoint,
)
from mcore_parallel import (
    CheckpointConfig,
    DistributedCheckpointer,
    destroy_model_parallel,
    get_rng_tracker,
    initialize_model_parallel,
    model_parallel_manual_seed,
)

LAYOUT_WARNING = "random-number states were saved under"


def _seed_everything(seed: int, tp_rank: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    model_parallel_manual_seed(seed, tp_rank)


def _draws() -> list[float]:
    """The next number of each generator a checkpoint carries: Python, NumPy, torch, the TP stream."""
    with get_rng_tracker().fork():
        tracker = torch.rand(1).item()
    return [random.random(), float(np.random.rand()), torch.rand(1).item(), tracker]


def _save_then_load(configs, directory, save_tp, load_tp, save_rng=True, load_rng=True):
    """Save at TP = ``save_tp`` after drawing a little, load at TP = ``load_tp`` over fresh seeds.

    Returns this rank's next draws as the saving run would have made them, as the loading run makes
    them, as fresh seeds give them, and the loading run's warnings about the layout."""

    def build(tp):
        groups = initialize_model_parallel(tensor_model_parallel_size=tp)
        model_config = dataclasses.replace(configs.model, tensor_model_parallel_size=tp)
        model = build_train_model(model_config, 64, groups, configs.ddp, configs.training.seed)
        return groups, model, build_optimizer(model.ddp, configs.optimizer, groups)

    groups, model, optimizer = build(save_tp)
    _seed_everything(1 + dist.get_rank(), dist.get_rank(groups.tp))
    _draws()
    checkpointer = DistributedCheckpointer(CheckpointConfig(save=str(directory), no_save_rng=not save_rng))
    save_training_checkpoint(checkpointer, model, optimizer, groups.tp, 1, {}, groups)
    continued = _draws()
    destroy_model_parallel()

    groups, model, optimizer = build(load_tp)
    tp_rank = dist.get_rank(groups.tp)
    _seed_everything(100, tp_rank)
    checkpointer = DistributedCheckpointer(CheckpointConfig(load=str(directory), no_load_rng=not load_rng))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load_training_checkpoint(checkpointer, model, optimizer, groups.tp, groups)
    loaded = _draws()
    _seed_everything(100, tp_rank)
    fresh = _draws()
    destroy_model_parallel()
    layout_warnings = [str(w.message) for w in caught if LAYOUT_WARNING in str(w.message)]
    return continued, loaded, fresh, layout_warnings


def test_each_rank_gets_its_own_states_back(run_distributed, tiny_configs, tmp_path):
    configs = tiny_configs(tmp_path)
    results = run_distributed(_save_then_load, 2, configs, tmp_path / "ckpt", 2, 2, timeout=60)
    for continued, loaded, fresh, layout_warnings in results:
        assert loaded == continued and loaded != fresh and not layout_warnings
    (rank0, *_), (rank1, *_) = results
    assert all(a != b for a, b in zip(rank0, rank1, strict=True))  # the ranks' states differ, all four


@pytest.mark.parametrize(
    "save_rng, load_rng", [(False, True), (True, False)], ids=["no-save-rng", "no-load-rng"]
)
def test_states_left_out_or_ignored_keep_the_fresh_ones(
    save_rng, load_rng, run_distributed, tiny_configs, tmp_path
):
    configs = tiny_configs(tmp_path)
    results = run_distributed(
        _save_then_load, 2, configs, tmp_path / "ckpt", 2, 2, save_rng, load_rng, timeout=60
    )
    for _, loaded, fresh, layout_warnings in results:
        assert loaded == fresh and not layout_warnings
    keys = DistributedCheckpointer(CheckpointConfig(load=str(tmp_path / "ckpt"))).saved_keys()
    assert any(key.startswith("rng.") for key in keys) == save_rng


def test_another_layout_keeps_the_fresh_states_and_warns_once(run_distributed, tiny_configs, tmp_path):
    configs = tiny_configs(tmp_path)
    results = run_distributed(_save_then_load, 2, configs, tmp_path / "ckpt", 2, 1, timeout=60)
    for _, loaded, fresh, _ in results:
        assert loaded == fresh
    (*_, rank0_warnings), (*_, rank1_warnings) = results
    assert len(rank0_warnings) == 1 and not rank1_warnings
    assert "TP=2 CP=1 PP=1 DP=1 on" in rank0_warnings[0] and "TP=1 CP=1 PP=1 DP=2 on" in rank0_warnings[0]


def _train(run_distributed, configs):
    """The train losses by iteration and rank 0's warnings about the random states' layout."""

    def body():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            report = pretrain(configs)
        return report, [str(w.message) for w in caught if LAYOUT_WARNING in str(w.message)]

    (report, layout_warnings), _ = run_distributed(body, 2, timeout=120)
    return dict(report["history"]["train"]), layout_warnings


def test_resumed_dropout_continues_only_with_the_saved_states(
    run_distributed, tiny_configs, checkpoint_at, tmp_path
):
    layout = dict(tp=2, dropout=0.2)  # the two TP ranks carry different dropout streams
    whole, _ = _train(run_distributed, tiny_configs(tmp_path / "whole", 4, save_interval=2, **layout))
    source = str(checkpoint_at(tmp_path / "whole" / "checkpoints", 2, tmp_path / "at-2"))

    restored, layout_warnings = _train(
        run_distributed, tiny_configs(tmp_path / "restored", 4, load=source, **layout)
    )
    assert [restored[3], restored[4]] == [whole[3], whole[4]] and not layout_warnings

    configs = tiny_configs(tmp_path / "fresh", 4, load=source, **layout)
    configs.checkpoint = dataclasses.replace(configs.checkpoint, no_load_rng=True)
    fresh, _ = _train(run_distributed, configs)
    assert fresh[3] != whole[3] and fresh[4] != whole[4]  # the states matter

    other, layout_warnings = _train(
        run_distributed, tiny_configs(tmp_path / "dp2", 4, load=source, dropout=0.2)
    )
    assert sorted(other) == [1, 2, 3, 4] and len(layout_warnings) == 1
