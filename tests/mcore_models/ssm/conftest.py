"""Random inputs for the Mamba-2 SSD tests."""

import pytest
import torch


@pytest.fixture
def ssd_inputs():
    """``ssd_inputs(batch, seqlen, nheads, headdim, ngroups, dstate, dtype=..., seed=...)``: a dict of
    SSD inputs ``x, dt, A, B, C, D, initial_state`` with realistic ranges (dt in [0.05, 1],
    A in [-4, -0.5])."""

    def make(
        batch: int = 2,
        seqlen: int = 7,
        nheads: int = 4,
        headdim: int = 3,
        ngroups: int = 2,
        dstate: int = 5,
        *,
        dtype: torch.dtype = torch.float64,
        seed: int = 0,
    ) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)

        def randn(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype)

        def uniform(low: float, high: float, *shape: int) -> torch.Tensor:
            return (low + (high - low) * torch.rand(*shape, generator=gen, dtype=torch.float64)).to(dtype)

        return {
            "x": randn(batch, seqlen, nheads, headdim),
            "dt": uniform(0.05, 1.0, batch, seqlen, nheads),
            "A": uniform(-4.0, -0.5, nheads),
            "B": randn(batch, seqlen, ngroups, dstate),
            "C": randn(batch, seqlen, ngroups, dstate),
            "D": randn(nheads),
            "initial_state": randn(batch, nheads, headdim, dstate),
        }

    return make
