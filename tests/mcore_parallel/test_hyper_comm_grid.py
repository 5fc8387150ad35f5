"""HyperCommGrid: rank arithmetic without a process group, groups created once, shared by views."""

import pytest
import torch
import torch.distributed as dist
from mcore_parallel import HyperCommGrid


def test_rank_groups_first_dimension_varies_fastest():
    grid = HyperCommGrid([2, 3, 2], ["tp", "dp", "pp"])
    assert grid.size == 12 and grid.extent("dp") == 3
    assert grid.rank_groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11]]
    assert grid.rank_groups("dp") == [[0, 2, 4], [1, 3, 5], [6, 8, 10], [7, 9, 11]]
    assert grid.rank_groups("pp") == [[0, 6], [1, 7], [2, 8], [3, 9], [4, 10], [5, 11]]
    assert grid.rank_groups(["tp", "pp"]) == [[0, 1, 6, 7], [2, 3, 8, 9], [4, 5, 10, 11]]


def test_dimension_order_in_a_request_does_not_matter():
    grid = HyperCommGrid([2, 2, 2], ["tp", "cp", "dp"])
    assert grid.rank_groups("cp-tp") == grid.rank_groups(["tp", "cp"]) == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_coordinates_and_rank_at_are_inverse_with_offset():
    grid = HyperCommGrid([2, 3], ["tp", "dp"], rank_offset=4)
    assert grid.coordinates(9) == {"tp": 1, "dp": 2}
    assert grid.rank_at(tp=1, dp=2) == 9
    assert all(grid.rank_at(**grid.coordinates(r)) == r for r in range(4, 10))
    assert grid.group_ranks("dp", 5) == [5, 7, 9]
    with pytest.raises(ValueError, match="rank 3 is outside this grid"):
        grid.coordinates(3)


@pytest.mark.parametrize(
    ("shape", "names", "message"),
    [
        ([2, 0], ["tp", "dp"], "dimension 'dp' must be an integer >= 1"),
        ([2], ["tp", "dp"], "same length"),
        ([2, 2], ["tp", "tp"], "unique"),
    ],
)
def test_bad_shapes_are_rejected(shape, names, message):
    with pytest.raises(ValueError, match=message):
        HyperCommGrid(shape, names)


def test_view_must_cover_the_same_ranks():
    with pytest.raises(ValueError, match="same 4 ranks"):
        HyperCommGrid([2, 2], ["tp", "dp"]).view([3], ["ep"])


def test_unknown_dimension_and_missing_group_are_named():
    grid = HyperCommGrid([2, 2], ["tp", "dp"])
    with pytest.raises(ValueError, match="unknown dimension 'ep'"):
        grid.rank_groups("ep")
    with pytest.raises(KeyError, match="create_group first"):
        grid.get_group("tp")
    with pytest.raises(RuntimeError, match="initialized default process group"):
        grid.create_group("tp")


def _groups_on_four_ranks():
    grid = HyperCommGrid([2, 2], ["tp", "dp"])
    tp = grid.create_group("tp")
    with pytest.raises(RuntimeError, match="already exist"):
        grid.create_group("tp")
    assert grid.get_group("tp") is tp
    # A view that factors the same ranks as [tp*dp] gets the very same group object for identical members.
    view = grid.view([4], ["all"])
    everyone = view.create_group("all")
    assert grid.create_group("tp-dp") is everyone
    # The group really has the expected members: sum ranks over it.
    value = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(value, group=tp)
    return dist.get_process_group_ranks(tp), value.item()


def test_groups_are_created_once_and_shared_with_views(run_distributed):
    results = run_distributed(_groups_on_four_ranks, 4)
    assert results == [([0, 1], 1.0), ([0, 1], 1.0), ([2, 3], 5.0), ([2, 3], 5.0)]


def _grid_smaller_than_world():
    grid = HyperCommGrid([2], ["tp"], rank_offset=1)
    group = grid.create_group("tp")
    return None if group is None else dist.get_process_group_ranks(group)


def test_ranks_outside_an_offset_grid_get_no_group(run_distributed):
    assert run_distributed(_grid_smaller_than_world, 3) == [None, [1, 2], [1, 2]]
