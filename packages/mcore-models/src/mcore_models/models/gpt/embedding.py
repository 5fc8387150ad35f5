"""Token (+ learned position) embedding producing ``[s, b, h]``."""

from __future__ import annotations

import torch
import torch.distributed as dist
from mcore_parallel import VocabParallelEmbedding, scatter_to_sequence_parallel_region

from ...config.transformer_config import TransformerConfig
from ...transformer.init import init_method


class LanguageModelEmbedding(torch.nn.Module):
    """Vocab-parallel word embedding, plus a replicated learned position table when
    ``position_embedding_type == "learned_absolute"``, then dropout.

    With sequence parallelism the output is this rank's ``[s / tp, b, h]`` slice.
    """

    def __init__(self, config: TransformerConfig, vocab_size: int, *, tp_group: dist.ProcessGroup):
        super().__init__()
        self.config = config
        self.tp_group = tp_group
        self.word_embeddings = VocabParallelEmbedding(
            vocab_size,
            config.hidden_size,
            tp_group=tp_group,
            reduce_scatter_embeddings=config.sequence_parallel,
            init_method=init_method(config),
            params_dtype=config.params_dtype,
        )
        self.position_embeddings = None
        if config.position_embedding_type == "learned_absolute":
            self.position_embeddings = torch.nn.Embedding(
                config.max_position_embeddings, config.hidden_size, dtype=config.params_dtype
            )
            init_method(config)(self.position_embeddings.weight)
        self.dropout = torch.nn.Dropout(config.hidden_dropout)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """``input_ids``, ``position_ids``: ``[b, s]``."""
        embeddings = self.word_embeddings(input_ids.t())
        if self.position_embeddings is not None:
            positions = self.position_embeddings(position_ids.t())
            if self.config.sequence_parallel:
                positions = scatter_to_sequence_parallel_region(positions, self.tp_group)
            embeddings = embeddings + positions
        return self.dropout(embeddings)
