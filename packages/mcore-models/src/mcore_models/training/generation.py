"""Greedy decoding with the training model: full recompute of the whole sequence per new token.
An optional repetition penalty (Hugging Face's ``repetition_penalty``) lowers the scores of the ids
already in the sequence before the argmax.

Collective over all ranks: each step runs the sequence through the pipeline (forward only), the
last stage picks the most likely token over the full vocabulary, and it is broadcast to every
rank of the pipeline. Data-parallel replicas decode the same tokens. The interleaved schedule
(virtual pipeline stages) runs the sequence as PP identical micro-batches and reads the first.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from mcore_api import experimental_api
from mcore_parallel import ProcessGroupCollection

from .model_setup import TrainModel
from .schedule import run_micro_batches


@experimental_api
def greedy_generate(
    model: TrainModel,
    prompt_ids: list[int],
    new_tokens: int,
    groups: ProcessGroupCollection,
    device: torch.device,
    max_length: int | None = None,
    stop_id: int | None = None,
    dtype: torch.dtype = torch.float32,
    pad_multiple: int = 1,
    repetition_penalty: float = 1.0,
) -> list[int]:
    """``prompt_ids`` followed by up to ``new_tokens`` greedily chosen ids (stops after ``stop_id``).

    With ``repetition_penalty`` above 1, the score of each id already in the sequence (prompt
    included) is divided by it where positive and multiplied by it where negative before the
    argmax, as Hugging Face's ``repetition_penalty``; 1 is plain greedy decoding.

    The context is cut to the last ``max_length`` tokens and right-padded to a multiple of
    ``pad_multiple`` (the TP size under sequence parallelism); causal attention keeps the padding
    from affecting the position that is read."""
    if not repetition_penalty > 0:
        raise ValueError(f"repetition_penalty must be > 0, got {repetition_penalty}")
    ids = list(prompt_ids)
    last_chunk = model.chunks[-1]
    pp = dist.get_world_size(groups.pp)
    # the interleaved schedule runs a multiple of PP micro-batches: the sequence that many times
    copies = pp if len(model.chunks) > 1 else 1
    last_stage_rank = dist.get_global_rank(groups.pp, pp - 1)
    parallel_output = last_chunk.parallel_output
    last_chunk.parallel_output = False  # the full vocabulary for the argmax
    model.train(False)
    try:
        for _ in range(new_tokens):
            context = ids[-max_length:] if max_length else ids
            padded = context + [0] * (-len(context) % pad_multiple)
            batch = {
                "tokens": torch.tensor([padded], device=device),
                "position_ids": torch.arange(len(padded), device=device).unsqueeze(0),
                "last_position": len(context) - 1,
                "seen": tuple(sorted(set(ids))),  # not a tensor: context parallelism splits those
                "repetition_penalty": repetition_penalty,
            }
            outputs = run_micro_batches(
                model, [batch] * copies, groups, forward_only=True, dtype=dtype, last_stage_output=_next_token
            )
            chosen = torch.zeros(1, dtype=torch.int64, device=device)
            if outputs:
                chosen.fill_(int(outputs[0].item()))
            if pp > 1:
                dist.broadcast(chosen, src=last_stage_rank, group=groups.pp)
            ids.append(int(chosen.item()))
            if stop_id is not None and ids[-1] == stop_id:
                break
    finally:
        last_chunk.parallel_output = parallel_output
        model.train(True)
    return ids


def _next_token(logits: torch.Tensor, batch: dict) -> torch.Tensor:
    """The last stage's output for decoding: the argmax at the last real position after the
    repetition penalty, as a float scalar."""
    scores = logits[0, batch["last_position"]].float()
    penalty = batch["repetition_penalty"]
    if penalty != 1.0:
        ids = torch.tensor(batch["seen"], device=scores.device)
        seen = scores[ids]
        scores = scores.index_copy(0, ids, torch.where(seen > 0, seen / penalty, seen * penalty))
    return scores.argmax().float()
