"""Inputs shared by the paged-attention tests: a paged cache with shuffled blocks and sequences
given as ``(seq_len, query_len)``."""

import torch


def paged_sequences(*, heads, groups, dim, block_size, sequences, dtype=torch.float32, seed=0, device="cpu"):
    """``(query [T, n, d], key_blocks, value_blocks, block_table [B, W], query_starts [B + 1],
    seq_lens [B])`` for ``sequences`` of ``(seq_len, query_len)``, blocks in shuffled order."""
    generator = torch.Generator().manual_seed(seed)
    width = max(-(-length // block_size) for length, _ in sequences)
    num_blocks = len(sequences) * width + 3
    blocks = [torch.randn(num_blocks, block_size, groups, dim, generator=generator) for _ in range(2)]
    order = torch.randperm(num_blocks, generator=generator)[: len(sequences) * width]
    table = order.view(len(sequences), width)
    lengths = torch.tensor([q for _, q in sequences])
    starts = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    query = torch.randn(int(starts[-1]), heads, dim, generator=generator)
    seq_lens = torch.tensor([length for length, _ in sequences], dtype=torch.int64)
    tensors = (query, *blocks, table, starts, seq_lens)
    return tuple(t.to(device, dtype) if t.is_floating_point() else t.to(device) for t in tensors)
