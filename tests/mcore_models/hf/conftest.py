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
