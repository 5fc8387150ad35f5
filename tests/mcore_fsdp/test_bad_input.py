"""Bad input raises a typed error naming the argument, before any collective is issued.

Only rank 0 makes the bad call while rank 1 returns at once: a call that reached a collective
would wait for a peer that never comes and time out instead of raising the expected error.
"""

import pytest
import torch
from mcore_fsdp import MixedPrecision, fully_shard
from torch import nn


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("meta_without_init_fn", "meta device"),
        ("absent_unit_class", "match no submodule"),
        ("mesh_mismatch", "world size is 2"),
        ("unknown_strategy", "strategy must be one of"),
        ("outer_optim_without_param_sharding", "outer_strategy='optim' requires"),
        ("bad_precision", "param_dtype must be"),
        ("outer_optim_on_1d_mesh", "needs a 2-D (replicate, shard) mesh"),
        ("expert_mesh_without_predicate", "must be given together"),
        ("divide_factor_without_experts", "expert_gradient_divide_factor needs expert_parameters"),
        ("negative_divide_factor", "expert_gradient_divide_factor must be a positive number"),
        ("not_a_mesh", "must be a DeviceMesh, a ProcessGroup"),
    ],
)
def test_bad_arguments_fail_fast(run_distributed, tiny, rank0_error, case, message):
    calls = {
        "meta_without_init_fn": lambda: fully_shard(_meta_net(tiny), unit_classes=(tiny.Block,)),
        "absent_unit_class": lambda: fully_shard(tiny.Net(), unit_classes=(nn.GRU, "NoSuchLayer")),
        "mesh_mismatch": lambda: fully_shard(tiny.Net(), mesh=(3,)),
        "unknown_strategy": lambda: fully_shard(tiny.Net(), strategy="zero3"),
        "outer_optim_without_param_sharding": lambda: fully_shard(
            tiny.Net(), mesh=(1, 2), strategy="optim_grads", outer_strategy="optim"
        ),
        "bad_precision": lambda: fully_shard(tiny.Net(), precision=MixedPrecision(param_dtype=torch.int8)),
        "outer_optim_on_1d_mesh": lambda: fully_shard(tiny.Net(), mesh=(2,), outer_strategy="optim"),
        "expert_mesh_without_predicate": lambda: fully_shard(tiny.Net(), expert_mesh=(2,)),
        "divide_factor_without_experts": lambda: fully_shard(tiny.Net(), expert_gradient_divide_factor=2),
        "negative_divide_factor": lambda: fully_shard(
            tiny.Net(),
            expert_parameters=lambda n, p: True,
            expert_mesh=(2,),
            expert_gradient_divide_factor=-1,
        ),
        "not_a_mesh": lambda: fully_shard(tiny.Net(), mesh="cpu"),
    }
    error = run_distributed(rank0_error, 2, calls[case], timeout=20)[0]
    assert message in error


def _meta_net(tiny):
    with torch.device("meta"):
        return tiny.Net()


@pytest.mark.parametrize("case", ["wrong_shape", "missing_key", "unexpected_key"])
def test_incompatible_checkpoint_fails_fast(run_distributed, tiny, rank0_error, case):
    def body():
        model = fully_shard(tiny.Net(), unit_classes=(tiny.Block,))
        state = tiny.Net(dim=8).state_dict()
        if case == "wrong_shape":
            state = tiny.Net(dim=6).state_dict()
        elif case == "missing_key":
            del state["blocks.1.proj.bias"]
        else:
            state["blocks.9.proj.weight"] = torch.zeros(1)
        return rank0_error(lambda: model.load_state_dict(state))

    error = run_distributed(body, 2, timeout=20)[0]
    assert error.startswith("CheckpointMismatchError")
    assert {"wrong_shape": "do not match", "missing_key": "blocks.1.proj.bias", "unexpected_key": "blocks.9"}[
        case
    ] in error


def test_meta_device_model_with_init_fn(run_distributed, tiny):
    """Oracle: a plain copy of the meta model materialized by the same ``init_fn``."""

    def body():
        def materialize(module):
            torch.manual_seed(0)
            module.to_empty(device="cpu")
            for submodule in module.modules():
                if hasattr(submodule, "reset_parameters"):
                    submodule.reset_parameters()

        reference = _meta_net(tiny)
        materialize(reference)
        model = fully_shard(_meta_net(tiny), unit_classes=(tiny.Block,), init_fn=materialize)
        full = model.full_state_dict()
        assert set(full) == set(reference.state_dict())
        for key, value in reference.state_dict().items():
            torch.testing.assert_close(full[key], value, rtol=0, atol=0)
        return True

    assert run_distributed(body, 2) == [True, True]
