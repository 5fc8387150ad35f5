"""Each request's KV-cache blocks as one row of a tensor, kept in step with its block list."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from mcore_api import internal_api


@internal_api
class BlockTables:
    """Rows of ``table [rows, max_blocks]``, one per request that owns blocks, holding its block
    ids in order (0 past its last block).

    ``sync(request_id, block_ids)`` brings a row up to date: blocks appended since the last call
    are written alone (a growing request costs one small copy when it takes a block, nothing
    otherwise); a list that no longer starts with the row's blocks (the request was preempted and
    readmitted) rewrites the row. ``drop`` frees a request's row. The table grows when more
    requests hold rows than it has."""

    def __init__(self, max_blocks: int, rows: int = 64):
        self.max_blocks = max_blocks
        self.table = torch.zeros(rows, max_blocks, dtype=torch.long)
        self._row: dict[int, int] = {}  # request id -> row
        self._blocks: dict[int, list[int]] = {}  # request id -> the block ids its row holds
        self._free = list(range(rows - 1, -1, -1))

    def __len__(self) -> int:
        return len(self._row)

    def sync(self, request_id: int, block_ids: Sequence[int]) -> int:
        """Make ``request_id``'s row hold ``block_ids``; return the row."""
        row = self._row.get(request_id)
        if row is None:
            row = self._row[request_id] = self._take_row()
            self._blocks[request_id] = []
        mine = self._blocks[request_id]
        if block_ids == mine:  # most steps: no new block
            return row
        count = len(mine)
        if len(block_ids) > self.max_blocks:
            raise ValueError(f"{len(block_ids)} blocks exceed a row of {self.max_blocks}")
        if len(block_ids) < count or block_ids[:count] != mine:
            self.table[row].zero_()
            mine.clear()
            count = 0
        if len(block_ids) > count:
            new = block_ids[count:]
            self.table[row, count : len(block_ids)] = torch.tensor(new, dtype=torch.long)
            mine.extend(new)
        return row

    def drop(self, request_id: int) -> None:
        """Free ``request_id``'s row (no-op if it has none)."""
        row = self._row.pop(request_id, None)
        if row is not None:
            self._blocks.pop(request_id)
            self.table[row].zero_()
            self._free.append(row)

    def reset(self) -> None:
        """Free every row."""
        for request_id in list(self._row):
            self.drop(request_id)

    def _take_row(self) -> int:
        if not self._free:
            rows = self.table.shape[0]
            self.table = torch.cat((self.table, torch.zeros_like(self.table)))
            self._free = list(range(2 * rows - 1, rows - 1, -1))
        return self._free.pop()
