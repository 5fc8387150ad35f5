"""Random-weight Hugging Face checkpoints saved once per test module, and the logits of a saved
checkpoint reloaded in Hugging Face."""

import pytest
import torch
from safetensors.torch import load_file


@pytest.fixture(scope="session")
def hf_checkpoint_cache(tmp_path_factory):
    """``hf_checkpoint_cache(cases, vocab, seq)`` -> ``get(case)``: per case of ``cases``
    (``name -> (transformers config class name, kwargs)``), the directory of the saved HF model
    (seed 0, fp32, eager attention), input ids ``[2, seq]`` below ``vocab`` and HF's logits; each
    built on first use."""

    def cache(cases, vocab, seq):
        import transformers

        built = {}

        def get(case: str):
            if case not in built:
                config_class, kwargs = cases[case]
                config = getattr(transformers, config_class)(**kwargs)
                torch.manual_seed(0)
                model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
                model.eval()
                directory = tmp_path_factory.mktemp(case)
                model.save_pretrained(directory)
                ids = torch.randint(0, vocab, (2, seq), generator=torch.Generator().manual_seed(1))
                with torch.no_grad():
                    logits = model(ids).logits
                built[case] = (directory, ids, logits)
            return built[case]

        return get

    return cache


@pytest.fixture(scope="session")
def hf_logits():
    """``hf_logits(directory, ids)``: the logits of the HF model saved in ``directory`` (eager
    attention, no grad), e.g. of a checkpoint mcore exported."""

    def logits(directory, ids):
        import transformers

        model = transformers.AutoModelForCausalLM.from_pretrained(
            directory, attn_implementation="eager"
        ).eval()
        with torch.no_grad():
            return model(ids).logits

    return logits


@pytest.fixture
def moe_import_logits(run_distributed, model_parallel):
    """``moe_import_logits(directory, ids, tp, grouped, exported, timeout, etp=None, ep=1)``: on
    ``max(tp, etp * ep)`` ranks, import the MoE checkpoint in ``directory`` at tensor-parallel size
    ``tp``, expert-tensor-parallel size ``etp`` (``None``: experts whole, replicated over TP) and
    expert-parallel size ``ep`` (grouped or sequential experts and the expert split, checked),
    return each rank's full-vocabulary logits of ``ids``, and export the model to ``exported``."""

    def run(directory, ids, tp, grouped, exported, timeout, etp=None, ep=1):
        sizes = {"expert_model_parallel_size": ep}
        if etp is not None:
            sizes["expert_tensor_parallel_size"] = etp

        def body():
            from mcore_models.hf import export_hf_checkpoint, import_hf_checkpoint
            from mcore_models.transformer.moe import GroupedExperts, MoELayer, SequentialExperts

            groups = model_parallel(tp, **sizes)
            model = import_hf_checkpoint(directory, pg_collection=groups, moe_grouped_gemm=grouped, **sizes)
            moe = model.decoder.layers[0].mlp
            assert isinstance(moe, MoELayer)
            assert isinstance(moe.experts, GroupedExperts if grouped else SequentialExperts)
            assert moe.num_local_experts == moe.config.num_moe_experts // ep
            assert (moe.expert_tp_group is None) == (etp in (None, 1))
            model.parallel_output = False
            with torch.no_grad():
                logits = model(ids)
            export_hf_checkpoint(model, exported)
            return logits.numpy()

        world = max(tp, (etp or 1) * ep)
        return [torch.from_numpy(logits) for logits in run_distributed(body, world, timeout=timeout)]

    return run


@pytest.fixture
def split_experts_parity(moe_import_logits, hf_logits, tmp_path):
    """``split_experts_parity(directory, ids, reference, tolerance, tp, etp, ep, grouped)``: the MoE
    checkpoint in ``directory`` imported with experts split over ``etp`` expert-TP ranks (and spread
    over ``ep`` expert-parallel ranks) gives every rank the logits ``reference`` of ``ids``; its
    export reloads in HF with them and equals, tensor for tensor, the export of a one-process import."""

    def check(directory, ids, reference, tolerance, tp, etp, ep, grouped):
        split, whole = tmp_path / "split", tmp_path / "whole"
        for logits in moe_import_logits(directory, ids, tp, grouped, split, 120, etp=etp, ep=ep):
            assert (logits - reference).abs().max().item() <= tolerance
        assert (hf_logits(split, ids) - reference).abs().max().item() <= tolerance
        moe_import_logits(directory, ids, 1, grouped, whole, 60)
        ours, expected = (load_file(d / "model.safetensors") for d in (split, whole))
        assert ours.keys() == expected.keys()
        for name, tensor in expected.items():
            assert torch.equal(ours[name], tensor), name

    return check
