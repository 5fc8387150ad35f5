"""First-fit-decreasing assignment of sequence lengths to bins of a fixed capacity."""

from __future__ import annotations


def first_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    """The indices of ``lengths`` grouped into bins whose lengths sum to at most ``capacity``:
    longest first (ties in index order), each into the first bin with room. Each bin lists its
    indices in increasing order. Every length must be at most ``capacity``."""
    bins: list[list[int]] = []
    room: list[int] = []
    for index in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        target = next((b for b, free in enumerate(room) if free >= lengths[index]), len(bins))
        if target == len(bins):
            bins.append([])
            room.append(capacity)
        bins[target].append(index)
        room[target] -= lengths[index]
    return [sorted(members) for members in bins]
