"""Embedding table split along the vocabulary across tensor-parallel ranks."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from mcore_api import internal_api

from .collectives import resolve_tp_group
from .initialization import InitMethod, check_divisible, default_init_method, sharded_parameter
from .mappings import reduce_from_tensor_model_parallel_region, reduce_scatter_to_sequence_parallel_region


@internal_api
def vocab_range(vocab_size: int, rank: int, world_size: int) -> tuple[int, int]:
    """The ``[start, end)`` token ids held by ``rank`` when ``vocab_size`` splits evenly over ``world_size``."""
    per_rank = check_divisible("vocab_size", vocab_size, world_size)
    return rank * per_rank, (rank + 1) * per_rank


class VocabParallelEmbedding(torch.nn.Module):
    """Each rank holds rows ``[start, end)`` of the embedding table.

    Ids outside this rank's range look up zeros, and the ranks' results are summed, so every token
    gets exactly its one row. With ``reduce_scatter_embeddings`` the sum is reduce-scattered along
    the first dimension instead (for sequence parallelism pass ids as ``[s, b]``). Ids outside
    ``[0, num_embeddings)`` are not checked and embed as zeros.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        tp_group: dist.ProcessGroup | None = None,
        reduce_scatter_embeddings: bool = False,
        init_method: InitMethod = default_init_method,
        params_dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ):
        super().__init__()
        self.tp_group = resolve_tp_group(tp_group)
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.reduce_scatter_embeddings = reduce_scatter_embeddings
        self.vocab_start_index, self.vocab_end_index = vocab_range(
            num_embeddings, dist.get_rank(self.tp_group), dist.get_world_size(self.tp_group)
        )
        self.weight = sharded_parameter(
            (num_embeddings, embedding_dim), 0, self.tp_group, init_method, params_dtype, device
        )

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        outside = (input_ids < self.vocab_start_index) | (input_ids >= self.vocab_end_index)
        local_ids = (input_ids - self.vocab_start_index).masked_fill(outside, 0)
        partial_embeddings = F.embedding(local_ids, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        if self.reduce_scatter_embeddings:
            return reduce_scatter_to_sequence_parallel_region(partial_embeddings, self.tp_group)
        return reduce_from_tensor_model_parallel_region(partial_embeddings, self.tp_group)

    def extra_repr(self) -> str:
        return (
            f"{self.num_embeddings}, {self.embedding_dim}, "
            f"rows={self.vocab_start_index}..{self.vocab_end_index - 1}"
        )
