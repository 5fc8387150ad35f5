"""Finding a free TCP port and agreeing on it across ranks."""

from __future__ import annotations

import socket
from pathlib import Path

import torch
import torch.distributed as dist
from mcore_api import internal_api

from ..device import get_group_device

_LINUX_EPHEMERAL_DEFAULT = (32768, 60999)


@internal_api
def ephemeral_port_range() -> tuple[int, int]:
    """The OS range ``(low, high)`` that ports bound to 0 come from (Linux's default when unknown)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return _LINUX_EPHEMERAL_DEFAULT


def find_free_port(host: str = "127.0.0.1") -> int:
    """A port in the ephemeral range that nothing listens on right now (the OS picks it).

    Another process may take it before you bind it; bind soon.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def broadcast_free_port(group: dist.ProcessGroup | None = None, host: str = "127.0.0.1") -> int:
    """A free port found on the group's first rank, returned on every rank of ``group`` (collective)."""
    port = torch.zeros(1, dtype=torch.int64, device=get_group_device(group))
    if dist.get_rank(group) == 0:
        port.fill_(find_free_port(host))
    dist.broadcast(port, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    return int(port.item())
