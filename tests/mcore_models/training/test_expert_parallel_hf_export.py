"""``--export-hf`` with expert parallelism: the checkpoint an EP = 2 run writes is, tensor for
tensor, the one an EP = 1 run writes from the same weights (its final checkpoint, loaded at EP = 1
and exported without training further), and ``transformers`` reloads it with our model's logits;
likewise with experts split over expert-tensor-parallel ranks (ETP = 2)."""

import dataclasses

import pytest
import torch
from mcore_models.training import pretrain
from safetensors.torch import load_file

transformers = pytest.importorskip("transformers")

MOE = dict(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=16)


def _moe_configs(tiny_configs, output, ep, grouped, tp, fsdp=False, **training):
    configs = tiny_configs(output, 2, tp=tp, global_batch=8, fsdp=fsdp, **training)
    configs.model = dataclasses.replace(
        configs.model, **MOE, expert_model_parallel_size=ep, moe_grouped_gemm=grouped
    )
    return configs


def _exported(directory) -> dict[str, torch.Tensor]:
    weights = {}
    for path in sorted(directory.glob("*.safetensors")):
        weights |= load_file(path)
    return weights


def _export_then_reexport(run_distributed, split, world, one, one_world, split_dir, one_dir):
    """Run ``split`` (training, exporting to ``split_dir``) on ``world`` ranks, then ``one`` (loading
    its final checkpoint, exporting to ``one_dir`` without training) on ``one_world``; assert the two
    exports hold the same tensors, bit for bit."""
    run_distributed(pretrain, world, split, timeout=120)
    (report,) = [r for r in run_distributed(pretrain, one_world, one, timeout=120) if r is not None]
    assert report["resumed_from"] == 2 and report["iterations_run"] == 0
    ours, reference = _exported(split_dir), _exported(one_dir)
    assert ours.keys() == reference.keys()
    for name, tensor in reference.items():
        assert torch.equal(ours[name], tensor), name
    return ours


@pytest.mark.parametrize(
    "grouped, tp, world, fsdp",
    [
        (False, 1, 2, False),
        (True, 1, 2, False),
        (False, 2, 4, False),
        (True, 1, 4, False),
        (True, 1, 4, True),
    ],
    ids=["sequential-experts", "grouped-experts", "tp2", "expert-dp2", "fsdp-expert-dp2"],
)
def test_ep2_export_equals_the_ep1_export_of_the_same_weights(
    grouped, tp, world, fsdp, run_distributed, tiny_configs, checkpoint_logits, tmp_path
):
    """EP = 2 on 2 ranks, with TP = 2 on 4, and with 2 copies of every expert (expert-DP = 2:
    only the ranks of data-parallel rank 0's expert-parallel group export), also under mcore-fsdp."""
    if fsdp:
        pytest.importorskip("mcore_fsdp")
    ep2 = _moe_configs(
        tiny_configs, tmp_path / "ep2", 2, grouped, tp, fsdp, export_hf=str(tmp_path / "hf-ep2")
    )
    checkpoints = str(tmp_path / "ep2" / "checkpoints")
    ep1 = _moe_configs(
        tiny_configs,
        tmp_path / "ep1",
        1,
        grouped,
        tp,
        fsdp,
        export_hf=str(tmp_path / "hf-ep1"),
        load=checkpoints,
    )
    ours = _export_then_reexport(
        run_distributed, ep2, world, ep1, tp, tmp_path / "hf-ep2", tmp_path / "hf-ep1"
    )
    assert "model.layers.3.block_sparse_moe.experts.3.w2.weight" in ours  # Mixtral, every expert

    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf-ep2").eval()
    assert hf.config.model_type == "mixtral" and hf.config.num_local_experts == 4
    if fsdp:  # checkpoint_logits reads DDP checkpoints; the FSDP export at EP = 1 is the oracle above
        return
    tokens = torch.randint(0, hf.config.vocab_size, (1, 24), generator=torch.Generator().manual_seed(0))
    (logits,) = run_distributed(checkpoint_logits, 1, ep2, hf.config.vocab_size, checkpoints, tokens)
    with torch.no_grad():
        torch.testing.assert_close(hf(tokens).logits, logits, rtol=0, atol=1e-4)


@pytest.mark.parametrize(
    "ep, world, grouped, fsdp",
    [(1, 2, False, False), (2, 4, True, False), (1, 2, False, True)],
    ids=["etp2-sequential", "etp2-ep2-grouped", "fsdp-etp2-sequential"],
)
def test_etp2_export_equals_the_one_process_export_of_the_same_weights(
    ep, world, grouped, fsdp, run_distributed, tiny_configs, tmp_path
):
    """Experts split over 2 expert-TP ranks (the dense data-parallel ranks at TP = 1; with EP = 2 on
    4 ranks): those ranks take part, one writes, and the files are those one process writes
    from the run's final checkpoint; also under mcore-fsdp (one process loading with it too)."""
    if fsdp:
        pytest.importorskip("mcore_fsdp")
    split = _moe_configs(
        tiny_configs, tmp_path / "etp2", ep, grouped, 1, fsdp, export_hf=str(tmp_path / "hf-etp2")
    )
    split.model = dataclasses.replace(split.model, expert_tensor_parallel_size=2)
    checkpoints = str(tmp_path / "etp2" / "checkpoints")
    one = _moe_configs(
        tiny_configs,
        tmp_path / "one",
        1,
        grouped,
        1,
        fsdp,
        export_hf=str(tmp_path / "hf-one"),
        load=checkpoints,
    )
    _export_then_reexport(run_distributed, split, world, one, 1, tmp_path / "hf-etp2", tmp_path / "hf-one")
