"""The order in which one pipeline stage runs forward and backward passes of its micro-batches."""

from __future__ import annotations

from typing import Literal, NamedTuple

from mcore_api import experimental_api


@experimental_api
class PipelineAction(NamedTuple):
    """One step of a stage: ``kind`` ``"F"`` (forward) or ``"B"`` (backward) of ``microbatch`` on ``chunk``."""

    kind: Literal["F", "B"]
    chunk: int
    microbatch: int


@experimental_api
def schedule_actions(
    stage: int, num_stages: int, num_microbatches: int, num_chunks: int = 1, forward_only: bool = False
) -> list[PipelineAction]:
    """The 1F1B order of ``stage``; with ``num_chunks > 1`` the interleaved (virtual-stage) order.

    Forward passes go through micro-batches in groups of ``num_stages``, chunk by chunk within a
    group; backward passes the same with the chunks reversed. A stage first runs enough forward
    passes to fill the pipeline (warm-up), then alternates one forward and one backward (steady
    state), then drains the remaining backward passes (cool-down).

    Raises:
        ValueError: a count below 1, or, with interleaving, micro-batches not a multiple of stages.
    """
    for name, value in {
        "num_stages": num_stages,
        "num_microbatches": num_microbatches,
        "num_chunks": num_chunks,
    }.items():
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if not 0 <= stage < num_stages:
        raise ValueError(f"stage must be in 0..{num_stages - 1}, got {stage}")
    if num_chunks > 1 and num_microbatches % num_stages:
        raise ValueError(
            f"the interleaved schedule needs num_microbatches ({num_microbatches}) to be a multiple of "
            f"the pipeline size ({num_stages})"
        )
    total = num_microbatches * num_chunks
    group = num_stages * num_chunks if num_chunks > 1 else 1

    def unit(index: int, backward: bool) -> tuple[int, int]:
        if num_chunks == 1:
            return 0, index
        within = index % group
        chunk = within // num_stages
        return (num_chunks - 1 - chunk if backward else chunk), (
            index // group
        ) * num_stages + within % num_stages

    forwards = [PipelineAction("F", *unit(i, False)) for i in range(total)]
    if forward_only:
        return forwards
    backwards = [PipelineAction("B", *unit(i, True)) for i in range(total)]
    if num_chunks == 1:
        warmup = min(num_stages - stage - 1, total)
    elif num_microbatches == num_stages:
        warmup = total
    else:
        warmup = min((num_stages - stage - 1) * 2 + (num_chunks - 1) * num_stages, total)
    actions = forwards[:warmup]
    for forward, backward in zip(forwards[warmup:], backwards, strict=False):
        actions += [forward, backward]
    return actions + backwards[total - warmup :]
