"""``BridgeCommunicator``: activations and gradients between two grids of different TP/DP shape."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from mcore_api import experimental_api

from ..process_groups.hyper_comm_grid import HyperCommGrid
from .p2p import BACKWARD_TAG, FORWARD_TAG, MAX_DIMS, decode_shape, encode_shape, send_tensors


@experimental_api
class BridgeCommunicator:
    """Connect the last stage of ``src_grid`` to the first stage of ``dest_grid`` (dims ``tp`` and ``dp``).

    The batch (``batch_dim``) is split evenly over each grid's data-parallel ranks, and activations
    are replicated over tensor-parallel ranks. Forward: the TP-rank-0 of each source DP replica sends
    every destination rank the part of its batch slice that the destination's DP replica owns.
    Backward: the TP-rank-0 of each destination DP replica sends the gradient parts back to every
    source rank of the replicas they came from. Shapes travel with the data. Ranks in neither grid
    do nothing; a source rank calls the ``*_forward`` senders and ``recv_backward``, a destination
    rank ``recv_forward`` and the ``*_backward`` senders.

    Raises:
        ValueError: a grid lacks a ``tp`` or ``dp`` dimension or has other dimensions of size > 1.
    """

    def __init__(
        self,
        src_grid: HyperCommGrid,
        dest_grid: HyperCommGrid,
        *,
        batch_dim: int = 1,
        dtype: torch.dtype = torch.float32,
        device: torch.device | None = None,
    ):
        for label, grid in (("src_grid", src_grid), ("dest_grid", dest_grid)):
            if not {"tp", "dp"} <= set(grid.dim_names) or grid.size != grid.extent("tp") * grid.extent("dp"):
                raise ValueError(f"{label} must have dims 'tp' and 'dp' (others of size 1), got {grid!r}")
        self.src_grid, self.dest_grid = src_grid, dest_grid
        self.batch_dim, self.dtype = batch_dim, dtype
        self.device = device if device is not None else torch.device("cpu")
        self.units = math.lcm(src_grid.extent("dp"), dest_grid.extent("dp"))
        rank = dist.get_rank()
        self.is_src = src_grid.rank_offset <= rank < src_grid.rank_offset + src_grid.size
        self.is_dest = dest_grid.rank_offset <= rank < dest_grid.rank_offset + dest_grid.size

    def _unit_range(self, grid: HyperCommGrid, dp_rank: int) -> tuple[int, int]:
        per = self.units // grid.extent("dp")
        return dp_rank * per, (dp_rank + 1) * per

    def _links(self, my_grid: HyperCommGrid, peer_grid: HyperCommGrid, sending: bool):
        """``(peer rank, first unit, end unit, my first unit)`` of each exchange; units split the batch."""
        me = my_grid.coordinates(dist.get_rank())
        if sending and me["tp"] != 0:
            return []
        mine = self._unit_range(my_grid, me["dp"])
        links = []
        for peer_dp in range(peer_grid.extent("dp")):
            theirs = self._unit_range(peer_grid, peer_dp)
            start, end = max(mine[0], theirs[0]), min(mine[1], theirs[1])
            if start >= end:
                continue
            peer_tps = range(peer_grid.extent("tp")) if sending else [0]
            others = _unit_coords(peer_grid)
            links += [
                (peer_grid.rank_at(tp=tp, dp=peer_dp, **others), start, end, mine[0]) for tp in peer_tps
            ]
        return links

    def _isend(self, tensor: torch.Tensor, my_grid, peer_grid, tag: int) -> tuple[list, list]:
        """Start the sends; returns the sent tensors (kept alive) and the work handles."""
        sends = []
        per_unit = tensor.shape[self.batch_dim] // (self.units // my_grid.extent("dp"))
        for peer, start, end, base in self._links(my_grid, peer_grid, sending=True):
            part = tensor.detach().narrow(self.batch_dim, (start - base) * per_unit, (end - start) * per_unit)
            sends += [(encode_shape(part.shape, self.device), peer, tag), (part.contiguous(), peer, tag)]
        return sends, send_tensors(sends, [])

    def _recv(self, my_grid, peer_grid, tag: int) -> torch.Tensor:
        links = self._links(my_grid, peer_grid, sending=False)
        shapes = [torch.empty(MAX_DIMS + 1, dtype=torch.int64, device=self.device) for _ in links]
        for work in send_tensors([], [(s, link[0], tag) for s, link in zip(shapes, links, strict=True)]):
            work.wait()
        parts = [torch.empty(decode_shape(s), dtype=self.dtype, device=self.device) for s in shapes]
        for work in send_tensors([], [(p, link[0], tag) for p, link in zip(parts, links, strict=True)]):
            work.wait()
        return torch.cat(parts, dim=self.batch_dim)

    @staticmethod
    def _wait(pending: tuple[list, list]) -> None:
        for work in pending[1]:
            work.wait()

    def send_forward(self, activation: torch.Tensor) -> None:
        """Source rank: send this replica's activation to the destination grid."""
        self._wait(self._isend(activation, self.src_grid, self.dest_grid, FORWARD_TAG))

    def recv_forward(self) -> torch.Tensor:
        """Destination rank: receive the activation of this rank's batch slice."""
        return self._recv(self.dest_grid, self.src_grid, FORWARD_TAG)

    def send_backward(self, grad: torch.Tensor) -> None:
        """Destination rank: send the gradient of the received activation back."""
        self._wait(self._isend(grad, self.dest_grid, self.src_grid, BACKWARD_TAG))

    def recv_backward(self) -> torch.Tensor:
        """Source rank: receive the gradient of the activation this replica sent."""
        return self._recv(self.src_grid, self.dest_grid, BACKWARD_TAG)

    def send_forward_recv_backward(self, activation: torch.Tensor) -> torch.Tensor:
        """Source rank: send an activation and receive its gradient."""
        pending = self._isend(activation, self.src_grid, self.dest_grid, FORWARD_TAG)
        grad = self.recv_backward()
        self._wait(pending)
        return grad

    def send_backward_recv_forward(self, grad: torch.Tensor) -> torch.Tensor:
        """Destination rank: send a gradient back and receive the next activation."""
        pending = self._isend(grad, self.dest_grid, self.src_grid, BACKWARD_TAG)
        activation = self.recv_forward()
        self._wait(pending)
        return activation


def _unit_coords(grid: HyperCommGrid) -> dict[str, int]:
    """Coordinate 0 on every dimension other than ``tp`` and ``dp`` (they have size 1)."""
    return {name: 0 for name in grid.dim_names if name not in ("tp", "dp")}
