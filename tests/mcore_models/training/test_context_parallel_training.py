"""``pretrain`` with context parallelism against the same run at CP = 1: the training losses of every
iteration, the held-out loss and the greedy sample (fp32; only summation order differs, rtol 1e-5).
Bad layouts are refused with a ``ConfigError`` naming the fields."""

import dataclasses

import pytest
import torch
from mcore_models.training import main, parse_train_args, pretrain, resolve_configs
from mcore_parallel import ConfigError


def _report(run_distributed, configs, world_size):
    (report,) = [r for r in run_distributed(pretrain, world_size, configs, timeout=120) if r is not None]
    return report


def _losses(report):
    return torch.tensor([loss for _, loss in report["history"]["train"]], dtype=torch.float64)


def _assert_same_run(report, reference, name):
    assert "CP=2" in report["layout"], name
    torch.testing.assert_close(_losses(report), _losses(reference), rtol=1e-5, atol=0, msg=name)
    assert report["final_heldout"]["loss"] == pytest.approx(reference["final_heldout"]["loss"], rel=1e-5)
    assert report["sample"] == reference["sample"], name


def test_context_parallel_training_matches_one_rank(run_distributed, run_once, tiny_configs, tmp_path):
    reference = run_once(_report, run_distributed, tiny_configs(tmp_path / "cp1", 3, sample_tokens=4), 1)
    assert len(set(_losses(reference).tolist())) == 3  # the model trains: the losses move
    for name, world, layout in [
        ("cp2-ring", 2, dict(cp=2)),
        ("cp2-dp2-allgather-distopt", 4, dict(cp=2, cp_comm_type="all_gather", distributed_optimizer=True)),
    ]:
        report = _report(run_distributed, tiny_configs(tmp_path / name, 3, sample_tokens=4, **layout), world)
        _assert_same_run(report, reference, name)


@pytest.mark.parametrize(
    "layout", [dict(tp=2, sp=True), dict(pp=2)], ids=["tp2-sp-cp2-ring", "pp2-cp2-allgather"]
)
def test_context_parallel_training_composes_with_model_parallel(
    run_distributed, tiny_configs, tmp_path, layout
):
    # TP and PP draw their weights differently from one rank: the oracle is the same layout without CP
    comm_type = "all_gather" if "pp" in layout else "p2p"
    reference = _report(run_distributed, tiny_configs(tmp_path / "cp1", 3, sample_tokens=4, **layout), 2)
    report = _report(
        run_distributed,
        tiny_configs(tmp_path / "cp2", 3, sample_tokens=4, cp=2, cp_comm_type=comm_type, **layout),
        4,
    )
    _assert_same_run(report, reference, str(layout))


@pytest.mark.parametrize(
    ("change", "fields"),
    [
        (
            lambda c: dataclasses.replace(c, data=dataclasses.replace(c.data, seq_length=34)),
            "seq_length, context_parallel_size",
        ),
        (
            lambda c: dataclasses.replace(c, data=dataclasses.replace(c.data, reset_position_ids=True)),
            "reset_position_ids, context_parallel_size",
        ),
        (
            lambda c: dataclasses.replace(c, ddp=dataclasses.replace(c.ddp, grad_reduce_op="sum")),
            "grad_reduce_op, context_parallel_size",
        ),
        (
            lambda c: c,
            "tensor_model_parallel_size, pipeline_model_parallel_size, context_parallel_size, nproc_per_node",
        ),
    ],
)
def test_layouts_context_parallelism_cannot_run_are_refused(tiny_configs, tmp_path, change, fields):
    configs = change(tiny_configs(tmp_path, cp=2))
    world = 2 if fields.startswith(("seq", "reset", "grad")) else 3
    with pytest.raises(ConfigError) as error:
        resolve_configs(configs, world)
    assert str(error.value).startswith(fields + ":")


def test_context_parallel_training_with_fsdp_matches_one_rank(
    run_distributed, run_once, tiny_configs, tmp_path
):
    pytest.importorskip("mcore_fsdp")
    reference = run_once(_report, run_distributed, tiny_configs(tmp_path / "cp1", 3, sample_tokens=4), 1)
    report = _report(
        run_distributed, tiny_configs(tmp_path / "cp2-fsdp", 3, sample_tokens=4, cp=2, fsdp=True), 2
    )
    assert "FSDP" in report["layout"]
    _assert_same_run(report, reference, "cp2-fsdp")


def test_mcore_train_accepts_context_parallel_size(capsys):
    configs = parse_train_args(["--context-parallel-size", "2", "--cp-comm-type", "all_gather"])
    assert configs.model.context_parallel_size == 2 and configs.model.cp_comm_type == "all_gather"
    resolved = resolve_configs(configs, 4)  # CP = 2 x DP = 2
    assert resolved.training.global_batch_size == 2 * configs.training.micro_batch_size
    with pytest.raises(SystemExit):
        main(["--context-parallel-size", "2", "--seq-length", "34"])
    assert "seq_length, context_parallel_size" in capsys.readouterr().err


def test_checkpoint_saved_at_cp2_continues_at_cp1(run_distributed, tiny_configs, checkpoint_at, tmp_path):
    whole = _report(run_distributed, tiny_configs(tmp_path / "cp2", 4, cp=2, save_interval=2), 2)
    source = checkpoint_at(tmp_path / "cp2" / "checkpoints", 2, tmp_path / "at-2")
    resumed = _report(run_distributed, tiny_configs(tmp_path / "cp1", 4, load=str(source)), 1)
    assert resumed["resumed_from"] == 2
    torch.testing.assert_close(_losses(resumed), _losses(whole), rtol=1e-5, atol=0)
