"""Batch-shape buckets: the few padded step shapes for which CUDA graphs are captured."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from mcore_api import internal_api


@dataclass(frozen=True, order=True)
class InferenceBatchDimensions:
    """The shape of one step: flattened tokens, prefill requests (chunks longer than one token
    count as prefill) and decode requests."""

    token_count: int
    prefill_req_count: int
    decode_req_count: int

    def __post_init__(self) -> None:
        if min(self.token_count, self.prefill_req_count, self.decode_req_count) < 0:
            raise ValueError(f"batch dimensions must be >= 0, got {self}")
        if self.token_count < self.req_count:
            raise ValueError(f"token_count {self.token_count} is below the request count {self.req_count}")

    @classmethod
    def of_step(cls, chunk_lengths: Sequence[int]) -> InferenceBatchDimensions:
        """The dimensions of a step computing chunks of these token counts."""
        decode = sum(1 for n in chunk_lengths if n == 1)
        return cls(sum(chunk_lengths), len(chunk_lengths) - decode, decode)

    @property
    def req_count(self) -> int:
        """Requests in the step, prefill and decode."""
        return self.prefill_req_count + self.decode_req_count

    def fits(self, batch: InferenceBatchDimensions) -> bool:
        """Whether ``batch`` can run padded to this shape."""
        if batch.prefill_req_count == 0 and self.prefill_req_count == 0:
            return batch.decode_req_count <= self.decode_req_count
        return (
            batch.token_count <= self.token_count
            and batch.prefill_req_count <= self.prefill_req_count
            and batch.decode_req_count <= self.decode_req_count
        )


def _sizes(limit: int, smallest: int = 1) -> list[int]:
    """Powers of two from ``smallest`` below ``limit``, then ``limit``."""
    sizes, size = [], smallest
    while size < limit:
        sizes.append(size)
        size *= 2
    return [*sizes, limit]


def build_batch_buckets(
    max_requests: int, max_tokens: int, *, max_prefill_requests: int = 1, smallest_mixed_tokens: int = 16
) -> list[InferenceBatchDimensions]:
    """Decode-only buckets of 1, 2, 4, ... ``max_requests`` requests, and mixed buckets of
    ``smallest_mixed_tokens``, 2x, ... ``max_tokens`` tokens holding up to
    ``max_prefill_requests`` prefill chunks and as many decodes as fit; sorted smallest first."""
    if not 1 <= max_prefill_requests <= max_requests:
        raise ValueError(f"max_prefill_requests must be in [1, {max_requests}], got {max_prefill_requests}")
    if max_tokens < max_requests:
        raise ValueError(f"max_tokens ({max_tokens}) must be >= max_requests ({max_requests})")
    buckets = {InferenceBatchDimensions(n, 0, n) for n in _sizes(max_requests)}
    for tokens in _sizes(max_tokens, min(smallest_mixed_tokens, max_tokens)):
        prefill = min(max_prefill_requests, tokens)
        decode = min(max_requests - prefill, tokens - prefill)
        buckets.add(InferenceBatchDimensions(tokens, prefill, decode))
    return sorted(buckets)


@internal_api
def match_bucket(
    batch: InferenceBatchDimensions, buckets: Sequence[InferenceBatchDimensions]
) -> InferenceBatchDimensions | None:
    """The smallest bucket (fewest tokens, then requests) that ``batch`` fits; ``None``: run eagerly."""
    fitting = [b for b in buckets if b.fits(batch)]
    return min(fitting, key=lambda b: (b.token_count, b.req_count), default=None)
