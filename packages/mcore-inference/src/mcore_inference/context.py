"""The paged KV cache: its tensors, block budget and block tables, and the attention of the step
laid out in it (implements ``mcore_models.InferenceContext``; ``model_runner`` lays steps out)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from mcore_kernels import paged_kv_append
from mcore_models import MambaInferenceStateConfig, MambaStepLayout, mamba_state_config_of

from .attention import StepAttention, attend_step
from .block_allocator import BlockAllocator
from .block_table import BlockTables
from .errors import MaxSequenceLengthOverflowError
from .mamba_states import MambaStateSlots
from .pipeline import agree_block_count, block_count_group, model_groups

if TYPE_CHECKING:
    from mcore_models import InferenceModel
    from mcore_parallel import ProcessGroupCollection


def _free_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


class DynamicInferenceContext:
    """A paged KV cache of ``num_blocks`` blocks of ``block_size`` tokens for the local layers
    ``first_layer_number ..`` of a model, each request's blocks as a row of ``block_tables``, and
    the current step as ``ModelRunner`` laid it out, whose attention ``attend`` computes.

    ``kv_cache_memory`` is a budget in bytes (``int``) or a fraction of the device's free memory
    (``float`` in ``(0, 1]``); the block count is the budget over ``bytes_per_block``, made equal on
    every rank of ``block_count_group`` (all-reduce MIN; e.g. the pipeline or model-parallel group).
    A step holds at most ``max_requests`` requests and ``max_tokens`` tokens; a sequence at most
    ``max_sequence_length`` tokens (and never more than the cache).

    ``mamba_state`` (a hybrid model's ``MambaInferenceStateConfig``) adds a conv and an SSM state
    slot per request for its Mamba layers (``mamba_slots``, ``mamba_states``; implements
    ``mcore_models.MambaInferenceContext``): ``max_requests`` slots, taken out of
    ``kv_cache_memory`` before the blocks, which then hold keys and values of its attention layers
    only (of one layer if it has none). Prefix caching is then off whatever
    ``enable_prefix_caching`` says (as vLLM turns it off for hybrid models): a cached block holds
    keys and values, not the Mamba state after its tokens.
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
        mamba_state: MambaInferenceStateConfig | None = None,
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
        attention = (
            mamba_state.layers_of_type("attention")
            if mamba_state is not None
            else range(first_layer_number, first_layer_number + num_layers)
        )
        self._cache_layer = {number: i for i, number in enumerate(attention)}  # layer -> cache index
        self.num_cache_layers = max(len(attention), 1)
        self.bytes_per_block = 2 * self.num_cache_layers * block_size * num_kv_heads * head_dim * element
        self.mamba_slots = (
            MambaStateSlots(mamba_state, max_requests, self.device) if mamba_state is not None else None
        )
        num_blocks = self._block_budget_bytes(kv_cache_memory) // self.bytes_per_block
        num_blocks = agree_block_count(num_blocks, block_count_group)
        self.allocator = BlockAllocator(
            num_blocks, block_size, enable_prefix_caching=enable_prefix_caching and mamba_state is None
        )
        capacity = num_blocks * block_size
        self.max_sequence_length = (
            capacity if max_sequence_length is None else min(max_sequence_length, capacity)
        )
        self.block_tables = BlockTables(self.blocks_needed(self.max_sequence_length), max_requests)
        self.kv_cache: torch.Tensor | None = None
        # The step laid out in the cache (set by ``ModelRunner``): rows of the logits, the slot of
        # each new token, and how its queries attend.
        self.logits_indices: torch.Tensor | None = None
        self.token_slots = torch.empty(0, dtype=torch.long)
        self.step_attention = StepAttention()
        self.mamba_layout = MambaStepLayout(
            torch.empty(0, dtype=torch.long), torch.empty(0, dtype=torch.long)
        )
        self.allocate()

    @classmethod
    def from_model(
        cls, model: InferenceModel, *, pg_collection: ProcessGroupCollection | None = None, **kwargs
    ) -> DynamicInferenceContext:
        """A context shaped for ``model`` (an ``mcore_models.InferenceModel``: this rank's stage
        and heads, from its ``kv_cache_spec``, its ``max_sequence_length``, and its Mamba state
        from ``mamba_state_config_of``).

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
            "mamba_state": mamba_state_config_of(model),
        }
        return cls(**(defaults | kwargs))

    def _block_budget_bytes(self, kv_cache_memory: int | float) -> int:
        """The bytes of ``kv_cache_memory`` left for blocks after the Mamba states."""
        budget, states = self._budget_bytes(kv_cache_memory), self._mamba_bytes
        if states and budget <= states:
            raise ValueError(
                f"kv_cache_memory ({budget} bytes) must exceed the {states} bytes of Mamba states "
                f"({self.max_requests} max_requests slots)"
            )
        return budget - states

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
        """Bytes the cache blocks (the padding slot aside) and Mamba states take while allocated."""
        return self.num_blocks * self.bytes_per_block + self._mamba_bytes

    @property
    def _mamba_bytes(self) -> int:
        return self.mamba_slots.memory_bytes if self.mamba_slots is not None else 0

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
            self.num_cache_layers,
            2,
            self.padding_slot + 1,
            self.num_kv_heads,
            self.head_dim,
            dtype=self.dtype,
            device=self.device,
        )
        self.allocator.reset()
        self.block_tables.reset()
        if self.mamba_slots is not None:
            self.mamba_slots.allocate()

    def deallocate(self) -> int:
        """Free the cache tensors and every block assignment; return the bytes freed."""
        freed = self.memory_bytes if self.kv_cache is not None else 0
        self.kv_cache = None
        self.allocator.reset()
        self.block_tables.reset()
        if self.mamba_slots is not None:
            self.mamba_slots.deallocate()
        self.step_attention = StepAttention()
        return freed

    def drop_request(self, request_id: int) -> None:
        """Forget ``request_id``'s block-table row and Mamba state slot (no-op for those it lacks)."""
        self.block_tables.drop(request_id)
        if self.mamba_slots is not None:
            self.mamba_slots.drop(request_id)

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks that ``num_tokens`` tokens occupy."""
        return -(-num_tokens // self.block_size)

    def check_sequence_length(self, length: int) -> None:
        """Raise ``MaxSequenceLengthOverflowError`` if ``length`` exceeds ``max_sequence_length``."""
        if length > self.max_sequence_length:
            raise MaxSequenceLengthOverflowError(
                f"sequence of {length} tokens exceeds max_sequence_length {self.max_sequence_length}"
            )

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
        each request's queries ``[t, n, d]`` over its cached keys (see ``attend_step``); ``[t, n * d]``."""
        layer_cache = self.kv_cache[self._cache_layer[layer_number]]
        key_cache, value_cache = layer_cache[0], layer_cache[1]
        if self.step_attention.backend(query) == "triton":
            paged_kv_append(key_cache, value_cache, key, value, self.token_slots)
        else:
            key_cache.index_copy_(0, self.token_slots, key.to(key_cache.dtype))
            value_cache.index_copy_(0, self.token_slots, value.to(value_cache.dtype))
        blocks = (self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        return attend_step(
            self.step_attention,
            query,
            key,
            value,
            key_cache[: self.padding_slot].view(blocks),
            value_cache[: self.padding_slot].view(blocks),
            scale=scale,
            window_size=window_size,
            sink_logits=sink_logits,
        )

    def mamba_states(self, layer_number: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The conv and SSM state slots ``[max_requests, ...]`` of Mamba layer ``layer_number``;
        ``mamba_layout`` says which rows of the step continue which slot."""
        if self.mamba_slots is None:
            raise ValueError("this context keeps no Mamba states: it was built without mamba_state")
        return self.mamba_slots.states(layer_number)
