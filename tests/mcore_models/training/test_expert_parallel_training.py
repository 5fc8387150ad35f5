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
from mcore_parallel import ConfigError, LoggerConfig
from mcore_testing.tensorboard_events import needs_tensorboard, read_scalars

sys.path.insert(0, str(Path(__file__).parent))
from moe_training_checks import MOE, assert_same_training, train_losses


def _moe(configs, ep=1, **extra):
    configs.model = dataclasses.replace(configs.model, **MOE, expert_model_parallel_size=ep, **extra)
    return configs


def _run(run_distributed, configs, world_size):
    (report,) = [r for r in run_distributed(pretrain, world_size, configs, timeout=180) if r is not None]
    return report


def _run_logging_norms(run_distributed, configs, world_size):
    """``_run``, and the gradient norm of each iteration (from the run's TensorBoard scalars)."""
    tensorboard = f"{configs.training.output_dir}/tb"
    configs.logger = LoggerConfig(log_interval=1, tensorboard_dir=tensorboard)
    report = _run(run_distributed, configs, world_size)
    return report, read_scalars(tensorboard)["train/grad_norm"]


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


@needs_tensorboard  # the gradient norms are read from the run's TensorBoard scalars
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
    oracle, norms = _run_logging_norms(
        run_distributed, _moe(tiny_configs(tmp_path / "ep1", 3, **layout)), model_parallel
    )
    report, ep_norms = _run_logging_norms(
        run_distributed, _moe(tiny_configs(tmp_path / "ep2", 3, **layout), 2), 4
    )
    assert ep_norms == pytest.approx(norms, rel=1e-4) and len(norms) == 3  # each expert counted once
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


@pytest.mark.parametrize(
    "ep, split, experts",
    [
        (2, {}, dict(moe_grouped_gemm=False)),
        (2, {}, dict(moe_grouped_gemm=True)),
        (1, dict(expert_tensor_parallel_size=2), dict(add_bias_linear=True)),
        (2, dict(expert_tensor_parallel_size=2), dict(moe_grouped_gemm=True)),
    ],
    ids=[
        "ep2-sequential-experts",
        "ep2-grouped-experts",
        "etp2-expert-dp2-sequential-bias",
        "etp2-ep2-grouped",
    ],
)
def test_fsdp_checkpoint_continues_with_whole_experts_on_two_ranks_and_back(
    ep, split, experts, run_distributed, tiny_configs, checkpoint_at, tmp_path
):
    """FSDP checkpoints name experts globally and hold them whole: FSDP at EP = 2 or ETP = 2 (x EP)
    on 4 ranks -> FSDP with every expert whole on 2 ranks (another strategy) at iteration 2 -> the
    first layout again at iteration 4, each with the uninterrupted run's losses and final weights."""
    pytest.importorskip("mcore_fsdp")
    layout = dict(global_batch=8, fsdp=True, save_interval=2)
    whole = _run(
        run_distributed, _moe(tiny_configs(tmp_path / "first", 5, **layout), ep, **split, **experts), 4
    )
    source = checkpoint_at(tmp_path / "first" / "checkpoints", 2, tmp_path / "at-2")
    configs = tiny_configs(tmp_path / "second", 5, load=str(source), fsdp_strategy="optim", **layout)
    resumed = _run(run_distributed, _moe(configs, **experts), 2)
    assert resumed["resumed_from"] == 2
    torch.testing.assert_close(train_losses(resumed)[2:], train_losses(whole)[2:], rtol=1e-4, atol=0)
    assert_same_training(resumed, whole)
    at_4 = checkpoint_at(tmp_path / "second" / "checkpoints", 4, tmp_path / "at-4")
    configs = tiny_configs(tmp_path / "again", 5, load=str(at_4), **layout)
    again = _run(run_distributed, _moe(configs, ep, **split, **experts), 4)
    assert again["resumed_from"] == 4 and again["iterations_run"] == 1
    torch.testing.assert_close(train_losses(again)[4:], train_losses(whole)[4:], rtol=1e-4, atol=0)
    assert_same_training(again, whole)


@needs_tensorboard  # the gradient norms are read from the run's TensorBoard scalars
@pytest.mark.parametrize(
    "ep, extra, cp",
    [
        (1, dict(moe_token_dispatcher_type="alltoall", add_bias_linear=True), 1),
        (2, dict(moe_token_dispatcher_type="allgather", moe_grouped_gemm=True), 1),
        (1, dict(moe_token_dispatcher_type="alltoall", add_bias_linear=True), 2),
    ],
    ids=["etp2-expert-dp2-sequential-bias", "etp2-ep2-grouped-allgather", "cp2-etp2-expert-dp2-bias"],
)
def test_fsdp_etp2_on_four_ranks_trains_like_one_process(
    ep, extra, cp, run_distributed, run_once, tiny_configs, tmp_path
):
    """mcore-fsdp shards expert slices over the expert-data-parallel group (ETP = 2 x EP x
    expert-DP = dense DP x CP = 4): one process's losses, gradient norms (each slice, and FC2's bias
    shared by the expert-TP ranks, counted once), parameter count and whole final experts."""
    pytest.importorskip("mcore_fsdp")
    layout = dict(global_batch=8, sample_tokens=4)  # the gathered model's greedy sample too
    oracle, norms = run_once(
        _run_logging_norms, run_distributed, _moe(tiny_configs(tmp_path / "one", 3, **layout), **extra), 1
    )
    configs = _moe(
        tiny_configs(tmp_path / "fsdp-etp2", 3, fsdp=True, cp=cp, **layout),
        ep,
        expert_tensor_parallel_size=2,
        **extra,
    )
    report, etp_norms = _run_logging_norms(run_distributed, configs, 4)
    assert "ETP=2" in report["layout"] and "FSDP" in report["layout"]
    assert ("CP=2" in report["layout"]) == (cp == 2)
    assert report["parameters"] == oracle["parameters"]
    assert report["sample"] == oracle["sample"] is not None
    assert etp_norms == pytest.approx(norms, rel=1e-4) and len(norms) == 3
    assert_same_training(report, oracle)


@pytest.mark.parametrize(
    "world, argv, fields",
    [
        (2, ["--num-moe-experts", "3"], "num_moe_experts, expert_model_parallel_size"),
        (
            4,
            ["--tensor-model-parallel-size", "2", "--expert-model-parallel-size", "4"],
            "expert_model_parallel_size, expert_tensor_parallel_size, nproc_per_node",
        ),
        (2, ["--export-hf", "hf", "--moe-router-score-function", "sigmoid"], "export_hf"),
    ],
    ids=["experts-not-divisible", "ep-does-not-divide-dp", "export-hf-of-a-model-no-family-holds"],
)
def test_invalid_expert_parallel_layouts_are_refused_with_the_fields_named(world, argv, fields):
    base = ["--num-moe-experts", "4", "--moe-router-topk", "2", "--expert-model-parallel-size", "2"]
    with pytest.raises(ConfigError, match=f"^{fields}: "):
        resolve_configs(parse_train_args(base + argv), world)


@needs_tensorboard  # the gradient norms are read from the run's TensorBoard scalars
@pytest.mark.parametrize(
    "tp, etp, ep, extra, layout",
    [
        (1, 2, 1, dict(moe_token_dispatcher_type="alltoall"), dict()),
        (
            1,
            2,
            2,
            dict(moe_grouped_gemm=True, moe_token_dispatcher_type="allgather"),
            dict(distributed_optimizer=True),
        ),
        (2, 1, 2, dict(moe_token_dispatcher_type="alltoall", add_bias_linear=True), dict()),
        # context parallelism: each CP rank's tokens split again over the expert-TP ranks
        (1, 2, 1, dict(moe_token_dispatcher_type="alltoall"), dict(cp=2)),
        (2, 2, 1, dict(moe_token_dispatcher_type="allgather", add_bias_linear=True), dict(cp=2)),
        (1, 2, 2, dict(moe_grouped_gemm=True, moe_token_dispatcher_type="alltoall"), dict(cp=2)),
        (2, 2, 1, dict(moe_token_dispatcher_type="alltoall"), dict(cp=2, cp_comm_type="all_gather")),
        (2, 1, 2, dict(moe_token_dispatcher_type="alltoall", add_bias_linear=True), dict(cp=2)),
    ],
    ids=[
        "etp2-ep1-sequential-alltoall",
        "etp2-ep2-grouped-allgather-distopt",
        "tp2-etp1-ep2-bias",
        "cp2-etp2-sequential-alltoall",
        "tp2-cp2-etp2-allgather-bias",
        "cp2-etp2-ep2-grouped-alltoall",
        "tp2-cp2-all-gather-etp2-alltoall",
        "tp2-cp2-etp1-ep2-bias",
    ],
)
def test_expert_tensor_parallel_on_four_ranks_trains_like_one_process(
    tp, etp, ep, extra, layout, run_distributed, run_once, tiny_configs, tmp_path
):
    """Experts split over expert-TP ranks (TP != ETP allowed): the losses, gradient norms (each
    expert slice counted once), parameter count and final weights of the same model trained on
    one process."""
    layout = dict(global_batch=8, **layout)
    # the oracle runs on one process, without context parallelism
    split = {key: layout.pop(key) for key in ("cp", "cp_comm_type") if key in layout}
    one = _moe(tiny_configs(tmp_path / "one", 3, **layout), **extra)
    oracle, norms = run_once(_run_logging_norms, run_distributed, one, 1)
    configs = _moe(
        tiny_configs(tmp_path / "etp", 3, tp=tp, **split, **layout),
        ep,
        expert_tensor_parallel_size=etp,
        **extra,
    )
    report, etp_norms = _run_logging_norms(run_distributed, configs, 4)
    assert f"ETP={etp}" in report["layout"]
    assert ("CP=2" in report["layout"]) == (split.get("cp") == 2)
    assert report["parameters"] == oracle["parameters"]
    assert etp_norms == pytest.approx(norms, rel=1e-4) and len(norms) == 3
    assert_same_training(report, oracle)


@needs_tensorboard  # the gradient norms are read from the run's TensorBoard scalars
@pytest.mark.parametrize(
    "tp, etp, ep, layout, extra",
    [
        (2, 2, 1, dict(), dict(moe_token_dispatcher_type="alltoall", add_bias_linear=True)),
        (
            1,
            2,
            1,
            dict(distributed_optimizer=True),
            dict(moe_token_dispatcher_type="alltoall", add_bias_linear=True),
        ),
        (1, 2, 1, dict(vpp=2), dict(moe_token_dispatcher_type="allgather", moe_grouped_gemm=True)),
        (2, 1, 2, dict(), dict(moe_token_dispatcher_type="alltoall", add_bias_linear=True)),
        (1, 2, 1, dict(cp=2, distributed_optimizer=True), dict(moe_token_dispatcher_type="alltoall")),
    ],
    ids=[
        "tp2-etp2-pp2-bias",
        "tp1-etp2-pp2-dp2-distributed-optimizer-bias",
        "tp1-etp2-pp2-vpp2-grouped-allgather",
        "tp2-etp1-ep2-pp2-bias",
        "cp2-etp2-pp2-distributed-optimizer",
    ],
)
def test_expert_tensor_parallel_with_pipeline_parallel_continues_like_one_process(
    tp, etp, ep, layout, extra, run_distributed, run_once, tiny_configs, checkpoint_at, tmp_path
):
    """Expert tensor parallelism with PP = 2 on four ranks: ETP = 2 (EP = 2 beside it does not fit,
    a stage has two ranks: see the refusals below), or ETP = 1 beside TP = 2 with EP = 2. Pipeline
    stages draw their initial weights from other seeds than one process (see
    test_moe_pipeline_training), so the layout continues one process's checkpoint of iteration 2:
    iterations 3-4 must give the one process's losses, gradient norms and final weights."""
    layout = dict(global_batch=8, save_interval=2, **layout)
    # the oracle runs on one process, without pipeline stages (or context parallelism)
    vpp, cp = layout.pop("vpp", None), layout.pop("cp", 1)
    oracle, norms = run_once(
        _run_logging_norms, run_distributed, _moe(tiny_configs(tmp_path / "one", 4, **layout), **extra), 1
    )
    source = checkpoint_at(Path(oracle["output_dir"]) / "checkpoints", 2, tmp_path / "at-2")
    configs = tiny_configs(tmp_path / "etp", 4, tp=tp, pp=2, vpp=vpp, cp=cp, load=str(source), **layout)
    report, etp_norms = _run_logging_norms(
        run_distributed, _moe(configs, ep, expert_tensor_parallel_size=etp, **extra), 4
    )
    assert "PP=2" in report["layout"] and f"ETP={etp}" in report["layout"]
    assert ("VPP=2" in report["layout"]) == (vpp == 2) and ("CP=2" in report["layout"]) == (cp == 2)
    assert report["resumed_from"] == 2 and report["iterations_run"] == 2
    assert report["parameters"] == oracle["parameters"]
    assert etp_norms == pytest.approx({step: norms[step] for step in (3, 4)}, rel=1e-4)
    assert_same_training(report, oracle)


def test_checkpoint_saved_at_etp2_continues_on_one_process_and_back(
    run_distributed, tiny_configs, checkpoint_at, tmp_path
):
    """Checkpoints hold whole experts: ETP = 2 x EP = 2 -> one process at iteration 2 -> ETP = 2 at 4."""
    layout = dict(global_batch=8, save_interval=2)
    etp = dict(expert_tensor_parallel_size=2)
    whole = _run(run_distributed, _moe(tiny_configs(tmp_path / "etp2", 5, **layout), 2, **etp), 4)
    source = checkpoint_at(tmp_path / "etp2" / "checkpoints", 2, tmp_path / "at-2")
    resumed = _run(run_distributed, _moe(tiny_configs(tmp_path / "one", 5, load=str(source), **layout)), 1)
    assert resumed["resumed_from"] == 2
    torch.testing.assert_close(train_losses(resumed)[2:], train_losses(whole)[2:], rtol=1e-4, atol=0)
    at_4 = checkpoint_at(tmp_path / "one" / "checkpoints", 4, tmp_path / "at-4")
    again = _run(
        run_distributed, _moe(tiny_configs(tmp_path / "again", 5, load=str(at_4), **layout), 2, **etp), 4
    )
    assert again["resumed_from"] == 4 and again["iterations_run"] == 1
    torch.testing.assert_close(train_losses(again)[4:], train_losses(whole)[4:], rtol=1e-4, atol=0)


@pytest.mark.parametrize(
    "world, argv, fields",
    [
        (
            4,
            ["--expert-tensor-parallel-size", "4", "--expert-model-parallel-size", "2"],
            "expert_model_parallel_size, expert_tensor_parallel_size, nproc_per_node",
        ),
        (
            4,
            [
                "--expert-tensor-parallel-size",
                "2",
                "--expert-model-parallel-size",
                "2",
                "--pipeline-model-parallel-size",
                "2",
            ],
            "expert_model_parallel_size, expert_tensor_parallel_size, nproc_per_node",
        ),
        (
            4,
            [
                "--expert-tensor-parallel-size",
                "2",
                "--fsdp",
                "--pipeline-model-parallel-size",
                "2",
                "--virtual-pipeline-model-parallel-size",
                "2",
                "--global-batch-size",
                "8",
                "--micro-batch-size",
                "1",
            ],
            "fsdp, virtual_pipeline_model_parallel_size",
        ),
        (
            2,
            [
                "--expert-tensor-parallel-size",
                "1",
                "--tensor-model-parallel-size",
                "2",
                "--seq-length",
                "7",
                "--micro-batch-size",
                "1",
            ],
            "seq_length, micro_batch_size, tensor_model_parallel_size",
        ),
    ],
    ids=[
        "etp-x-ep-does-not-divide-the-ranks",
        "etp-x-ep-does-not-divide-a-pipeline-stage",
        "fsdp-with-vpp2",
        "tokens-not-divisible-by-tp",
    ],
)
def test_invalid_expert_tensor_parallel_layouts_are_refused(world, argv, fields):
    base = ["--num-moe-experts", "4", "--moe-router-topk", "2"]
    with pytest.raises(ConfigError, match=f"^{fields}: "):
        resolve_configs(parse_train_args(base + argv), world)
