"""The tokens of one engine step: sampled from its logits, row failures marked, and agreed over
the tensor- and pipeline-parallel ranks so that every rank advances its requests alike."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch
import torch.distributed as dist
from mcore_kernels import argmax_rows
from mcore_parallel import get_group_device

from .host_tensor import host_tensor
from .pipeline import PipelineStage
from .request import Request
from .sampler import UNSAMPLEABLE, SampledTokens, nonfinite_rows, sample
from .scheduler import ScheduledChunk

SAMPLING_FAILURES = {
    -1: "non-finite logits (NaN or +inf, or every token -inf) at sampling time",
    -2: "sampling failed: the distribution after temperature and filters is not valid (NaN or inf)",
}
"""Why a row could not be sampled, by the negative token id that stands for it in the broadcast."""


def _plain_greedy(params) -> bool:
    """Whether a request's next token is its logits' argmax and nothing else is asked of them:
    greedy, without penalties or log-probabilities."""
    return params.greedy and not params.has_penalties and not params.logprobs and not params.top_n_logprobs


def _select_rows(logits: torch.Tensor, rows: Sequence[int]) -> torch.Tensor:
    """``logits[rows]``, without a copy when ``rows`` are all of them in order (most steps)."""
    if len(rows) == len(logits) and all(row == i for i, row in enumerate(rows)):
        return logits
    return logits[host_tensor(rows).to(logits.device)]


class StepSampler:
    """Samples a step's requests with ``generator`` (the engine's, for unseeded draws) and makes
    every rank take the tokens of the first rank of ``tp_group`` (``None``: no tensor
    parallelism) on the last stage of ``pipeline`` (``None``: one stage)."""

    def __init__(
        self,
        generator: torch.Generator,
        tp_group: dist.ProcessGroup | None,
        pipeline: PipelineStage | None,
    ):
        self.generator, self.tp_group, self.pipeline = generator, tp_group, pipeline

    def sample(
        self, rows: Sequence[int], requests: Sequence[Request], logits: torch.Tensor
    ) -> tuple[SampledTokens, dict[int, str]]:
        """The next token of each of ``requests`` from its row of ``logits``, agreed over the
        ranks, and the error of each request (by id) that no token can be sampled for: NaN/inf
        logits, or a distribution the sampler finds invalid after temperature and filters
        (``UNSAMPLEABLE``). Those rows alone fail. A failure travels to the other ranks as a
        negative token id (``SAMPLING_FAILURES``), so every rank fails the same requests with the
        same message: the source rank's. Seeded requests draw from their seed, the others from
        the generator."""
        count = len(requests)
        sampled = SampledTokens([-1] * count, [float("nan")] * count, [{} for _ in range(count)])
        if not count:
            return sampled, {}
        logits = _select_rows(logits, rows)
        if all(_plain_greedy(r.sampling_params) for r in requests):
            # most steps: one pass over the logits in their own dtype, no float32 copy
            indices, finite = argmax_rows(logits)
            sampled.tokens[:] = indices.tolist()
            failures = {i: -1 for i, ok in enumerate(finite.tolist()) if not ok}
            good = []
        else:
            # float32 first: reductions (the finiteness check, argmax) are several times faster in it.
            logits = logits.float()
            failures = {i: -1 for i, bad in enumerate(nonfinite_rows(logits).tolist()) if bad}
            good = [i for i in range(count) if i not in failures] if failures else range(count)
        if good:
            sampled = self._sample_rows(logits, requests, good, sampled, failures)
        for i, code in failures.items():
            sampled.tokens[i] = code
        agreed = self.agree(sampled)
        errors = {
            request.request_id: SAMPLING_FAILURES[agreed.tokens[i]]
            for i, request in enumerate(requests)
            if agreed.tokens[i] < 0
        }
        return agreed, errors

    def _sample_rows(
        self,
        logits: torch.Tensor,
        requests: Sequence[Request],
        good: Sequence[int],
        sampled: SampledTokens,
        failures: dict[int, int],
    ) -> SampledTokens:
        """``sampled`` with the rows ``good`` of ``logits`` (their requests' parameters) sampled in,
        the ones the sampler finds ``UNSAMPLEABLE`` added to ``failures``."""
        chosen = [requests[i] for i in good]
        result = sample(
            _select_rows(logits, good),
            [r.sampling_params for r in chosen],
            self.generator,
            prompt_tokens=[r.prompt_tokens for r in chosen],
            output_tokens=[r.generated_tokens for r in chosen],
        )
        failures.update(
            (i, -2) for i, token in zip(good, result.tokens, strict=True) if token == UNSAMPLEABLE
        )
        if len(good) == len(requests):  # most steps: every row, in order
            return result
        for j, i in enumerate(good):
            sampled.tokens[i] = result.tokens[j]
            sampled.logprobs[i] = result.logprobs[j]
            sampled.top_logprobs[i] = result.top_logprobs[j]
        return sampled

    def agree(self, sampled: SampledTokens) -> SampledTokens:
        """The tokens and their log-probabilities of the first tensor-parallel rank of the last
        pipeline stage: tensor-parallel ranks take their first rank's, then the last stage's."""
        hops = [] if self.tp_group is None else [(self.tp_group, dist.get_global_rank(self.tp_group, 0))]
        if self.pipeline is not None:
            hops.append((self.pipeline.group, self.pipeline.last_rank))
        if not hops:
            return sampled
        device = get_group_device(hops[0][0])  # token ids are exact in float64
        values = host_tensor([*sampled.tokens, *sampled.logprobs], torch.float64).view(2, -1).to(device)
        for group, source in hops:
            dist.broadcast(values, src=source, group=group)
        return replace(sampled, tokens=values[0].long().tolist(), logprobs=values[1].tolist())


def prompt_logprobs(chunk: ScheduledChunk, logits: torch.Tensor) -> None:
    """Append to ``chunk.request.prompt_logprobs`` the log-probability of each prompt token that
    ``logits`` (the chunk's rows) predict, and to ``prompt_top_logprobs`` the ``top_n_logprobs``
    most likely tokens' when the request asks for them; a chunk recomputed after preemption adds
    nothing."""
    request = chunk.request
    prompt = request.prompt_tokens
    targets = range(chunk.start + 1, min(chunk.end + 1, len(prompt)))
    if not targets or len(request.prompt_logprobs) != targets.start:
        return
    logprobs = torch.log_softmax(logits[: len(targets)].float(), dim=-1)
    index = host_tensor([prompt[t] for t in targets]).to(logprobs.device).unsqueeze(1)
    request.prompt_logprobs.extend(logprobs.gather(1, index).squeeze(1).tolist())
    top_n = request.sampling_params.top_n_logprobs
    if top_n:
        best = logprobs.topk(top_n, dim=-1)
        for ids, values in zip(best.indices.tolist(), best.values.tolist(), strict=True):
            request.prompt_top_logprobs.append(dict(zip(ids, values, strict=True)))
