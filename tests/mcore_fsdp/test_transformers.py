"""mcore-fsdp in a foreign trainer: the example trains a Hugging Face Llama in a plain loop.

Oracle: the same random-weight model trained in one process on the whole batch (same AdamW,
same clipping). The example is run as written, loaded from packages/mcore-fsdp/examples.
"""

import importlib.util
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("transformers")

EXAMPLE = Path(__file__).resolve().parents[2] / "packages" / "mcore-fsdp" / "examples" / "train_hf_llama.py"


def _example():
    spec = importlib.util.spec_from_file_location("train_hf_llama", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_hf_llama_trains_like_single_process(run_distributed):
    example = _example()

    def body():
        steps, per_rank = 3, 2
        model, losses = example.train(steps=steps, per_rank_batch=per_rank)
        world = dist.get_world_size()
        reference = example.build_model()
        optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-3)
        reference_losses = []
        for step in range(steps):
            tokens = example.token_batch(step, per_rank * world)
            loss = reference(input_ids=tokens, labels=tokens).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
            reference_losses.append(loss.item())
        # Each rank's loss is over its own tokens; their mean is the global loss.
        mean_losses = torch.tensor(losses)
        dist.all_reduce(mean_losses)
        torch.testing.assert_close(mean_losses / world, torch.tensor(reference_losses), rtol=1e-5, atol=1e-6)
        exported = model.full_state_dict()
        expected = reference.state_dict()
        assert set(exported) == set(expected)
        for key, value in expected.items():
            torch.testing.assert_close(exported[key], value, rtol=1e-5, atol=1e-6)
        assert exported["lm_head.weight"].data_ptr() == exported["model.embed_tokens.weight"].data_ptr()
        return losses

    losses = run_distributed(body, 2, timeout=120)
    assert losses[0] != losses[1]  # the ranks really saw different data


def test_example_imports_no_other_mcore_package():
    source = EXAMPLE.read_text()
    imported = {
        line.split()[1].split(".")[0] for line in source.splitlines() if line.startswith(("import ", "from "))
    }
    assert {name for name in imported if name.startswith("mcore")} == {"mcore_fsdp"}
