"""Batched point-to-point sends and receives, with a shape handshake for activations of any shape."""

from __future__ import annotations

import torch
import torch.distributed as dist

FORWARD_TAG = 0
BACKWARD_TAG = 1
MAX_DIMS = 8


def send_tensors(sends: list[tuple[torch.Tensor, int, int]], recvs: list[tuple[torch.Tensor, int, int]]):
    """Post ``(tensor, global peer rank, tag)`` sends and receives as one batch; returns the work handles."""
    ops = [dist.P2POp(dist.isend, t.contiguous(), peer, tag=tag) for t, peer, tag in sends]
    ops += [dist.P2POp(dist.irecv, t, peer, tag=tag) for t, peer, tag in recvs]
    return dist.batch_isend_irecv(ops) if ops else []


def encode_shape(shape: torch.Size, device: torch.device) -> torch.Tensor:
    """``[ndim, d0, d1, ...]`` padded to ``MAX_DIMS + 1`` int64 values."""
    if len(shape) > MAX_DIMS:
        raise ValueError(f"tensors sent between stages may have at most {MAX_DIMS} dims, got {len(shape)}")
    encoded = torch.zeros(MAX_DIMS + 1, dtype=torch.int64, device=device)
    encoded[0] = len(shape)
    encoded[1 : 1 + len(shape)] = torch.tensor(list(shape), dtype=torch.int64)
    return encoded


def decode_shape(encoded: torch.Tensor) -> torch.Size:
    """The shape ``encode_shape`` wrote."""
    values = encoded.tolist()
    return torch.Size(values[1 : 1 + values[0]])


class P2PCommunicator:
    """Send activations forward and gradients backward between neighbouring stages of ``pp_group``.

    Stages form a ring (the last stage's next is the first), which the interleaved schedule uses.
    Activations are preceded by their shape unless ``tensor_shape`` fixes it, so micro-batches may
    differ in shape; gradients have the shape of the activation they belong to. ``isend_*`` return
    work handles to wait on later; the others block until done. Forward and backward traffic use
    different tags, so they may be in flight at once (gloo; NCCL ignores tags).
    """

    def __init__(
        self,
        pp_group: dist.ProcessGroup,
        *,
        dtype: torch.dtype = torch.float32,
        tensor_shape: tuple[int, ...] | None = None,
        device: torch.device | None = None,
    ):
        ranks = dist.get_process_group_ranks(pp_group)
        index = ranks.index(dist.get_rank())
        self.stage, self.num_stages = index, len(ranks)
        self.next_rank = ranks[(index + 1) % len(ranks)]
        self.prev_rank = ranks[(index - 1) % len(ranks)]
        self.dtype = dtype
        self.tensor_shape = None if tensor_shape is None else torch.Size(tensor_shape)
        self.device = device if device is not None else torch.device("cpu")

    def _shape_sends(self, tensor: torch.Tensor, peer: int) -> list[tuple[torch.Tensor, int, int]]:
        if self.tensor_shape is not None:
            return []
        return [(encode_shape(tensor.shape, self.device), peer, FORWARD_TAG)]

    def _recv_shape(self, peer: int) -> torch.Size:
        if self.tensor_shape is not None:
            return self.tensor_shape
        encoded = torch.empty(MAX_DIMS + 1, dtype=torch.int64, device=self.device)
        for work in send_tensors([], [(encoded, peer, FORWARD_TAG)]):
            work.wait()
        return decode_shape(encoded)

    def isend_forward(self, tensor: torch.Tensor) -> list[dist.Work]:
        """Start sending an activation to the next stage."""
        tensor = tensor.detach()
        return send_tensors(
            [*self._shape_sends(tensor, self.next_rank), (tensor, self.next_rank, FORWARD_TAG)], []
        )

    def isend_backward(self, grad: torch.Tensor) -> list[dist.Work]:
        """Start sending a gradient to the previous stage."""
        return send_tensors([(grad.detach(), self.prev_rank, BACKWARD_TAG)], [])

    def recv_forward(self) -> torch.Tensor:
        """Receive an activation from the previous stage."""
        buffer = torch.empty(self._recv_shape(self.prev_rank), dtype=self.dtype, device=self.device)
        for work in send_tensors([], [(buffer, self.prev_rank, FORWARD_TAG)]):
            work.wait()
        return buffer

    def recv_backward(self, shape: torch.Size) -> torch.Tensor:
        """Receive the gradient of an activation of ``shape`` from the next stage."""
        buffer = torch.empty(shape, dtype=self.dtype, device=self.device)
        for work in send_tensors([], [(buffer, self.next_rank, BACKWARD_TAG)]):
            work.wait()
        return buffer

    def send_forward(self, tensor: torch.Tensor) -> None:
        """Send an activation to the next stage and wait."""
        for work in self.isend_forward(tensor):
            work.wait()

    def send_backward(self, grad: torch.Tensor) -> None:
        """Send a gradient to the previous stage and wait."""
        for work in self.isend_backward(grad):
            work.wait()

    def send_forward_recv_backward(self, tensor: torch.Tensor) -> torch.Tensor:
        """Send an activation forward and receive its gradient back, in one batch."""
        tensor = tensor.detach()
        grad = torch.empty(tensor.shape, dtype=self.dtype, device=self.device)
        sends = [*self._shape_sends(tensor, self.next_rank), (tensor, self.next_rank, FORWARD_TAG)]
        for work in send_tensors(sends, [(grad, self.next_rank, BACKWARD_TAG)]):
            work.wait()
        return grad

    def send_backward_recv_forward(self, grad: torch.Tensor) -> torch.Tensor:
        """Send a gradient backward and receive the next activation from the previous stage.

        The gradient is posted first, so a previous stage that waits for it before sending on
        does not deadlock with the shape handshake.
        """
        works = self.isend_backward(grad)
        activation = self.recv_forward()
        for work in works:
            work.wait()
        return activation
