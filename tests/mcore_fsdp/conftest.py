"""Tiny models, data and the packaged examples shared by the mcore-fsdp tests, as fixtures
(tests are not a package)."""

import importlib.util
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from mcore_fsdp import CheckpointMismatchError, FSDPConfigError
from torch import nn


class Block(nn.Module):
    """A residual MLP block: one sharding unit."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.proj(self.norm(x)))


class TinyNet(nn.Module):
    """Input projection, ``depth`` blocks, output head; the root unit keeps the two projections.

    ``recompute`` runs each block under non-reentrant activation checkpointing.
    """

    def __init__(self, dim: int = 8, depth: int = 3, recompute: bool = False) -> None:
        super().__init__()
        self.embed = nn.Linear(5, dim)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(depth))
        self.head = nn.Linear(dim, 3)
        self.recompute = recompute

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            if self.recompute:
                x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        return self.head(x)


def global_batch(step: int, world_size: int, per_rank: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """The same global batch on every rank, for step ``step``."""
    generator = torch.Generator().manual_seed(1000 + step)
    inputs = torch.randn(world_size * per_rank, 5, generator=generator)
    targets = torch.randn(world_size * per_rank, 3, generator=generator)
    return inputs, targets


def local_part(tensor: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    return tensor.chunk(world_size)[rank]


def mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((output.float() - target) ** 2).mean()


@pytest.fixture
def tiny():
    """Namespace of the helpers above: ``tiny.Net``, ``tiny.Block``, ``tiny.batch``, ``tiny.local``, ``tiny.mse``."""

    class Helpers:
        Net = TinyNet
        Block = Block
        batch = staticmethod(global_batch)
        local = staticmethod(local_part)
        loss = staticmethod(mse)

    return Helpers


def error_on_rank0(make_call):
    """Run ``make_call`` on rank 0 only and return ``"ErrorType: message"`` of the typed error it
    must raise (``None`` on the other ranks, which return at once).

    A call that reached a collective would wait for a peer that never comes and time out instead
    of raising: so the error is shown to come before any collective.
    """
    if dist.get_rank() != 0:
        return None
    with pytest.raises((FSDPConfigError, CheckpointMismatchError)) as error:
        make_call()
    return f"{type(error.value).__name__}: {error.value}"


@pytest.fixture
def rank0_error():
    """``error_on_rank0`` above, as a fixture."""
    return error_on_rank0


EXAMPLES = Path(__file__).resolve().parents[2] / "packages" / "mcore-fsdp" / "examples"


@pytest.fixture(scope="session")
def hf_llama_example():
    """``examples/train_hf_llama.py`` imported as a module (skips without ``transformers``)."""
    pytest.importorskip("transformers")
    spec = importlib.util.spec_from_file_location("train_hf_llama", EXAMPLES / "train_hf_llama.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
