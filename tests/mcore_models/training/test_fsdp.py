"""``--fsdp``: training through mcore-fsdp repeats plain data parallelism, and resumes exactly (dropout
on: the random-number states come back too)."""

import dataclasses

import pytest
import torch
from mcore_models.training import pretrain, resolve_configs
from mcore_parallel import ConfigError

pytest.importorskip("mcore_fsdp")


def _train_losses(run_distributed, configs):
    (report,) = [r for r in run_distributed(pretrain, 2, configs, timeout=120) if r is not None]
    return [loss for _, loss in report["history"]["train"]], report


def test_fsdp_losses_equal_data_parallel_and_resume_exactly(
    run_distributed, tiny_configs, checkpoint_at, tmp_path
):
    plain, _ = _train_losses(
        run_distributed, tiny_configs(tmp_path / "dp", 4, dropout=0.1, export_hf=str(tmp_path / "dp-hf"))
    )
    fsdp, report = _train_losses(
        run_distributed,
        tiny_configs(
            tmp_path / "fsdp", 4, dropout=0.1, save_interval=2, fsdp=True, export_hf=str(tmp_path / "fsdp-hf")
        ),
    )
    assert "FSDP(optim_grads_params)" in report["layout"]
    # fp32; the gradients are summed in another order (reduce-scatter of flat buffers vs all-reduce)
    torch.testing.assert_close(torch.tensor(fsdp), torch.tensor(plain), rtol=1e-5, atol=0)
    # the export gathers the shards: the same model as the plain run's export
    transformers = pytest.importorskip("transformers")
    tokens = torch.arange(3, 27).unsqueeze(0)
    with torch.no_grad():
        dp_logits, fsdp_logits = (
            transformers.AutoModelForCausalLM.from_pretrained(tmp_path / name)(tokens).logits
            for name in ("dp-hf", "fsdp-hf")
        )
    torch.testing.assert_close(fsdp_logits, dp_logits, rtol=0, atol=1e-4)
    resume_from = checkpoint_at(tmp_path / "fsdp" / "checkpoints", 2, tmp_path / "at-2")
    resumed, report = _train_losses(
        run_distributed,
        # another strategy loads it too
        tiny_configs(
            tmp_path / "resumed", 4, dropout=0.1, load=str(resume_from), fsdp=True, fsdp_strategy="optim"
        ),
    )
    assert report["resumed_from"] == 2 and resumed == fsdp


@pytest.mark.parametrize(("world", "experts"), [(2, 1), (4, 2)], ids=["pp2-vpp2", "pp2-vpp2-ep2"])
def test_fsdp_refuses_virtual_pipeline_stages(world, experts, tiny_configs, tmp_path):
    """--fsdp shards one model chunk per pipeline stage: virtual stages are refused, naming the field."""
    configs = tiny_configs(tmp_path, fsdp=True, pp=2, vpp=2, global_batch=8)
    if experts > 1:
        moe = dict(num_moe_experts=4, moe_router_topk=2, expert_model_parallel_size=experts)
        configs.model = dataclasses.replace(configs.model, **moe)
    with pytest.raises(ConfigError) as error:
        resolve_configs(configs, world)
    assert str(error.value).startswith("fsdp, virtual_pipeline_model_parallel_size: ")
    assert "PP without virtual stages works" in str(error.value)
