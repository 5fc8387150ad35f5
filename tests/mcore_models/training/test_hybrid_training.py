"""``mcore-train`` with ``hybrid_layer_pattern``: a hybrid Mamba/attention/MLP/MoE model trains at
TP 2, DP 2 with the distributed optimizer and with mcore-fsdp exactly as on one process, and its
checkpoints continue at other layouts (PP 2 with uneven ``|`` stages, DP 2 from TP 2, mcore-fsdp
at TP 2) with the one-process run's losses (fp32; summation order differs, rtol 1e-5). The
checkpoint describes the hybrid model: a resume, the serving loader and the NemotronH export need
no flags; an export NemotronH cannot express is refused before training. Bad or incompatible
hybrid flags fail when parsed, naming the fields.
"""

import dataclasses

import pytest
import torch
from mcore_models.checkpoints.inference_loader import load_checkpoint_for_inference
from mcore_models.models.hybrid import HybridModel, import_nemotron_h
from mcore_models.training import TrainModelConfig, pretrain
from mcore_models.training.cli import parse_train_args
from mcore_parallel import ConfigError, destroy_model_parallel, initialize_model_parallel
from mcore_testing.distributed import DistributedTestError

# a model NemotronH can express (so --export-hf works), Mamba heads and groups split over TP 2
HYBRID = dict(
    num_layers=4,
    ffn_hidden_size=48,
    activation="squared_relu",
    position_embedding_type="none",
    num_moe_experts=4,
    moe_router_score_function="sigmoid",
    moe_router_enable_expert_bias=True,
    moe_router_load_balancing_type="none",
    moe_shared_expert_intermediate_size=24,
    mamba_num_heads=8,
    mamba_head_dim=8,
    mamba_num_groups=2,
    mamba_state_dim=8,
    mamba_chunk_size=16,
    mamba_dt_clamp_min=0.01,
)
TOLERANCE = dict(rtol=1e-5, atol=0)


def _hybrid(configs, pattern="M*-E"):
    configs.model = dataclasses.replace(configs.model, **HYBRID, hybrid_layer_pattern=pattern)
    return configs


def _losses(run_distributed, configs, world_size):
    (report,) = [r for r in run_distributed(pretrain, world_size, configs, timeout=120) if r is not None]
    return torch.tensor([loss for _, loss in report["history"]["train"]]), report


def _one_process(run_distributed, tiny_configs, tmp_path, **options):
    """The one-process reference run (saving at step 2) and its four losses."""
    one = _hybrid(tiny_configs(tmp_path / "one", 4, save_interval=2, **options))
    expected, report = _losses(run_distributed, one, 1)
    assert len(set(expected.tolist())) == 4  # it trained
    return one, expected, report


def _check_layouts(run_distributed, tiny_configs, checkpoint_at, tmp_path, expected, layouts, resumes):
    """Each of ``layouts`` trains with ``expected`` losses; each of ``resumes`` continues the
    checkpoint a named run saved at step 2 with them."""
    for name, (world, layout) in layouts.items():
        losses, _ = _losses(run_distributed, _hybrid(tiny_configs(tmp_path / name, 4, **layout)), world)
        torch.testing.assert_close(losses, expected, **TOLERANCE, msg=name)
    for name, (source, layout, pattern) in resumes.items():
        at_2 = checkpoint_at(tmp_path / source / "checkpoints", 2, tmp_path / f"{name}-at-2")
        configs = _hybrid(tiny_configs(tmp_path / name, 4, load=str(at_2), **layout), pattern)
        losses, report = _losses(run_distributed, configs, 2)
        assert report["resumed_from"] == 2, name
        torch.testing.assert_close(losses, expected, **TOLERANCE, msg=name)  # 1-2 from the history


def test_layouts_and_resumes_train_as_one_process(run_distributed, tiny_configs, checkpoint_at, tmp_path):
    export = tmp_path / "hf"
    one, expected, report = _one_process(
        run_distributed, tiny_configs, tmp_path, sample_tokens=4, export_hf=str(export)
    )
    assert report["sample"] is not None  # it generates
    layouts = {
        "tp2": (2, dict(tp=2, save_interval=2)),
        "dp2-distributed-optimizer": (2, dict(distributed_optimizer=True)),
    }
    # pipeline stages draw other initial weights: PP continues the one-process checkpoint
    resumes = {
        "pp2-uneven": ("one", dict(pp=2), "M*-|E"),  # stages of 3 and 1 layers
        "dp2-from-tp2": ("tp2", dict(), "M*-E"),
    }
    _check_layouts(run_distributed, tiny_configs, checkpoint_at, tmp_path, expected, layouts, resumes)

    # the checkpoint describes the model: a resume without flags, the serving loader, the export
    resumed = parse_train_args(["--load", str(tmp_path / "tp2" / "checkpoints")]).model
    assert resumed.hybrid_layer_pattern == "M*-E" and resumed.mamba == one.model.mamba
    served, exported = run_distributed(
        _served_and_exported_logits, 1, tmp_path / "one" / "checkpoints", export
    )[0]
    torch.testing.assert_close(exported, served, rtol=1e-5, atol=1e-5)


def test_fsdp_trains_and_resumes_as_one_process(run_distributed, tiny_configs, checkpoint_at, tmp_path):
    pytest.importorskip("mcore_fsdp", reason="mcore-fsdp (the fsdp extra) is not installed")
    _, expected, _ = _one_process(run_distributed, tiny_configs, tmp_path)
    layouts = {"fsdp-dp2": (2, dict(fsdp=True, save_interval=2))}
    resumes = {"fsdp-tp2-from-fsdp-dp2": ("fsdp-dp2", dict(tp=2, fsdp=True), "M*-E")}
    _check_layouts(run_distributed, tiny_configs, checkpoint_at, tmp_path, expected, layouts, resumes)


def _served_and_exported_logits(checkpoints, export):
    ids = torch.arange(1, 17).unsqueeze(0)
    groups = initialize_model_parallel()
    try:
        served = load_checkpoint_for_inference(checkpoints, pg_collection=groups).model
        assert isinstance(served, HybridModel) and served.pattern.symbols == "M*-E"
        exported = import_nemotron_h(export, pg_collection=groups).eval()
        exported.parallel_output = False
        with torch.no_grad():
            return served(ids), exported(ids)
    finally:
        destroy_model_parallel()


def test_export_that_nemotron_h_cannot_express_fails_before_training(run_distributed, tiny_configs, tmp_path):
    configs = _hybrid(tiny_configs(tmp_path / "run", 4, export_hf=str(tmp_path / "hf")))
    configs.model = dataclasses.replace(configs.model, activation="swiglu")
    with pytest.raises(DistributedTestError, match="NemotronH cannot express activation='swiglu'"):
        run_distributed(pretrain, 1, configs, timeout=60)
    assert not (tmp_path / "run" / "checkpoints").exists()


BAD_FLAGS = [
    (dict(hybrid_layer_pattern="M*X-"), ["hybrid_layer_pattern"], "unknown symbol 'X'"),
    (
        dict(hybrid_layer_pattern="M*|-E", **HYBRID),
        ["hybrid_layer_pattern", "pipeline_model_parallel_size"],
        "2 pipeline stages",
    ),
    (
        dict(hybrid_layer_pattern="M*-", num_layers=3, pipeline_model_parallel_size=2),
        ["hybrid_layer_pattern", "pipeline_model_parallel_size"],
        "split evenly",
    ),
    (dict(hybrid_layer_pattern="M*-E"), ["num_moe_experts", "hybrid_layer_pattern"], "MoE layers"),
    (
        dict(hybrid_layer_pattern="M*-", num_layers=4),
        ["num_layers", "hybrid_layer_pattern"],
        "num_layers \\(4\\) differs",
    ),
    (
        dict(hybrid_layer_pattern="M*-", num_layers=3, context_parallel_size=2),
        ["context_parallel_size", "hybrid_layer_pattern"],
        "context parallelism",
    ),
    (dict(mamba_state_dim=16), ["mamba_state_dim", "hybrid_layer_pattern"], "Mamba layers"),
    (dict(mamba_conv_init=0.1), ["mamba_conv_init", "hybrid_layer_pattern"], "Mamba layers"),
    (
        dict(hybrid_layer_pattern="*-", num_layers=2, mamba_head_dim=32),
        ["mamba_head_dim", "hybrid_layer_pattern"],
        "Mamba layers",
    ),
    (
        dict(
            hybrid_layer_pattern="M*",
            num_layers=2,
            hidden_size=32,
            mamba_head_dim=8,
            mamba_num_groups=1,
            tensor_model_parallel_size=2,
        ),
        ["mamba_num_heads", "mamba_num_groups", "tensor_model_parallel_size"],
        "tensor-parallel size",
    ),
]


@pytest.mark.parametrize(("flags", "fields", "match"), BAD_FLAGS)
def test_bad_hybrid_flags_fail_naming_the_fields(flags, fields, match):
    with pytest.raises(ConfigError, match=match) as error:
        TrainModelConfig(**flags)
    assert error.value.fields == tuple(fields)


def test_num_layers_follows_the_pattern_unless_given():
    argv = "--hybrid-layer-pattern M*-E|M* --pipeline-model-parallel-size 2 --num-moe-experts 4 "
    argv += "--mamba-head-dim 32"
    model = parse_train_args(argv.split()).model
    assert (model.num_layers, model.mamba.mamba_head_dim) == (6, 32)
    with pytest.raises(ConfigError, match="num_layers \\(5\\) differs"):
        parse_train_args([*argv.split(), "--num-layers", "5"])


def test_mamba_init_and_clamp_flags_reach_the_model():
    argv = "--hybrid-layer-pattern M* --num-layers 2 --mamba-head-dim 32 "
    argv += "--mamba-conv-init 0.05 --mamba-dt-clamp-min 0.01 --mamba-dt-clamp-max 0.5"
    mamba = parse_train_args(argv.split()).model.mamba
    assert (mamba.mamba_conv_init, mamba.mamba_dt_clamp_min, mamba.mamba_dt_clamp_max) == (0.05, 0.01, 0.5)
    with pytest.raises(ConfigError, match="mamba_conv_init: must be a finite number > 0") as error:
        parse_train_args([*argv.split(), "--mamba-conv-init", "0"])
    assert error.value.fields == ("mamba_conv_init",)
    with pytest.raises(ConfigError, match=r"need mamba_dt_clamp_min \(0.01\) < mamba_dt_clamp_max") as error:
        parse_train_args([*argv.split(), "--mamba-dt-clamp-max", "0.005"])
    assert error.value.fields == ("mamba_dt_clamp_min", "mamba_dt_clamp_max")
