"""``HyperCommGrid``: ranks laid out on a grid of named dimensions, with a process group per slice."""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Sequence
from typing import Any

import torch.distributed as dist


class HyperCommGrid:
    """``size = prod(shape)`` consecutive ranks starting at ``rank_offset``, on a grid of named dimensions.

    The first dimension varies fastest: with ``shape=[2, 3]`` and ``dim_names=["tp", "dp"]``, ranks
    0 and 1 share a ``dp`` coordinate and form a ``tp`` group. A group over a set of dimensions holds
    the ranks that agree on every other coordinate.

    Rank arithmetic (``coordinates``, ``rank_at``, ``rank_groups``, ``group_ranks``) needs no process
    group. ``create_group`` calls ``torch.distributed.new_group`` on every rank of the default group,
    so all ranks must call it in the same order; each set of dimensions gets its group once. Grids
    made with ``view`` share their groups: a slice with the same ranks is the same group object.
    """

    def __init__(self, shape: Sequence[int], dim_names: Sequence[str], rank_offset: int = 0):
        shape, dim_names = list(shape), list(dim_names)
        if len(shape) != len(dim_names):
            raise ValueError(f"shape {shape} and dim_names {dim_names} must have the same length")
        if len(set(dim_names)) != len(dim_names):
            raise ValueError(f"dim_names must be unique, got {dim_names}")
        for name, extent in zip(dim_names, shape, strict=True):
            if not isinstance(extent, int) or extent < 1:
                raise ValueError(f"size of dimension {name!r} must be an integer >= 1, got {extent!r}")
        if rank_offset < 0:
            raise ValueError(f"rank_offset must be >= 0, got {rank_offset}")
        self.shape = shape
        self.dim_names = dim_names
        self.rank_offset = rank_offset
        self.size = math.prod(shape)
        self._strides = [math.prod(shape[:i]) for i in range(len(shape))]
        # Keyed by the tuple of member ranks, and shared with views of this grid.
        self._groups_by_ranks: dict[tuple[int, ...], dist.ProcessGroup | None] = {}
        self._created: dict[tuple[str, ...], dist.ProcessGroup | None] = {}

    def __repr__(self) -> str:
        dims = ", ".join(f"{n}={s}" for n, s in zip(self.dim_names, self.shape, strict=True))
        return f"HyperCommGrid({dims}, rank_offset={self.rank_offset})"

    def view(self, shape: Sequence[int], dim_names: Sequence[str]) -> HyperCommGrid:
        """Another factorisation of the same ranks; groups with identical members are shared."""
        other = HyperCommGrid(shape, dim_names, self.rank_offset)
        if other.size != self.size:
            raise ValueError(
                f"a view must cover the same {self.size} ranks, but shape {list(shape)} has {other.size}"
            )
        other._groups_by_ranks = self._groups_by_ranks
        return other

    def extent(self, dim: str) -> int:
        """The size of dimension ``dim``."""
        return self.shape[self._index(dim)]

    def coordinates(self, rank: int) -> dict[str, int]:
        """The coordinate of global ``rank`` along every dimension."""
        local = rank - self.rank_offset
        if not 0 <= local < self.size:
            raise ValueError(
                f"rank {rank} is outside this grid (ranks {self.rank_offset}..{self.rank_offset + self.size - 1})"
            )
        return {name: (local // stride) % extent for name, stride, extent in self._dims()}

    def rank_at(self, **coordinates: int) -> int:
        """The global rank at the given coordinates; every dimension must be named."""
        if set(coordinates) != set(self.dim_names):
            raise ValueError(
                f"rank_at needs a coordinate for each of {self.dim_names}, got {sorted(coordinates)}"
            )
        for name, _, extent in self._dims():
            if not 0 <= coordinates[name] < extent:
                raise ValueError(f"coordinate {name}={coordinates[name]} is outside 0..{extent - 1}")
        return self.rank_offset + sum(coordinates[n] * s for n, s, _ in self._dims())

    def rank_groups(self, dims: str | Iterable[str]) -> list[list[int]]:
        """Every group spanning ``dims`` (names, or one ``"tp-cp"`` string), as lists of global ranks.

        Within a group, ranks are ordered by their coordinates along ``dims``, the first grid dimension
        fastest; groups are ordered by the remaining coordinates the same way.
        """
        key = self._key(dims)
        inside = [d for d in self._dims() if d[0] in key]
        outside = [d for d in self._dims() if d[0] not in key]
        groups = []
        for outer in _grid_points([extent for _, _, extent in outside]):
            base = self.rank_offset + sum(
                c * stride for c, (_, stride, _) in zip(outer, outside, strict=True)
            )
            groups.append(
                [
                    base + sum(c * stride for c, (_, stride, _) in zip(inner, inside, strict=True))
                    for inner in _grid_points([extent for _, _, extent in inside])
                ]
            )
        return groups

    def group_ranks(self, dims: str | Iterable[str], rank: int) -> list[int]:
        """The members of the ``dims`` group that contains global ``rank``."""
        self.coordinates(rank)  # validates the rank
        return next(ranks for ranks in self.rank_groups(dims) if rank in ranks)

    def create_group(self, dims: str | Iterable[str], **options: Any) -> dist.ProcessGroup | None:
        """Create the process groups spanning ``dims`` and return the one holding this rank.

        Collective over the default group. ``options`` go to ``torch.distributed.new_group`` (for
        example ``backend`` or ``timeout``). Returns ``None`` on a rank outside the grid.

        Raises:
            RuntimeError: the default process group is not initialized, or these dimensions already
                have groups (use ``get_group``).
        """
        key = self._key(dims)
        if key in self._created:
            raise RuntimeError(f"process groups for dimensions {list(key)} already exist; use get_group")
        if not dist.is_initialized():
            raise RuntimeError("create_group needs an initialized default process group")
        world_size = dist.get_world_size()
        if self.rank_offset + self.size > world_size:
            raise ValueError(
                f"the grid covers ranks {self.rank_offset}..{self.rank_offset + self.size - 1}, "
                f"but the world size is {world_size}"
            )
        my_rank = dist.get_rank()
        mine = None
        for ranks in self.rank_groups(key):
            members = tuple(ranks)
            if members not in self._groups_by_ranks:
                self._groups_by_ranks[members] = dist.new_group(list(members), **options)
            if my_rank in members:
                mine = self._groups_by_ranks[members]
        self._created[key] = mine
        return mine

    def get_group(self, dims: str | Iterable[str]) -> dist.ProcessGroup | None:
        """The group spanning ``dims`` that holds this rank, made earlier by ``create_group``."""
        key = self._key(dims)
        if key not in self._created:
            raise KeyError(f"no process group for dimensions {list(key)}; call create_group first")
        return self._created[key]

    def _dims(self) -> list[tuple[str, int, int]]:
        return list(zip(self.dim_names, self._strides, self.shape, strict=True))

    def _index(self, dim: str) -> int:
        if dim not in self.dim_names:
            raise ValueError(f"unknown dimension {dim!r}; this grid has {self.dim_names}")
        return self.dim_names.index(dim)

    def _key(self, dims: str | Iterable[str]) -> tuple[str, ...]:
        names = dims.split("-") if isinstance(dims, str) else list(dims)
        if not names or len(set(names)) != len(names):
            raise ValueError(f"dimensions must be a non-empty list of distinct names, got {names}")
        return tuple(sorted(names, key=self._index))


def _grid_points(extents: list[int]) -> list[tuple[int, ...]]:
    """All coordinate tuples of a grid, the first coordinate varying fastest."""
    return [point[::-1] for point in itertools.product(*(range(e) for e in reversed(extents)))]
