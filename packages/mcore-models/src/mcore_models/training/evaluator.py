"""``HeldoutEvaluator``: the held-out loss and perplexity of the model being trained."""

from __future__ import annotations

from .evaluation import evaluate
from .model_setup import TrainModel
from .run_context import RunContext


class HeldoutEvaluator:
    """``evaluate`` over the first ``eval_iters`` global batches of ``heldout`` (always the same)."""

    def __init__(self, context: RunContext, model: TrainModel, heldout):
        self.context, self.model, self.heldout = context, model, heldout

    def __call__(self) -> dict[str, float]:
        """``{"loss", "perplexity"}`` (collective)."""
        context, training = self.context, self.context.configs.training
        return evaluate(
            self.model,
            self.heldout,
            training.eval_iters,
            training.global_batch_size,
            training.micro_batch_size,
            context.groups,
            context.device,
            context.dtype,
        )
