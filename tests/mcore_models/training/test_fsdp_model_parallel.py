"""``--fsdp`` with tensor and pipeline parallelism: each rank shards its TP slices of its stage's
layers over the data-parallel group.

The oracle is the same model trained by one process (fp32; the layouts differ in summation order,
rtol 1e-4 as the other layout tests). TP ranks draw their slices of one master weight, so a TP
layout starts from one process's model. Pipeline stages draw their layers from seeds of their own
(as without ``--fsdp``), so with PP the oracle is plain data parallelism at PP = 2 on 2 ranks. The
final checkpoints hold the TP slices whole and name layers globally, so they are compared tensor
by tensor with the oracle's.
"""

import dataclasses
import sys
from pathlib import Path

import pytest
import torch
from mcore_models.training import pretrain
from mcore_parallel import LoggerConfig
from mcore_testing.tensorboard_events import needs_tensorboard, read_scalars

sys.path.insert(0, str(Path(__file__).parent))
from moe_training_checks import MOE, assert_same_training, final_checkpoint, train_losses

pytest.importorskip("mcore_fsdp")

LAYOUT = dict(global_batch=8, sample_tokens=4)  # 4 micro-batches a step; the gathered model's sample


def _run(run_distributed, configs, world_size):
    """The run's report and the gradient norm of each iteration (from its TensorBoard scalars)."""
    tensorboard = f"{configs.training.output_dir}/tb"
    configs.logger = LoggerConfig(log_interval=1, tensorboard_dir=tensorboard)
    (report,) = [r for r in run_distributed(pretrain, world_size, configs, timeout=180) if r is not None]
    return report, read_scalars(tensorboard)["train/grad_norm"]


def _swiglu(configs):
    """Gated MLPs: fc1's TP slices hold ``[gate rows; up rows]``, not a slice of the whole tensor."""
    configs.model = dataclasses.replace(configs.model, activation="swiglu")
    return configs


def _whole_tensors(report) -> dict[str, torch.Tensor]:
    """The final checkpoint's model tensors; a plain run's gated fc1 (saved as ``.gate`` and ``.up``)
    joined whole as an FSDP run saves it."""
    tensors = final_checkpoint(report)
    for gate in [key for key in tensors if key.endswith(".gate")]:
        name = gate.removesuffix(".gate")
        tensors[name] = torch.cat([tensors.pop(gate), tensors.pop(f"{name}.up")])
    return tensors


def _assert_same_weights(report, oracle) -> None:
    """Every final tensor, whole, equal to the oracle's but for rounding-level Adam steps."""
    params, expected = _whole_tensors(report), _whole_tensors(oracle)
    assert params.keys() == expected.keys()
    for key, value in expected.items():
        assert params[key].shape == value.shape, key
        close = torch.isclose(params[key], value, rtol=1e-4, atol=1e-5)
        assert close.float().mean() >= 0.99, f"{key}: {int((~close).sum())} of {value.numel()} differ"


def _oracle(run_distributed, run_once, tiny_configs, output, layout, training=None, **extra):
    """One process's run, or plain data parallelism's at PP = 2 on 2 ranks where ``layout`` has PP
    (once a session for each configuration: several layouts share one)."""
    pp = layout.get("pp", 1)
    configs = tiny_configs(output, 3, pp=pp, **LAYOUT, **(training or {}))
    configs.model = dataclasses.replace(configs.model, **extra)
    return run_once(_run, run_distributed, configs, pp)


@needs_tensorboard
@pytest.mark.parametrize(
    "layout, shown",
    [
        (dict(tp=2), "TP=2 PP=1 DP=2"),
        (dict(tp=2, sp=True), "TP=2 PP=1 DP=2 SP"),
        (dict(pp=2), "TP=1 PP=2 DP=2"),
        (dict(tp=2, pp=2, sp=True), "TP=2 PP=2 DP=1 SP"),
    ],
    ids=["tp2-dp2", "tp2-dp2-sequence-parallel", "pp2-dp2", "tp2-pp2-sequence-parallel"],
)
def test_fsdp_with_model_parallelism_trains_like_the_oracle(
    layout, shown, run_distributed, run_once, tiny_configs, tmp_path
):
    """Losses, gradient norms (each slice once, each replicated tensor once, each stage's own),
    parameter count, greedy sample and whole final weights equal the oracle's; with sequence
    parallelism the layer norms' partial gradients are summed over the TP ranks."""
    exports = {} if "pp" in layout else {name: tmp_path / name / "hf" for name in ("oracle", "fsdp")}
    oracle, norms = _oracle(
        run_distributed,
        run_once,
        tiny_configs,
        tmp_path / "oracle",
        layout,
        training=dict(export_hf=str(exports["oracle"])) if exports else None,
        activation="swiglu",
    )
    export = dict(export_hf=str(exports["fsdp"])) if exports else {}
    configs = _swiglu(tiny_configs(tmp_path / "fsdp", 3, fsdp=True, **layout, **LAYOUT, **export))
    report, fsdp_norms = _run(run_distributed, configs, 4)
    assert report["layout"] == f"{shown} FSDP(optim_grads_params)"
    torch.testing.assert_close(train_losses(report), train_losses(oracle), rtol=1e-4, atol=0)
    assert fsdp_norms == pytest.approx(norms, rel=1e-4) and len(norms) == 3
    assert report["parameters"] == oracle["parameters"]
    assert report["sample"] == oracle["sample"] is not None
    _assert_same_weights(report, oracle)
    if exports:  # Hugging Face export (PP = 1): the gathered TP slices make the oracle's model
        _assert_same_hf_logits(exports["fsdp"], oracle["hf_export"])


def _assert_same_hf_logits(directory, expected_directory) -> None:
    transformers = pytest.importorskip("transformers")
    tokens = torch.arange(3, 27).unsqueeze(0)
    with torch.no_grad():
        got, expected = (
            transformers.AutoModelForCausalLM.from_pretrained(d)(tokens).logits
            for d in (directory, expected_directory)
        )
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-4)


@needs_tensorboard
@pytest.mark.parametrize(
    "grouped, layout",
    [(False, dict(tp=2)), (True, dict(tp=2)), (True, dict(pp=2))],
    ids=["tp2-sequential-experts", "tp2-grouped-experts", "pp2-grouped-experts"],
)
def test_fsdp_moe_with_model_parallelism_trains_like_the_oracle(
    grouped, layout, run_distributed, run_once, tiny_configs, tmp_path
):
    """MoE at EP = 2 under TP = 2 x DP = 2 (experts: EP = 2 x expert-TP = 2) or PP = 2 x DP = 2:
    the oracle's losses, norms, parameter count, sample and final weights, experts by their
    global index."""
    moe = dict(MOE, moe_grouped_gemm=grouped)
    oracle, norms = _oracle(run_distributed, run_once, tiny_configs, tmp_path / "oracle", layout, **moe)
    configs = tiny_configs(tmp_path / "fsdp", 3, fsdp=True, **layout, **LAYOUT)
    configs.model = dataclasses.replace(configs.model, **moe, expert_model_parallel_size=2)
    report, fsdp_norms = _run(run_distributed, configs, 4)
    assert "EP=2" in report["layout"] and "FSDP" in report["layout"]
    assert fsdp_norms == pytest.approx(norms, rel=1e-4) and len(norms) == 3
    assert report["parameters"] == oracle["parameters"]
    assert report["sample"] == oracle["sample"] is not None
    assert_same_training(report, oracle)


@pytest.mark.parametrize("saved_at", [dict(tp=2), dict(pp=2)], ids=["tp2", "pp2"])
def test_fsdp_checkpoint_continues_at_another_model_parallel_layout_and_back(
    saved_at, run_distributed, tiny_configs, checkpoint_at, tmp_path
):
    """FSDP at TP = 2 or PP = 2 (4 ranks) -> FSDP at TP = PP = 1 on 2 ranks (another strategy) at
    iteration 2 -> TP = 2 with SP (from TP) or PP = 2 (from PP) again at iteration 4, each with the
    uninterrupted run's losses and final weights."""
    layout = dict(global_batch=8, fsdp=True, save_interval=2)
    whole, _ = _run(run_distributed, _swiglu(tiny_configs(tmp_path / "first", 5, **saved_at, **layout)), 4)
    source = checkpoint_at(tmp_path / "first" / "checkpoints", 2, tmp_path / "at-2")
    configs = tiny_configs(tmp_path / "second", 5, load=str(source), fsdp_strategy="optim", **layout)
    resumed, _ = _run(run_distributed, _swiglu(configs), 2)
    assert resumed["resumed_from"] == 2
    torch.testing.assert_close(train_losses(resumed)[2:], train_losses(whole)[2:], rtol=1e-4, atol=0)
    _assert_same_weights(resumed, whole)
    at_4 = checkpoint_at(tmp_path / "second" / "checkpoints", 4, tmp_path / "at-4")
    again_at = dict(tp=2, sp=True) if "tp" in saved_at else saved_at
    configs = tiny_configs(tmp_path / "again", 5, load=str(at_4), **again_at, **layout)
    again, _ = _run(run_distributed, _swiglu(configs), 4)
    assert again["resumed_from"] == 4 and again["iterations_run"] == 1
    torch.testing.assert_close(train_losses(again)[4:], train_losses(whole)[4:], rtol=1e-4, atol=0)
    _assert_same_weights(again, whole)
