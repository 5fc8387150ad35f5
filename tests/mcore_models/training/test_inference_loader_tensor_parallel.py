"""``load_checkpoint_for_inference`` splits an mcore-train checkpoint over a tensor-parallel group:
saved at TP = 1, at TP = 2 with a vocabulary padding TP = 1 would not use, or with ``--fsdp`` (a
gated fc1 stored whole; at TP = 1 or 2, whose slices it stores whole), the model loaded at TP = 2 gives the logits of the whole model loaded on
one process (oracle, max abs error <= 1e-5); a TP size its vocabulary rows do not split over is
refused before any weight is read."""

import dataclasses

import pytest
import torch
from mcore_models import load_checkpoint_for_inference
from mcore_models.training import pretrain
from mcore_testing.distributed import DistributedTestError


def _load_and_run(path, tokens, tp):
    """This rank's logits of ``tokens`` from the checkpoint loaded at TP = ``tp``."""
    from mcore_parallel import initialize_model_parallel

    groups = initialize_model_parallel(tensor_model_parallel_size=tp)
    loaded = load_checkpoint_for_inference(path, pg_collection=groups)
    assert loaded.config.tensor_model_parallel_size == tp
    with torch.no_grad():
        logits = loaded.model(tokens, position_ids=torch.arange(tokens.shape[1]).unsqueeze(0))
    return logits.numpy()


@pytest.mark.parametrize(
    "tp, fsdp",
    [(1, False), (2, False), (1, True), (2, True)],
    ids=["saved-at-tp1", "saved-at-tp2", "saved-with-fsdp", "saved-with-fsdp-at-tp2"],
)
def test_checkpoint_loaded_at_tp2_equals_the_whole_model(tp, fsdp, run_distributed, tiny_configs, tmp_path):
    if fsdp:
        pytest.importorskip("mcore_fsdp")
    configs = tiny_configs(tmp_path / "run", 1, tp=tp, fsdp=fsdp)
    if tp == 2:  # 300 -> 308 rows, which TP = 2 splits
        configs.model = dataclasses.replace(configs.model, make_vocab_size_divisible_by=7)
    run_distributed(pretrain, 2, configs, timeout=120)
    save_dir = tmp_path / "run" / "checkpoints"
    tokens = torch.randint(0, 300, (2, 12), generator=torch.Generator().manual_seed(0))

    (whole,) = run_distributed(_load_and_run, 1, save_dir, tokens, 1, timeout=120)
    assert whole.shape == (2, 12, 300)
    for logits in run_distributed(_load_and_run, 2, save_dir, tokens, 2, timeout=120):
        torch.testing.assert_close(torch.from_numpy(logits), torch.from_numpy(whole), rtol=0, atol=1e-5)

    if tp == 2:  # 308 rows do not split over 3 ranks: refused naming the field, before the weights
        with pytest.raises(DistributedTestError, match=r"tensor_model_parallel_size: .* 308 rows"):
            run_distributed(_load_and_run, 3, save_dir, tokens, 3, timeout=120)
