"""Self-describing mcore-train checkpoints: each iteration directory holds the model config, the
tokenizer and the run's configs, and ``load_checkpoint_for_inference`` rebuilds the trained model
from it alone, whole, whatever tensor-parallel size saved it.

Oracle: the model in memory at the end of training, written by ``--export-hf`` and run by
``transformers`` (fp32, max abs error <= 1e-4); for layouts the export does not take (PP = 2, MoE at
EP = 2) the same weights read through the training resume path.
"""

import dataclasses
import json
import shutil

import pytest
import torch
from mcore_models import (
    CheckpointConfigMissingError,
    load_checkpoint_for_inference,
    missing_inference_members,
)
from mcore_models.data import Tokenizer
from mcore_models.training import pretrain
from mcore_testing.distributed import DistributedTestError

transformers = pytest.importorskip("transformers")


def _load_and_run(path, tokens, dtype=torch.float32):
    """In a fresh process (no process group yet): the loader's logits of ``tokens`` and what it returned."""
    loaded = load_checkpoint_for_inference(path, dtype=dtype)
    with torch.no_grad():
        logits = loaded.model(tokens, position_ids=torch.arange(tokens.shape[1]).unsqueeze(0)).float()
    facts = {
        "tp": loaded.config.tensor_model_parallel_size,
        "missing_inference_members": missing_inference_members(loaded.model),
        "nonzero_expert_biases": sum(
            bool(t.any()) for name, t in loaded.model.named_buffers() if name.endswith("expert_bias")
        ),
        "training": loaded.model.training,
        "dtype": str(next(loaded.model.parameters()).dtype),
        "device": str(next(loaded.model.parameters()).device),
        "source": loaded.source,
        "directory": str(loaded.directory),
        "eos": loaded.model.eos_token_ids,
        "encoded": loaded.tokenizer.encode("def f(x):\n    return x"),
        "eod_pad": (loaded.tokenizer.eod_id, loaded.tokenizer.pad_id),
    }
    return logits.numpy(), facts


@pytest.mark.parametrize(
    "tp, fsdp",
    [(1, False), (2, False), (1, True)],
    ids=["saved-at-tp1-dp2", "saved-at-tp2", "saved-with-fsdp"],
)
def test_loader_rebuilds_the_trained_model(tp, fsdp, run_distributed, tiny_configs, tmp_path):
    if fsdp:
        pytest.importorskip("mcore_fsdp")
    hf_dir = tmp_path / "hf"
    configs = tiny_configs(tmp_path / "run", 2, tp=tp, export_hf=str(hf_dir), fsdp=fsdp)
    if tp == 2:  # vocabulary padded at TP=2 (300 -> 308 rows) to a size TP=1 would not pad it to
        configs.model = dataclasses.replace(configs.model, make_vocab_size_divisible_by=7)
    run_distributed(pretrain, 2, configs, timeout=120)
    save_dir = tmp_path / "run" / "checkpoints"
    iteration_dir = save_dir / "iter_0000002"

    tokenizer = Tokenizer.from_file(configs.data.tokenizer_file)
    model_config = json.loads((iteration_dir / "model_config.json").read_text())
    assert model_config["schema_version"] == 1 and model_config["vocab_size"] == tokenizer.vocab_size
    assert model_config["transformer_config"]["tensor_model_parallel_size"] == tp
    assert model_config["transformer_config"]["num_query_groups"] == 2
    train_config = json.loads((iteration_dir / "train_config.json").read_text())
    assert train_config["configs"]["training"]["train_iters"] == 2
    assert train_config["configs"]["data"]["tokenizer_file"] == configs.data.tokenizer_file

    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    tokens = torch.randint(0, tokenizer.vocab_size, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = hf(tokens).logits
    for path in (save_dir, iteration_dir):  # the latest iteration of the save directory, or one iteration
        ((logits, facts),) = run_distributed(_load_and_run, 1, path, tokens, init_process_group=False)
        torch.testing.assert_close(torch.from_numpy(logits), expected, rtol=0, atol=1e-4)
        assert facts == {
            "tp": 1,
            "missing_inference_members": [],
            "nonzero_expert_biases": 0,
            "training": False,
            "dtype": "torch.float32",
            "device": "cpu",
            "source": "mcore-train",
            "directory": str(iteration_dir),
            "eos": (tokenizer.eod_id,),
            "encoded": tokenizer.encode("def f(x):\n    return x"),
            "eod_pad": (tokenizer.eod_id, tokenizer.pad_id),
        }

    # bfloat16: the trained float32 weights rounded, logits close to the float32 ones
    ((logits, facts),) = run_distributed(
        _load_and_run, 1, save_dir, tokens, torch.bfloat16, init_process_group=False
    )
    assert facts["dtype"] == "torch.bfloat16"
    torch.testing.assert_close(torch.from_numpy(logits), expected, rtol=0, atol=0.05)

    # a model config that does not describe the tensors: refused, naming what is missing
    mismatched = tmp_path / "mismatched"
    shutil.copytree(iteration_dir, mismatched)
    model_config["transformer_config"]["num_layers"] = 5
    (mismatched / "model_config.json").write_text(json.dumps(model_config))
    with pytest.raises(
        DistributedTestError, match=r"lacks \d+ tensors .* e\.g\. \['model\.decoder\.layers\.4\."
    ):
        run_distributed(load_checkpoint_for_inference, 1, mismatched, init_process_group=False)

    # a checkpoint of an mcore-models before self-describing checkpoints: the same without the files
    old = tmp_path / "old"
    shutil.copytree(save_dir, old)
    for name in ("model_config.json", "tokenizer.json", "tokenizer_config.json", "train_config.json"):
        (old / "iter_0000002" / name).unlink()
    with pytest.raises(CheckpointConfigMissingError, match=r"without model_config\.json.*--export-hf"):
        load_checkpoint_for_inference(old)


MOE = dict(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=16)
EXPERT_BIAS = dict(moe_router_enable_expert_bias=True, moe_router_bias_update_rate=0.1)


@pytest.mark.parametrize(
    "layout, model",
    [
        (dict(pp=2), {}),
        (dict(), MOE | EXPERT_BIAS | dict(expert_model_parallel_size=2, moe_grouped_gemm=True)),
    ],
    ids=["saved-at-pp2", "moe-expert-bias-saved-at-ep2-grouped"],
)
def test_loader_matches_the_resume_path(
    layout, model, run_distributed, tiny_configs, checkpoint_logits, tmp_path
):
    """Layouts Hugging Face export does not take (PP > 1, EP > 1): oracle is the training resume path."""
    configs = tiny_configs(tmp_path / "run", 2, **layout)
    configs.model = dataclasses.replace(configs.model, **model)
    run_distributed(pretrain, 2, configs, timeout=120)
    save_dir = str(tmp_path / "run" / "checkpoints")
    vocab_size = Tokenizer.from_file(configs.data.tokenizer_file).vocab_size
    tokens = torch.randint(0, vocab_size, (2, 20), generator=torch.Generator().manual_seed(0))
    (expected,) = run_distributed(checkpoint_logits, 1, configs, vocab_size, save_dir, tokens)
    ((logits, facts),) = run_distributed(_load_and_run, 1, save_dir, tokens, init_process_group=False)
    torch.testing.assert_close(torch.from_numpy(logits), expected, rtol=0, atol=1e-6)
    assert facts["tp"] == 1 and not facts["training"]
    # the trained expert biases came with the weights (sign steps of 0.1 may cancel out in some layers)
    assert (facts["nonzero_expert_biases"] > 0) == bool(model)
