"""The repetition penalty of ``mcore-train``'s greedy sample: Hugging Face's definition."""

import pytest
import torch
from mcore_models.training import TrainingConfig, greedy_generate
from mcore_models.training.generation import _next_token
from mcore_parallel import ConfigError


def _batch(seen: list[int], penalty: float) -> dict:
    return {"last_position": 0, "seen": tuple(seen), "repetition_penalty": penalty}


def test_penalty_by_hand():
    logits = torch.tensor([[[2.0, -1.0, 1.5, 0.5]]])
    assert _next_token(logits, _batch([0, 1], 1.0)).item() == 0  # plain greedy
    # ids 0 and 1 seen: 2.0 / 2 = 1.0 and -1.0 * 2 = -2.0, so id 2 (1.5) wins
    assert _next_token(logits, _batch([0, 1], 2.0)).item() == 2


def test_penalty_matches_hugging_face():
    processors = pytest.importorskip(
        "transformers.generation.logits_process", reason="transformers not installed"
    )
    generator = torch.Generator().manual_seed(0)
    for penalty in (1.2, 1.7, 0.8):
        for _ in range(20):
            logits = torch.randn(1, 3, 50, generator=generator)
            context = torch.randint(0, 50, (1, 12), generator=generator)
            expected = processors.RepetitionPenaltyLogitsProcessor(penalty)(context, logits[:, 1].clone())
            seen = tuple(context[0].unique().tolist())
            batch = {"last_position": 1, "seen": seen, "repetition_penalty": penalty}
            assert _next_token(logits, batch).item() == expected.argmax().item()


def test_bad_penalty_is_refused():
    with pytest.raises(ConfigError, match="sample_repetition_penalty"):
        TrainingConfig(sample_repetition_penalty=0.0)
    with pytest.raises(ValueError, match="repetition_penalty must be > 0"):
        greedy_generate(None, [1], 4, None, torch.device("cpu"), repetition_penalty=-1.0)
