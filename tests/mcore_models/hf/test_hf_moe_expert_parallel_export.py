"""``export_hf_checkpoint`` called on a model whose experts are spread over an expert-parallel
group: both ranks call it, one writes, and the files equal the export of the same weights held
by one process (EP = 1), which ``transformers`` reloads with that model's logits."""

import pytest
import torch
import torch.distributed as dist
from mcore_testing.moe_reference import expert_parallel_state, moe_config
from safetensors.torch import load_file

transformers = pytest.importorskip("transformers")

VOCAB = 64
QWEN3_MOE = dict(
    normalization="RMSNorm", position_embedding_type="rope", qk_layernorm=True, num_query_groups=1
)


def _export_body(directory, grouped):
    from mcore_models import GPTModel, export_hf_checkpoint
    from mcore_parallel import ProcessGroupCollection

    world, rank = dist.get_world_size(), dist.get_rank()
    singles = [dist.new_group([r]) for r in range(world)]
    options = QWEN3_MOE | {"moe_grouped_gemm": grouped}
    torch.manual_seed(0)
    reference = GPTModel(moe_config(**options), VOCAB, pg_collection=ProcessGroupCollection(tp=singles[rank]))
    groups = ProcessGroupCollection(tp=singles[rank], ep=dist.group.WORLD)
    model = GPTModel(moe_config(**options, expert_model_parallel_size=world), VOCAB, pg_collection=groups)
    local = 4 // world
    model.load_state_dict(expert_parallel_state(reference.state_dict(), rank * local, local))
    export_hf_checkpoint(model, directory / "ep", model_type="qwen3_moe")
    if rank == 0:
        export_hf_checkpoint(reference, directory / "one-process", model_type="qwen3_moe")
    ids = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return ids, reference.eval()(ids)


@pytest.mark.parametrize("grouped", [False, True], ids=["sequential-experts", "grouped-experts"])
def test_export_of_an_expert_parallel_model_equals_the_one_process_export(
    grouped, run_distributed, hf_logits, tmp_path
):
    (ids, logits), _ = run_distributed(_export_body, 2, tmp_path, grouped, timeout=60)
    ours, reference = (load_file(tmp_path / d / "model.safetensors") for d in ("ep", "one-process"))
    assert ours.keys() == reference.keys()
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in ours
    for name, tensor in reference.items():
        assert torch.equal(ours[name], tensor), name
    torch.testing.assert_close(hf_logits(tmp_path / "ep", ids), logits, rtol=0, atol=1e-4)


@pytest.mark.parametrize("family", ["llama", "qwen3", "mistral", "gpt2"])
def test_dense_families_refuse_a_model_with_moe_layers(family):
    """Exporting one as a dense family would drop its experts."""
    from mcore_models.hf.registry import mapping_for

    with pytest.raises(ValueError, match=f"^{family} has dense MLPs; export a model with MoE layers as"):
        mapping_for(family).config_to_hf(moe_config(**QWEN3_MOE), VOCAB)


def _mismatched_sizes_body(directory):
    from mcore_models import GPTModel, export_hf_checkpoint, import_hf_checkpoint
    from mcore_parallel import ProcessGroupCollection

    one = ProcessGroupCollection(tp=dist.group.WORLD, ep=dist.group.WORLD)  # a single rank
    export_hf_checkpoint(GPTModel(moe_config(**QWEN3_MOE), VOCAB, pg_collection=one), directory, "qwen3_moe")
    (directory / "model.safetensors").unlink()  # refused before any weight is read
    with pytest.raises(ValueError, match=r"expert_tensor_parallel_size \(2\) differs .* group \(1\)"):
        import_hf_checkpoint(directory, pg_collection=one, expert_tensor_parallel_size=2)
    with pytest.raises(ValueError, match=r"expert_model_parallel_size \(2\) differs .* group \(1\)"):
        import_hf_checkpoint(directory, pg_collection=one, expert_model_parallel_size=2)


def test_import_refuses_expert_sizes_the_process_groups_do_not_have(run_distributed, tmp_path):
    """Experts split over expert-TP ranks import (``test_hf_moe_parity``, ``test_hf_gpt_oss``), but
    only at the sizes of the process groups given."""
    run_distributed(_mismatched_sizes_body, 1, tmp_path, timeout=60)
