"""``--export-hf``, ``--straggler-detection`` and ``--save-grads-interval`` after one tiny run."""

import pytest
import torch
from mcore_models.data import Tokenizer
from mcore_models.training import pretrain
from mcore_parallel import StragglerDetectionConfig

transformers = pytest.importorskip("transformers")


def test_export_straggler_report_and_gradient_files(
    run_distributed, tiny_configs, checkpoint_logits, tmp_path
):
    hf_dir = tmp_path / "hf"
    configs = tiny_configs(tmp_path / "run", 3, export_hf=str(hf_dir), save_grads_interval=2)
    configs.straggler = StragglerDetectionConfig(enabled=True, report_time_interval=1e-6)
    (report,) = [r for r in run_distributed(pretrain, 2, configs, timeout=120) if r is not None]

    # Hugging Face export: the same logits as our model with the final checkpoint's weights
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    tokens = torch.randint(0, hf.config.vocab_size, (1, 24), generator=torch.Generator().manual_seed(0))
    (ours,) = run_distributed(
        checkpoint_logits, 1, configs, hf.config.vocab_size, str(tmp_path / "run" / "checkpoints"), tokens
    )
    with torch.no_grad():
        theirs = hf(tokens).logits
    torch.testing.assert_close(theirs, ours, rtol=0, atol=1e-4)
    # ... whose eos and pad ids are the tokenizer's end-of-document and pad ids, in both config files
    tokenizer = Tokenizer.from_file(configs.data.tokenizer_file)
    for loaded in (hf.config, transformers.GenerationConfig.from_pretrained(hf_dir)):
        ids = (loaded.bos_token_id, loaded.eos_token_id, loaded.pad_token_id)
        assert ids == (None, tokenizer.eod_id, tokenizer.pad_id)

    # straggler detection: a report per iteration (interval 1 µs) with both ranks' step times
    reports = report["straggler_reports"]
    assert [r["iteration"] for r in reports] == [1, 2, 3]
    assert all(len(r["step_times"]) == 2 and min(r["step_times"]) > 0 for r in reports)

    # gradients of iteration 2 only, both ranks, named like the parameters; each rank's own (before
    # the data-parallel reduction), so they differ between the ranks' different samples
    grads = tmp_path / "run" / "grads"
    assert sorted(p.name for p in grads.iterdir()) == ["iter_0000002"]
    rank0, rank1 = (torch.load(grads / "iter_0000002" / f"rank_{r}.pt") for r in (0, 1))
    assert set(rank0["wgrad"]) == {"0.embedding.word_embeddings.weight", "0.output_layer.weight"} | {
        f"0.decoder.layers.{i}.{name}"
        for i in range(4)
        for name in (
            "self_attention.linear_qkv.weight", "self_attention.linear_proj.weight",
            "mlp.linear_fc1.weight", "mlp.linear_fc2.weight",
        )
    }  # fmt: skip
    for name, grad in rank0["wgrad"].items():
        assert grad.shape == rank1["wgrad"][name].shape and not torch.equal(grad, rank1["wgrad"][name])
        assert torch.isfinite(grad).all() and grad.abs().sum() > 0
    assert rank0["wgrad"]["0.output_layer.weight"].shape == (hf.config.vocab_size, 32)
    assert rank0["dgrad_output"]["0.decoder.layers.0.mlp.linear_fc2"][0].shape[-1] == 32
