"""First-fit-decreasing assignment of sequence lengths to bins of a fixed capacity, and the
capacity that pads them least."""

from __future__ import annotations

import math


def first_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    """The indices of ``lengths`` grouped into bins whose lengths sum to at most ``capacity``:
    longest first (ties in index order), each into the first bin with room. Each bin lists its
    indices in increasing order. Every length must be at most ``capacity``."""
    bins: list[list[int]] = []
    room: list[int] = []
    open_bins: list[int] = []  # the bins with room for the shortest length, in order
    shortest = min(lengths, default=0)
    for index in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        place = next((p for p, b in enumerate(open_bins) if room[b] >= lengths[index]), None)
        if place is None:
            place = len(open_bins)
            open_bins.append(len(bins))
            bins.append([])
            room.append(capacity)
        target = open_bins[place]
        bins[target].append(index)
        room[target] -= lengths[index]
        if room[target] < shortest:  # full for good: no length left fits
            del open_bins[place]
    return [sorted(members) for members in bins]


def tightest_capacity(lengths: list[int], largest: int, multiple: int = 1) -> int:
    """Of the bin capacities that hold 1, 2, 3, ... of the longest of ``lengths`` (each rounded up
    to a multiple of ``multiple``) and ``largest`` itself, the one below or at ``largest`` whose
    first-fit-decreasing packing holds the fewest tokens with its padding (bins x capacity); the
    shortest such capacity (cheaper attention) on ties."""
    total, longest = sum(lengths), max(lengths)
    candidates = {-(-k * longest // multiple) * multiple for k in range(1, largest // longest + 1)}
    best, best_cost = largest, math.inf
    for capacity in sorted({c for c in candidates if c < largest} | {largest}):
        if -(-total // capacity) * capacity < best_cost:  # a lower bound of this capacity's cost
            cost = len(first_fit_decreasing(lengths, capacity)) * capacity
            if cost < best_cost:
                best, best_cost = capacity, cost
    return best
