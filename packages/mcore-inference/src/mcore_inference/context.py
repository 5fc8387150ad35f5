"""The paged KV cache and the layout of one engine step (implements ``mcore_models.InferenceContext``)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, NamedTuple

import torch
import torch.distributed as dist
from mcore_api import internal_api

from .attention import paged_attention
from .block_allocator import BlockAllocator
from .errors import MaxSequenceLengthOverflowError, RequestOverflowError, TokenOverflowError
from .pipeline import block_count_group, model_groups

if TYPE_CHECKING:
    from mcore_models import InferenceModel
    from mcore_parallel import ProcessGroupCollection

    from .request import Request


@internal_api
@dataclass
class ScheduledChunk:
    """Tokens ``start .. start + length - 1`` of ``request.tokens`` computed in this step, and
    which of their logits the step needs (``"none"``, ``"last"`` to sample, ``"all"`` for
    prompt log-probabilities)."""

    request: Request
    start: int
    length: int
    logits: Literal["none", "last", "all"] = "last"

    @property
    def end(self) -> int:
        return self.start + self.length


@dataclass
class _AttentionGroup:
    rows: slice | torch.Tensor  # rows of the flattened step
    key_slots: torch.Tensor  # [B, L]
    query_positions: torch.Tensor  # [B, Q]


@internal_api
class DecodeView(NamedTuple):
    """The tensors of one padded decode shape: ``rows`` requests, ``width`` key slots each."""

    input_ids: torch.Tensor  # [1, rows]
    position_ids: torch.Tensor  # [1, rows]
    query_positions: torch.Tensor  # [rows, 1], the same memory as position_ids
    token_slots: torch.Tensor  # [rows]
    key_slots: torch.Tensor  # [rows, width]
    logits_indices: torch.Tensor  # [rows]: 0 .. rows - 1


@internal_api
class DecodeBuffers:
    """Device tensors at fixed addresses that padded decode steps of up to ``max_rows`` requests
    and ``max_width`` key slots read: a CUDA graph captured over a ``view`` replays on whatever
    a later step copies into the same view."""

    def __init__(self, max_rows: int, max_width: int, device: torch.device):
        self.max_rows, self.max_width = max_rows, max_width
        self._ids = torch.zeros(max_rows, dtype=torch.long, device=device)
        self._positions = torch.zeros(max_rows, dtype=torch.long, device=device)
        self._token_slots = torch.zeros(max_rows, dtype=torch.long, device=device)
        self._key_slots = torch.zeros(max_rows * max_width, dtype=torch.long, device=device)
        self._rows = torch.arange(max_rows, device=device)

    def view(self, rows: int, width: int) -> DecodeView:
        if not (1 <= rows <= self.max_rows and 1 <= width <= self.max_width):
            raise ValueError(f"a view of {rows} x {width} exceeds {self.max_rows} x {self.max_width}")
        return DecodeView(
            self._ids[:rows].view(1, rows),
            self._positions[:rows].view(1, rows),
            self._positions[:rows].view(rows, 1),
            self._token_slots[:rows],
            self._key_slots[: rows * width].view(rows, width),
            self._rows[:rows],
        )


def _free_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


class DynamicInferenceContext:
    """A paged KV cache of ``num_blocks`` blocks of ``block_size`` tokens for the local layers
    ``first_layer_number ..`` of a model, and the flattened layout of the current step.

    ``kv_cache_memory`` is a budget in bytes (``int``) or a fraction of the device's free memory
    (``float`` in ``(0, 1]``); the block count is the budget over ``bytes_per_block``, made equal on
    every rank of ``block_count_group`` (all-reduce MIN; e.g. the pipeline or model-parallel group).
    A step holds at most ``max_requests`` requests and ``max_tokens`` tokens; a sequence at most
    ``max_sequence_length`` tokens (and never more than the cache).
    """

    def __init__(
        self,
        *,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        block_size: int = 16,
        kv_cache_memory: int | float = 0.25,
        max_requests: int = 64,
        max_tokens: int = 512,
        max_sequence_length: int | None = None,
        first_layer_number: int = 1,
        enable_prefix_caching: bool = True,
        block_count_group: dist.ProcessGroup | None = None,
    ):
        for name, value in (
            ("block_size", block_size),
            ("max_requests", max_requests),
            ("max_tokens", max_tokens),
        ):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        self.block_size = block_size
        self.max_requests = max_requests
        self.max_tokens = max_tokens
        self.first_layer_number = first_layer_number
        element = torch.empty((), dtype=dtype).element_size()
        self.bytes_per_block = 2 * num_layers * block_size * num_kv_heads * head_dim * element
        num_blocks = self._budget_bytes(kv_cache_memory) // self.bytes_per_block
        if block_count_group is not None:
            count = torch.tensor([num_blocks], dtype=torch.long)
            dist.all_reduce(count, op=dist.ReduceOp.MIN, group=block_count_group)
            num_blocks = int(count.item())
        self.allocator = BlockAllocator(num_blocks, block_size, enable_prefix_caching=enable_prefix_caching)
        capacity = num_blocks * block_size
        self.max_sequence_length = (
            capacity if max_sequence_length is None else min(max_sequence_length, capacity)
        )
        self.kv_cache: torch.Tensor | None = None
        self.logits_indices: torch.Tensor | None = None
        self._slots = torch.empty(0, dtype=torch.long)
        self._groups: list[_AttentionGroup] = []
        self.allocate()

    @classmethod
    def from_model(
        cls, model: InferenceModel, *, pg_collection: ProcessGroupCollection | None = None, **kwargs
    ) -> DynamicInferenceContext:
        """A context shaped for ``model`` (an ``mcore_models.InferenceModel``: this rank's stage
        and heads, from its ``kv_cache_spec``, and its ``max_sequence_length``).

        The block count is agreed over the model-parallel ranks (tensor x pipeline) of the groups
        ``model`` was built with: ``pg_collection``, else the global ones if ``model`` uses them."""
        spec = model.kv_cache_spec
        defaults = {
            "num_layers": len(spec.layer_numbers),
            "first_layer_number": spec.layer_numbers.start,
            "num_kv_heads": spec.num_kv_heads,
            "head_dim": spec.head_dim,
            "dtype": spec.dtype,
            "device": spec.device,
            "max_sequence_length": model.max_sequence_length,
            "block_count_group": block_count_group(model, model_groups(model, pg_collection)),
        }
        return cls(**(defaults | kwargs))

    def _budget_bytes(self, kv_cache_memory: int | float) -> int:
        if isinstance(kv_cache_memory, bool) or kv_cache_memory <= 0:
            raise ValueError(
                f"kv_cache_memory must be bytes (int > 0) or a fraction in (0, 1], got {kv_cache_memory}"
            )
        if isinstance(kv_cache_memory, float):
            if kv_cache_memory > 1:
                raise ValueError(f"kv_cache_memory as a fraction must be in (0, 1], got {kv_cache_memory}")
            return int(_free_memory_bytes(self.device) * kv_cache_memory)
        return int(kv_cache_memory)

    @property
    def num_blocks(self) -> int:
        """Cache blocks, agreed over ``block_count_group``."""
        return self.allocator.num_blocks

    @property
    def memory_bytes(self) -> int:
        """Bytes the cache blocks take while allocated (the padding slot aside)."""
        return self.num_blocks * self.bytes_per_block

    @property
    def is_allocated(self) -> bool:
        """Whether the cache tensors exist (``False`` after ``deallocate``)."""
        return self.kv_cache is not None

    @property
    def padding_slot(self) -> int:
        """The cache slot past every block where padded rows of a static-shape step write."""
        return self.num_blocks * self.block_size

    def allocate(self) -> None:
        """Create the (zeroed) cache tensors, blocks plus the padding slot, and forget every block
        assignment."""
        self.kv_cache = torch.zeros(
            self.num_layers,
            2,
            self.padding_slot + 1,
            self.num_kv_heads,
            self.head_dim,
            dtype=self.dtype,
            device=self.device,
        )
        self.allocator.reset()

    def deallocate(self) -> int:
        """Free the cache tensors and every block assignment; return the bytes freed."""
        freed = self.memory_bytes if self.kv_cache is not None else 0
        self.kv_cache = None
        self.allocator.reset()
        self._groups = []
        return freed

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks that ``num_tokens`` tokens occupy."""
        return -(-num_tokens // self.block_size)

    def check_sequence_length(self, length: int) -> None:
        """Raise ``MaxSequenceLengthOverflowError`` if ``length`` exceeds ``max_sequence_length``."""
        if length > self.max_sequence_length:
            raise MaxSequenceLengthOverflowError(
                f"sequence of {length} tokens exceeds max_sequence_length {self.max_sequence_length}"
            )

    @internal_api
    def prepare_step(
        self, chunks: Sequence[ScheduledChunk]
    ) -> tuple[torch.Tensor, torch.Tensor, list[slice]]:
        """Lay ``chunks`` out as one row; return ``input_ids``, ``position_ids`` (``[1, t]``) and,
        per chunk, its rows of the step's logits. Each chunk's request must own blocks for its
        ``end`` tokens. Raises ``RequestOverflowError`` / ``TokenOverflowError`` over the limits."""
        if len(chunks) > self.max_requests:
            raise RequestOverflowError(
                f"{len(chunks)} requests in one step, max_requests is {self.max_requests}"
            )
        total = sum(chunk.length for chunk in chunks)
        if total > self.max_tokens:
            raise TokenOverflowError(f"{total} tokens in one step, max_tokens is {self.max_tokens}")
        ids: list[int] = []
        positions: list[int] = []
        logits_rows: list[int] = []
        logits_slices: list[slice] = []
        decode_rows: list[int] = []
        decode_chunks: list[ScheduledChunk] = []
        self._groups = []
        for chunk in chunks:
            offset = len(ids)
            ids.extend(chunk.request.tokens[chunk.start : chunk.end])
            positions.extend(range(chunk.start, chunk.end))
            first = len(logits_rows)
            if chunk.logits == "all":
                logits_rows.extend(range(offset, offset + chunk.length))
            elif chunk.logits == "last":
                logits_rows.append(offset + chunk.length - 1)
            logits_slices.append(slice(first, len(logits_rows)))
            if chunk.length == 1:
                decode_rows.append(offset)
                decode_chunks.append(chunk)
            else:
                self._groups.append(
                    _AttentionGroup(
                        slice(offset, offset + chunk.length),
                        self._key_slots([chunk]).to(self.device),
                        torch.arange(chunk.start, chunk.end, device=self.device).unsqueeze(0),
                    )
                )
        if decode_chunks:
            self._groups.append(
                _AttentionGroup(
                    torch.tensor(decode_rows, device=self.device),
                    self._key_slots(decode_chunks).to(self.device),
                    torch.tensor([[c.start] for c in decode_chunks], device=self.device),
                )
            )
        self._slots = self._token_slots(chunks)
        self.logits_indices = torch.tensor(logits_rows, dtype=torch.long, device=self.device)
        as_row = {"dtype": torch.long, "device": self.device}
        return torch.tensor([ids], **as_row), torch.tensor([positions], **as_row), logits_slices

    @internal_api
    def prepare_padded_decode(
        self, chunks: Sequence[ScheduledChunk], buffers: DecodeBuffers, rows: int, key_blocks: int
    ) -> list[slice]:
        """Lay out one-token ``chunks`` padded to ``rows`` requests seeing ``key_blocks`` blocks each,
        in ``buffers``' views of that shape (which a captured CUDA graph reads); return, per chunk,
        its rows of the step's logits (``logits_indices`` is every row). Padded rows are token 0 at
        position 0 writing and reading only ``padding_slot``."""
        if any(chunk.length != 1 for chunk in chunks) or len(chunks) > rows:
            raise ValueError(f"a padded decode step takes at most {rows} one-token chunks")
        if max(chunk.end for chunk in chunks) > key_blocks * self.block_size:
            raise ValueError(f"a chunk in this step sees more than {key_blocks} blocks")
        width = key_blocks * self.block_size
        key_slots = torch.full((rows, width), self.padding_slot, dtype=torch.long)
        key_slots[: len(chunks)] = self._key_slots(chunks, width)
        ids = torch.zeros(rows, dtype=torch.long)
        ids[: len(chunks)] = torch.tensor([chunk.request.tokens[chunk.start] for chunk in chunks])
        positions = torch.zeros(rows, dtype=torch.long)
        positions[: len(chunks)] = torch.tensor([chunk.start for chunk in chunks])
        view = buffers.view(rows, width)
        view.input_ids.copy_(ids.unsqueeze(0))
        view.position_ids.copy_(positions.unsqueeze(0))  # query_positions share this memory
        view.key_slots.copy_(key_slots)
        view.token_slots.copy_(key_slots.gather(1, positions.unsqueeze(1)).squeeze(1))
        self._slots = view.token_slots
        self._groups = [_AttentionGroup(slice(0, rows), view.key_slots, view.query_positions)]
        self.logits_indices = view.logits_indices
        return [slice(i, i + 1) if chunk.logits != "none" else slice(i, i) for i, chunk in enumerate(chunks)]

    def _key_slots(self, chunks: Sequence[ScheduledChunk], length: int | None = None) -> torch.Tensor:
        """``[B, L]`` cache slots (on the CPU) of positions ``0 .. L - 1`` of each chunk's request (0
        past its end); ``L`` is the longest chunk end unless given (a multiple of ``block_size``)."""
        length = max(chunk.end for chunk in chunks) if length is None else length
        width = self.blocks_needed(length)
        table = torch.zeros(len(chunks), width, dtype=torch.long)
        for i, chunk in enumerate(chunks):
            blocks = chunk.request.block_ids[: self.blocks_needed(chunk.end)]
            table[i, : len(blocks)] = torch.tensor(blocks, dtype=torch.long)
        positions = torch.arange(length)
        slots = table[:, positions // self.block_size] * self.block_size + positions % self.block_size
        return slots

    def _token_slots(self, chunks: Sequence[ScheduledChunk]) -> torch.Tensor:
        slots: list[int] = []
        size = self.block_size
        for chunk in chunks:
            blocks = chunk.request.block_ids
            slots.extend(blocks[p // size] * size + p % size for p in range(chunk.start, chunk.end))
        return torch.tensor(slots, dtype=torch.long, device=self.device)

    def attend(
        self,
        layer_number: int,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        *,
        scale: float,
        window_size: int | None,
        sink_logits: torch.Tensor | None,
    ) -> torch.Tensor:
        """Write this step's ``key, value [t, g, d]`` into the cache of ``layer_number`` and attend
        each request's queries ``[t, n, d]`` over its cached keys; ``[t, n * d]``."""
        layer_cache = self.kv_cache[layer_number - self.first_layer_number]
        key_cache, value_cache = layer_cache[0], layer_cache[1]
        key_cache.index_copy_(0, self._slots, key.to(key_cache.dtype))
        value_cache.index_copy_(0, self._slots, value.to(value_cache.dtype))
        tokens, heads, head_dim = query.shape
        output = query.new_empty(tokens, heads * head_dim)
        for group in self._groups:
            positions = group.query_positions
            q = query[group.rows].view(*positions.shape, heads, head_dim)
            context = paged_attention(
                q,
                key_cache,
                value_cache,
                group.key_slots,
                positions,
                scale=scale,
                window_size=window_size,
                sink_logits=sink_logits,
            )
            output[group.rows] = context.view(-1, heads * head_dim)
        return output
