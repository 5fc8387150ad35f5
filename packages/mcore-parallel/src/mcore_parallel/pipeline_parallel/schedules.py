"""Forward/backward schedules over micro-batches: no pipelining, 1F1B and interleaved 1F1B."""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from .p2p import P2PCommunicator
from .schedule_plan import schedule_actions

ForwardStepFunc = Callable[[Iterator[Any], torch.nn.Module, "torch.Tensor | None"], torch.Tensor]
"""``forward_step_func(data_iterator, model_chunk, input_tensor)``: run one micro-batch through
``model_chunk``. ``input_tensor`` is ``None`` on the first stage (read the data instead); on the
last stage return the micro-batch's scalar loss, elsewhere the activation for the next stage."""


def _no_sync(model: torch.nn.Module, last: bool):
    """``model.no_sync()`` (DDP) for every micro-batch's backward but the last one."""
    if last or not hasattr(model, "no_sync"):
        return contextlib.nullcontext()
    return model.no_sync()


def forward_backward_no_pipelining(
    *,
    forward_step_func: ForwardStepFunc,
    data_iterator: Iterator[Any],
    model: torch.nn.Module,
    num_microbatches: int,
    forward_only: bool = False,
) -> list[torch.Tensor]:
    """Run ``num_microbatches`` forward (and backward) passes on one stage, accumulating gradients.

    Each loss is divided by ``num_microbatches`` before backward, so the gradients are those of the
    mean loss. Returns the detached per-micro-batch losses.
    """
    if num_microbatches < 1:
        raise ValueError(f"num_microbatches must be >= 1, got {num_microbatches}")
    losses = []
    for index in range(num_microbatches):
        with torch.set_grad_enabled(not forward_only):
            loss = forward_step_func(data_iterator, model, None)
        if not forward_only:
            with _no_sync(model, index == num_microbatches - 1):
                (loss / num_microbatches).backward()
        losses.append(loss.detach())
    return losses


def forward_backward_pipelining(
    *,
    forward_step_func: ForwardStepFunc,
    data_iterator: Iterator[Any] | list[Iterator[Any]],
    model: torch.nn.Module | list[torch.nn.Module],
    num_microbatches: int,
    pp_group: dist.ProcessGroup,
    forward_only: bool = False,
    dtype: torch.dtype = torch.float32,
    tensor_shape: tuple[int, ...] | None = None,
) -> list[torch.Tensor]:
    """1F1B over the stages of ``pp_group``; interleaved 1F1B when ``model`` is a list of chunks.

    With ``v`` chunks per stage and ``p`` stages, chunk ``c`` of stage ``s`` is virtual stage
    ``c * p + s``; ``data_iterator`` is then a list with one iterator per chunk. Activations travel
    with a shape handshake unless ``tensor_shape`` is given, so micro-batches may differ in shape.
    Sends are asynchronous and receives block, in the order ``schedule_actions`` gives.
    Returns the detached per-micro-batch losses on the last stage, ``[]`` elsewhere. Gradients are
    those of the mean loss; DDP-wrapped chunks reduce only during their last micro-batch.
    """
    chunks = list(model) if isinstance(model, list) else [model]
    iterators = list(data_iterator) if isinstance(data_iterator, list) else [data_iterator]
    if len(iterators) != len(chunks):
        raise ValueError(f"got {len(iterators)} data iterators for {len(chunks)} model chunks")
    p2p = P2PCommunicator(pp_group, dtype=dtype, tensor_shape=tensor_shape)
    first_stage, last_stage = p2p.stage == 0, p2p.stage == p2p.num_stages - 1
    last_chunk = len(chunks) - 1
    in_flight: list[deque] = [deque() for _ in chunks]
    sends: list[tuple[torch.Tensor, list[dist.Work]]] = []  # tensors stay alive until sent
    losses = []
    actions = schedule_actions(p2p.stage, p2p.num_stages, num_microbatches, len(chunks), forward_only)
    for kind, chunk, microbatch in actions:
        receives_input = not (first_stage and chunk == 0)
        produces_loss = last_stage and chunk == last_chunk
        if kind == "F":
            input_tensor = p2p.recv_forward().requires_grad_(not forward_only) if receives_input else None
            with torch.set_grad_enabled(not forward_only):
                output = forward_step_func(iterators[chunk], chunks[chunk], input_tensor)
            if produces_loss:
                losses.append(output.detach())
                output = output / num_microbatches
            else:
                sends.append((output, p2p.isend_forward(output)))
            if not forward_only:
                in_flight[chunk].append((input_tensor, output))
            continue
        input_tensor, output = in_flight[chunk].popleft()
        grad = None if produces_loss else p2p.recv_backward(output.shape)
        with _no_sync(chunks[chunk], microbatch == num_microbatches - 1):
            torch.autograd.backward(output, grad)
        if receives_input:
            sends.append((input_tensor.grad, p2p.isend_backward(input_tensor.grad)))
    for _, works in sends:
        for work in works:
            work.wait()
    return losses


def get_forward_backward_func(pipeline_model_parallel_size: int) -> Callable[..., list[torch.Tensor]]:
    """``forward_backward_no_pipelining`` for one stage, else ``forward_backward_pipelining``."""
    if pipeline_model_parallel_size < 1:
        raise ValueError(f"pipeline_model_parallel_size must be >= 1, got {pipeline_model_parallel_size}")
    return (
        forward_backward_no_pipelining if pipeline_model_parallel_size == 1 else forward_backward_pipelining
    )
