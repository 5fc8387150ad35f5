"""Attention of one engine step over a paged KV cache.

On CUDA with Triton (``select_backend``), decode rows run mcore-kernels' ``paged_decode_attention``
and each prefill chunk ``paged_attention``: Triton kernels reading keys and values in place through
the block tables (windows, sinks and grouped-query heads in the kernel). Otherwise a step's queries
are of two kinds, and each takes its own path (``attend_step``):

- Decode rows (one query per request, ``DecodeBatch``): on the CPU, mcore-kernels' native
  ``paged_decode_attention`` reads each row's keys and values in place through its block table
  (when that kernel builds here and ``MCORE_KERNELS_BACKEND`` does not force the reference).
  Elsewhere, in plain PyTorch, rows are grouped by how many blocks they see (with a sliding
  window only the window's); each group's blocks are gathered once per layer into a padded
  ``[b, g, L, d]``, and a length mask, built once per step and window, applies only where the
  group's visible key ranges differ. Grouped-query heads are folded into the query
  axis (``[b, g, n / g, d]``), so keys and values are never repeated per head.
- Prefill chunks (several queries of one request, ``PrefillChunk``): without a cached prefix
  the chunk attends over its own keys and values, causal without a mask (``is_causal``; a band
  mask only when a window is shorter than the chunk). With a cached prefix the prefix and chunk
  keys (the window's blocks only) are gathered once per layer and an offset causal mask, built
  once per step and window, applies.

Attention sinks (per-head logits in each softmax denominator) work on every path: the fused
kernel's log-sum-exp ``lse`` rescales its output by ``sigmoid(lse - sink)``, the share of the
denominator that the keys hold. ``paged_attention`` is the general (slower) form over any key
slots, kept for callers with their own layout.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from mcore_api import internal_api
from mcore_kernels import paged_attention as paged_chunk_attention
from mcore_kernels import paged_decode_attention, paged_decode_attention_rows, select_backend

_DECODE_OP = "paged_decode_attention"
_CPU_LSE = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


@internal_api
def decode_backend(tensor: torch.Tensor) -> str:
    """The backend mcore-kernels' ``paged_decode_attention`` takes for ``tensor``: ``"triton"``
    (the step runs on the Triton kernels, its cache written by ``paged_kv_append``), ``"native"``
    or ``"reference"`` (the paths below)."""
    return select_backend(_DECODE_OP, tensor, kernels=("triton", "native"))


def _sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float,
    mask: torch.Tensor | None = None,
    is_causal: bool = False,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """``softmax(q k^T scale + mask) v`` for ``q [B, h, Q, d]``, ``k, v [B, g, L, d]`` (``h`` a
    multiple of ``g``); ``mask`` additive in ``q``'s dtype; ``sinks`` (float32, broadcasting to
    ``[B, h, Q]``) join each softmax denominator."""
    if k.shape[1] != q.shape[1]:  # CPU kernels take grouped keys only through a slow path
        repeats = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(repeats, 1), v.repeat_interleave(repeats, 1)
    if q.device.type == "cpu" and _CPU_LSE is not None:
        # The fused CPU kernel directly: scaled_dot_product_attention may pick the math kernel.
        out, lse = _CPU_LSE(q, k, v, 0.0, is_causal, attn_mask=mask, scale=scale)
        if sinks is None:
            return out
        return out * torch.sigmoid(lse.float() - sinks).unsqueeze(-1).to(out.dtype)
    if sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale)
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * scale  # [B, h, Q, L]
    if mask is not None:
        scores = scores + mask.float()
    if is_causal:
        causal = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - torch.logaddexp(lse, sinks.expand_as(lse)).unsqueeze(-1))
    return torch.matmul(probs.to(v.dtype), v)


def _additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(
        ~allowed, float("-inf")
    )


def _gather(blocks: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """``blocks [num_blocks, s, g, d]`` of the rows of ``table [B, W]`` as ``[B, g, W * s, d]``."""
    batch, width = table.shape
    _, size, groups, dim = blocks.shape
    gathered = blocks.index_select(0, table.reshape(-1)).view(batch, width * size, groups, dim)
    return gathered.transpose(1, 2)


@dataclass
class DecodeGroup:
    """Decode rows ``rows`` of the step that attend together: the blocks they read ``[b, W]``, the
    span of those blocks' keys kept, and an additive mask ``[b, 1, 1, span]`` (``None``: every
    row sees the whole span)."""

    rows: slice | torch.Tensor
    table: torch.Tensor
    span: slice
    mask: torch.Tensor | None


@internal_api
@dataclass
class DecodeBatch:
    """The one-query rows ``rows`` of a step: the requests' ``positions [B]`` and ``block_table
    [B, W]`` (their blocks in order, covering positions ``0 .. max(positions)``).

    ``host_positions`` (the same positions as a list) lets each layer window read only the blocks
    it needs: rows are grouped by how many blocks they see (a group's longest row reads at most
    ``group_growth`` times the blocks of its shortest, plus one), each group padded to its own
    longest row, with a mask only where its rows' key ranges differ. ``None`` means a static shape
    (a padded decode step that a CUDA graph replays on new values): one group reading all ``W``
    blocks, its mask computed from ``positions`` on the device once per forward."""

    rows: slice | torch.Tensor
    positions: torch.Tensor
    block_table: torch.Tensor
    block_size: int
    host_positions: list[int] | None = None
    group_growth: float = 1.25
    _plans: dict = field(default_factory=dict, repr=False)

    def plan(self, window: int | None, dtype: torch.dtype) -> list[DecodeGroup]:
        """The groups for one layer window; built once per step (per forward when static)."""
        key = (window, dtype)
        if key not in self._plans:
            static = self.host_positions is None
            self._plans[key] = self._static_plan(window, dtype) if static else self._plan(window, dtype)
        return self._plans[key]

    def _static_plan(self, window: int | None, dtype: torch.dtype) -> list[DecodeGroup]:
        width = self.block_table.shape[1] * self.block_size
        distance = self.positions.view(-1, 1) - torch.arange(width, device=self.positions.device)
        allowed = distance >= 0
        if window is not None:
            allowed &= distance < window
        mask = _additive(allowed, dtype).view(len(allowed), 1, 1, width)
        return [DecodeGroup(self.rows, self.block_table, slice(0, width), mask)]

    def _plan(self, window: int | None, dtype: torch.dtype) -> list[DecodeGroup]:
        size = self.block_size
        positions = self.host_positions
        lows = [0 if window is None else max(0, p - window + 1) for p in positions]
        firsts = [low // size for low in lows]
        counts = [p // size - first + 1 for p, first in zip(positions, firsts, strict=True)]
        order = sorted(range(len(positions)), key=counts.__getitem__)
        members: list[list[int]] = []
        for i in order:
            if not members or counts[i] > self.group_growth * counts[members[-1][0]] + 1:
                members.append([])
            members[-1].append(i)
        if isinstance(self.rows, slice):
            step_rows = torch.arange(self.rows.start, self.rows.stop, device=self.positions.device)
        else:
            step_rows = self.rows
        groups = []
        for rows in members:
            width = counts[rows[-1]]
            index = torch.tensor([firsts[i] for i in rows]).view(-1, 1) + torch.arange(width)
            index = torch.minimum(index, torch.tensor([positions[i] // size for i in rows]).view(-1, 1))
            selected = torch.tensor(rows, device=self.block_table.device)
            table = self.block_table.index_select(0, selected).gather(1, index.to(self.block_table.device))
            starts = [lows[i] - firsts[i] * size for i in rows]
            stops = [positions[i] - firsts[i] * size + 1 for i in rows]
            span = slice(min(starts), max(stops))
            mask = None
            if len(set(starts)) > 1 or len(set(stops)) > 1:
                keys = torch.arange(span.start, span.stop)
                allowed = (keys >= torch.tensor(starts).view(-1, 1)) & (
                    keys < torch.tensor(stops).view(-1, 1)
                )
                mask = _additive(allowed.to(self.positions.device), dtype).view(len(rows), 1, 1, -1)
            if len(members) == 1 and rows == list(range(len(positions))):
                group_rows = self.rows
            else:
                group_rows = step_rows.index_select(0, selected.to(step_rows.device))
            groups.append(DecodeGroup(group_rows, table, span, mask))
        return groups


@internal_api
@dataclass
class PrefillChunk:
    """The queries at positions ``start .. end - 1`` of one request, rows ``rows`` of the step;
    ``blocks`` hold its positions ``0 .. end - 1`` (read only when ``start > 0``)."""

    rows: slice
    start: int
    end: int
    blocks: torch.Tensor
    block_size: int
    _plans: dict = field(default_factory=dict, repr=False)

    def sequence(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The chunk as one sequence of ``mcore_kernels.paged_attention``: ``(block_table [1, W],
        query_starts [2], seq_lens [1])`` on the blocks' device; built once per step."""
        if "sequence" not in self._plans:
            device = self.blocks.device
            starts = torch.tensor([0, self.end - self.start], device=device)
            self._plans["sequence"] = self.blocks.view(1, -1), starts, torch.tensor([self.end], device=device)
        return self._plans["sequence"]

    def plan(self, window: int | None, dtype: torch.dtype):
        """``(blocks to read or None for the chunk's own keys, key span, additive mask [Q, span]
        or None, is_causal)`` for one window; built once per step."""
        key = (window, dtype)
        if key not in self._plans:
            self._plans[key] = self._plan(window, dtype)
        return self._plans[key]

    def _plan(self, window: int | None, dtype: torch.dtype):
        length = self.end - self.start
        first_key = 0 if window is None else max(0, self.start - window + 1)
        device = self.blocks.device
        if first_key >= self.start:  # every visible key is in the chunk itself
            if window is None or window >= length:
                return None, slice(0, length), None, True
            distance = torch.arange(length, device=device).view(-1, 1) - torch.arange(length, device=device)
            return None, slice(0, length), _additive((distance >= 0) & (distance < window), dtype), False
        size = self.block_size
        first_block = first_key // size
        blocks = self.blocks[first_block : (self.end - 1) // size + 1]
        offset = first_block * size
        span = slice(first_key - offset, self.end - offset)
        queries = torch.arange(self.start, self.end, device=device).view(-1, 1)
        distance = queries - torch.arange(offset + span.start, offset + span.stop, device=device)
        allowed = distance >= 0
        if window is not None:
            allowed &= distance < window
        return blocks.view(1, -1), span, _additive(allowed, dtype), False


@internal_api
@dataclass
class StepAttention:
    """How the queries of one step attend: the decode rows and the prefill chunks."""

    decode: DecodeBatch | None = None
    prefills: list[PrefillChunk] = field(default_factory=list)
    _rows: tuple | None = field(default=None, repr=False)
    _backend: str | None = field(default=None, repr=False)

    def backend(self, query: torch.Tensor) -> str:
        """``decode_backend(query)``, asked once per step (every layer's queries share a device and dtype)."""
        if self._backend is None:
            self._backend = decode_backend(query)
        return self._backend

    def row_tables(self, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Every query row as a decode row: ``(positions [tokens], block_table [tokens, W])``,
        a prefill chunk's rows at their positions over the chunk's blocks; built once per step.
        Rows of neither (padding) read position 0 of block 0 and are ignored. A step of decode
        rows only, all of its rows, takes the decode batch's own tensors."""
        decode = self.decode
        if self._rows is None and decode is not None and not self.prefills and _covers(decode.rows, tokens):
            self._rows = decode.positions.contiguous(), decode.block_table.contiguous()
        if self._rows is None:
            chunks = [(c.rows, torch.arange(c.start, c.end), c.blocks) for c in self.prefills]
            if self.decode is not None:
                chunks.append((self.decode.rows, self.decode.positions, self.decode.block_table))
            width = max(blocks.shape[-1] for _, _, blocks in chunks)
            device = chunks[0][2].device
            positions = torch.zeros(tokens, dtype=torch.long, device=device)
            table = torch.zeros(tokens, width, dtype=chunks[0][2].dtype, device=device)
            for rows, row_positions, blocks in chunks:
                positions[rows] = row_positions.to(device)
                table[rows, : blocks.shape[-1]] = blocks
            self._rows = positions, table
        return self._rows


def _covers(rows: slice | torch.Tensor, tokens: int) -> bool:
    """Whether ``rows`` (of a decode batch) are all ``tokens`` rows of the step, in order."""
    return isinstance(rows, slice) and rows == slice(0, tokens)


@internal_api
def attend_step(
    step: StepAttention,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_blocks: torch.Tensor,
    value_blocks: torch.Tensor,
    *,
    scale: float,
    window_size: int | None = None,
    sink_logits: torch.Tensor | None = None,
) -> torch.Tensor:
    """The attention ``[t, n * d]`` of the step's ``query [t, n, d]`` over the cache of one layer,
    ``key_blocks, value_blocks [num_blocks, block_size, g, d]``, which already holds this step's
    ``key, value [t, g, d]``."""
    tokens, heads, dim = query.shape
    groups = key_blocks.shape[2]
    sinks = None if sink_logits is None else sink_logits.float()
    backend = step.backend(query)
    if backend == "triton":
        return _attend_triton(step, query, key_blocks, value_blocks, scale, window_size, sinks)
    if backend == "native" and (step.prefills or step.decode):
        # prefill rows too: the kernel is the faster there. Called without the op's Python checks:
        # the engine built these tensors, and the kernel checks shapes, positions and blocks.
        positions, table = step.row_tables(tokens)
        return paged_decode_attention_rows(
            query.contiguous(),
            key_blocks,
            value_blocks,
            table,
            positions,
            float(scale),
            0 if window_size is None else int(window_size),
            None if sinks is None else sinks.contiguous(),
        ).view(tokens, heads * dim)
    output = query.new_empty(tokens, heads * dim)
    for chunk in step.prefills:
        blocks, span, mask, causal = chunk.plan(window_size, query.dtype)
        q = query[chunk.rows].transpose(0, 1).unsqueeze(0)  # [1, n, Q, d]
        if blocks is None:
            k = key[chunk.rows].to(key_blocks.dtype).transpose(0, 1).unsqueeze(0)
            v = value[chunk.rows].to(value_blocks.dtype).transpose(0, 1).unsqueeze(0)
        else:
            k = _gather(key_blocks, blocks)[:, :, span]
            v = _gather(value_blocks, blocks)[:, :, span]
        chunk_sinks = None if sinks is None else sinks.view(1, heads, 1)
        context = _sdpa(q, k, v, scale=scale, mask=mask, is_causal=causal, sinks=chunk_sinks)
        output[chunk.rows] = context[0].transpose(0, 1).reshape(-1, heads * dim)
    decode = step.decode
    if decode is not None:
        decode_sinks = None if sinks is None else sinks.view(1, groups, heads // groups)
        for group in decode.plan(window_size, query.dtype):
            batch = group.table.shape[0]
            q = query[group.rows].view(batch, groups, heads // groups, dim)  # heads folded per group
            k = _gather(key_blocks, group.table)[:, :, group.span]
            v = _gather(value_blocks, group.table)[:, :, group.span]
            context = _sdpa(q, k, v, scale=scale, mask=group.mask, sinks=decode_sinks)
            output[group.rows] = context.reshape(batch, heads * dim)
    return output


def _attend_triton(step, query, key_blocks, value_blocks, scale, window_size, sinks) -> torch.Tensor:
    """``attend_step`` on mcore-kernels' Triton kernels: a call per prefill chunk, one for the
    decode rows."""
    tokens, heads, dim = query.shape
    output = query.new_empty(tokens, heads, dim)
    options = dict(scale=scale, window_size=window_size, sink_logits=sinks)
    for chunk in step.prefills:
        table, starts, seq_lens = chunk.sequence()
        output[chunk.rows] = paged_chunk_attention(
            query[chunk.rows], key_blocks, value_blocks, table, starts, seq_lens,
            max_query_len=chunk.end - chunk.start, **options,
        )  # fmt: skip
    decode = step.decode
    if decode is not None:
        output[decode.rows] = paged_decode_attention(
            query[decode.rows], key_blocks, value_blocks, decode.block_table, decode.positions, **options
        )
    return output.view(tokens, heads * dim)


@internal_api
def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    key_slots: torch.Tensor,
    query_positions: torch.Tensor,
    *,
    scale: float,
    window_size: int | None = None,
    sink_logits: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of ``B`` sequences over their cached keys, at any slots.

    ``query [B, Q, n, d]``: ``Q`` query tokens per sequence at ``query_positions [B, Q]``.
    ``key_cache, value_cache [slots, g, d]``: the cache of one layer, flattened over blocks.
    ``key_slots [B, L]``: the cache slot of each sequence's key at positions ``0 .. L - 1``
    (any valid slot past a sequence's end: a query at position ``p`` sees keys ``<= p`` only,
    and ``p - j < window_size`` with a window). ``sink_logits [n]`` join each softmax
    denominator. Returns ``[B, Q, n * d]``. Builds a dense ``[B, Q, L]`` mask: the engine's
    steps use ``attend_step``.
    """
    batch, num_queries, num_heads, head_dim = query.shape
    groups = key_cache.shape[1]
    length = key_slots.shape[1]
    flat_slots = key_slots.reshape(-1)
    keys = key_cache.index_select(0, flat_slots).view(batch, length, groups, head_dim).transpose(1, 2)
    values = value_cache.index_select(0, flat_slots).view(batch, length, groups, head_dim).transpose(1, 2)
    distance = query_positions[:, :, None] - torch.arange(length, device=query.device)  # [B, Q, L]
    allowed = distance >= 0
    if window_size is not None:
        allowed &= distance < window_size
    sinks = None if sink_logits is None else sink_logits.float().view(1, num_heads, 1)
    context = _sdpa(
        query.transpose(1, 2),
        keys,
        values,
        scale=scale,
        mask=_additive(allowed[:, None], query.dtype),
        sinks=sinks,
    )
    return context.transpose(1, 2).reshape(batch, num_queries, num_heads * head_dim)
