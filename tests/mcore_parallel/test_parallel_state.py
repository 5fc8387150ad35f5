"""initialize_model_parallel and the parallel_state getters, against hand-worked layouts."""

import pytest
import torch.distributed as dist
from mcore_parallel import initialize_model_parallel, make_parallel_grids, parallel_state


def _members(group):
    return None if group is None else dist.get_process_group_ranks(group)


def _tp2_pp2_ep2():
    collection = initialize_model_parallel(
        tensor_model_parallel_size=2,
        pipeline_model_parallel_size=2,
        expert_model_parallel_size=2,
        expert_tensor_parallel_size=1,
    )
    ps = parallel_state
    try:
        with pytest.raises(RuntimeError, match="already initialized"):
            initialize_model_parallel()
        return {
            "tp": (_members(ps.get_tensor_model_parallel_group()), ps.get_tensor_model_parallel_rank()),
            "pp": (_members(ps.get_pipeline_model_parallel_group()), ps.get_pipeline_model_parallel_rank()),
            "dp": ps.get_data_parallel_world_size(),
            "mp": _members(ps.get_model_parallel_group()),
            "ep": (_members(ps.get_expert_model_parallel_group()), ps.get_expert_model_parallel_rank()),
            "expert_tp": ps.get_expert_tensor_parallel_world_size(),
            "expert_dp": ps.get_expert_data_parallel_world_size(),
            "first": ps.is_pipeline_first_stage(),
            "last": ps.is_pipeline_last_stage(),
            "next": ps.get_pipeline_model_parallel_next_rank(),
            "prev": ps.get_pipeline_model_parallel_prev_rank(),
            "embd": _members(ps.get_embedding_group()),
            "same_pp_object": collection.pp is ps.get_pipeline_model_parallel_group(),
        }
    finally:
        ps.destroy_model_parallel()


def test_tp2_pp2_ep2_on_four_ranks(run_distributed):
    results = run_distributed(_tp2_pp2_ep2, 4)
    # Order tp-cp-ep-dp-pp: tp fastest, pp slowest. Dense: tp pairs (0,1), (2,3); pipelines (0,2), (1,3).
    # Experts (expert-TP 1): ep pairs (0,1), (2,3) with the same pipelines.
    assert [r["tp"] for r in results] == [([0, 1], 0), ([0, 1], 1), ([2, 3], 0), ([2, 3], 1)]
    assert [r["pp"] for r in results] == [([0, 2], 0), ([1, 3], 0), ([0, 2], 1), ([1, 3], 1)]
    assert [r["ep"] for r in results] == [([0, 1], 0), ([0, 1], 1), ([2, 3], 0), ([2, 3], 1)]
    assert [r["mp"] for r in results] == [[0, 1, 2, 3]] * 4
    assert all(r["dp"] == 1 and r["expert_tp"] == 1 and r["expert_dp"] == 1 for r in results)
    assert [(r["first"], r["last"]) for r in results] == [(True, False)] * 2 + [(False, True)] * 2
    assert [(r["prev"], r["next"]) for r in results] == [(2, 2), (3, 3), (0, 0), (1, 1)]
    assert [r["embd"] for r in results] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert all(r["same_pp_object"] for r in results)


def _data_and_expert_parallel():
    initialize_model_parallel(expert_model_parallel_size=2)
    ps = parallel_state
    try:
        return (
            _members(ps.get_data_parallel_group()),
            _members(ps.get_expert_model_parallel_group()),
            _members(ps.get_expert_data_parallel_group()),
            _members(ps.get_data_parallel_group(with_context_parallel=True)),
        )
    finally:
        ps.destroy_model_parallel()


def test_experts_factor_the_data_parallel_ranks(run_distributed):
    results = run_distributed(_data_and_expert_parallel, 4)
    assert [r[0] for r in results] == [[0, 1, 2, 3]] * 4
    assert [r[1] for r in results] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [r[2] for r in results] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert [r[3] for r in results] == [[0, 1, 2, 3]] * 4


def _four_stage_pipeline_with_virtual_stages():
    initialize_model_parallel(pipeline_model_parallel_size=4, virtual_pipeline_model_parallel_size=2)
    ps = parallel_state
    try:
        stages = []
        for chunk in range(2):
            ps.set_virtual_pipeline_model_parallel_rank(chunk)
            stages.append((ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()))
        ignoring = (
            ps.is_pipeline_first_stage(ignore_virtual=True),
            ps.is_pipeline_last_stage(ignore_virtual=True),
        )
        return stages, ignoring, _members(ps.get_embedding_group())
    finally:
        ps.destroy_model_parallel()


def test_virtual_pipeline_stages_and_embedding_group(run_distributed):
    results = run_distributed(_four_stage_pipeline_with_virtual_stages, 4)
    assert results[0][0] == [(True, False), (False, False)]
    assert results[3][0] == [(False, False), (False, True)]
    assert results[1][0] == [(False, False), (False, False)]
    assert [r[1] for r in results] == [(True, False), (False, False), (False, False), (False, True)]
    assert [r[2] for r in results] == [[0, 3], None, None, [0, 3]]


def test_sizes_that_do_not_divide_the_world_name_every_size():
    with pytest.raises(ValueError) as raised:
        make_parallel_grids(6, tensor_model_parallel_size=4, pipeline_model_parallel_size=1)
    message = str(raised.value)
    assert "world size 6" in message
    for name in (
        "tensor_model_parallel_size=4",
        "pipeline_model_parallel_size=1",
        "context_parallel_size=1",
        "expert_model_parallel_size=1",
        "expert_tensor_parallel_size=4",
    ):
        assert name in message


def test_expert_sizes_must_divide_the_world_too():
    with pytest.raises(ValueError, match="expert_model_parallel_size=3"):
        make_parallel_grids(4, expert_model_parallel_size=3)


def test_bad_order_and_bad_sizes():
    with pytest.raises(ValueError, match="permutation"):
        make_parallel_grids(4, order="tp-dp-pp")
    with pytest.raises(ValueError, match="context_parallel_size must be an integer >= 1, got 0"):
        make_parallel_grids(4, context_parallel_size=0)


def test_expert_grid_keeps_the_dense_pipeline_groups():
    dense, expert = make_parallel_grids(
        16,
        tensor_model_parallel_size=2,
        context_parallel_size=2,
        pipeline_model_parallel_size=2,
        expert_model_parallel_size=4,
        expert_tensor_parallel_size=1,
    )
    assert dense.shape == [2, 2, 2, 2] and dense.dim_names == ["tp", "cp", "dp", "pp"]
    assert expert.shape == [1, 4, 2, 2] and expert.dim_names == ["tp", "ep", "dp", "pp"]
    assert dense.rank_groups("pp") == expert.rank_groups("pp") == [[r, r + 8] for r in range(8)]
    assert expert.rank_groups("ep")[:2] == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_an_order_that_splits_pipelines_differently_is_rejected():
    with pytest.raises(ValueError, match="different pipeline groups"):
        make_parallel_grids(
            8,
            tensor_model_parallel_size=2,
            pipeline_model_parallel_size=2,
            expert_model_parallel_size=1,
            expert_tensor_parallel_size=1,
            order="tp-pp-cp-ep-dp",
        )


def test_getters_fail_clearly_before_initialization():
    with pytest.raises(RuntimeError, match="not initialized"):
        parallel_state.get_tensor_model_parallel_group()
    assert not parallel_state.model_parallel_is_initialized()
