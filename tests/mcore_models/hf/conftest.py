"""Random-weight Hugging Face checkpoints saved once per test module, and the logits of a saved
checkpoint reloaded in Hugging Face."""

import pytest
import torch


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
    """``moe_import_logits(directory, ids, tp, grouped, exported, timeout)``: on ``tp`` ranks, import
    the MoE checkpoint in ``directory`` (grouped or sequential experts, checked), return each rank's
    full-vocabulary logits of ``ids``, and export the model to ``exported``."""

    def run(directory, ids, tp, grouped, exported, timeout):
        def body():
            from mcore_models.hf import export_hf_checkpoint, import_hf_checkpoint
            from mcore_models.transformer.moe import GroupedExperts, MoELayer, SequentialExperts

            model = import_hf_checkpoint(
                directory, pg_collection=model_parallel(tp), moe_grouped_gemm=grouped
            )
            moe = model.decoder.layers[0].mlp
            assert isinstance(moe, MoELayer)
            assert isinstance(moe.experts, GroupedExperts if grouped else SequentialExperts)
            model.parallel_output = False
            with torch.no_grad():
                logits = model(ids)
            export_hf_checkpoint(model, exported)
            return logits.numpy()

        return [torch.from_numpy(logits) for logits in run_distributed(body, tp, timeout=timeout)]

    return run
