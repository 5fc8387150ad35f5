"""``fully_shard`` composes like FSDP2: per-layer calls, then the root.

Oracles: the same model built with ``unit_classes`` in one call (same units, so bit-identical
results and the same collectives; nested units give the same bits with more collectives), and
one process training on the whole batch.
"""

import copy

import pytest
import torch
import torch.distributed as dist
from mcore_fsdp import FSDPModule, MixedPrecision, count_collectives, fully_shard
from torch import nn
from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard

STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")
DEPTH = 3
STEPS = 3


def _unit_classes(tiny, net, strategy):
    fully_shard(net, unit_classes=(tiny.Block,), strategy=strategy)
    return net, torch.optim.AdamW(net.parameters(), lr=1e-2)


def _per_layer(tiny, net, strategy):
    for block in net.blocks:
        fully_shard(block, strategy=strategy)
    fully_shard(net, strategy=strategy)
    return net, torch.optim.AdamW(net.parameters(), lr=1e-2)


def _mixed(tiny, net, strategy):
    """One block by its own call; ``unit_classes`` adopts it and makes the others units."""
    fully_shard(net.blocks[0], strategy=strategy)
    fully_shard(net, unit_classes=(tiny.Block,), strategy=strategy)
    return net, torch.optim.AdamW(net.parameters(), lr=1e-2)


def _nested(tiny, net, strategy):
    """Three levels: each block's projection, each block, then the root."""
    for block in net.blocks:
        fully_shard(block.proj, strategy=strategy)
        fully_shard(block, strategy=strategy)
    fully_shard(net, strategy=strategy)
    return net, torch.optim.AdamW(net.parameters(), lr=1e-2)


def _optimizer_before_root_call(tiny, net, strategy):
    for block in net.blocks:
        fully_shard(block, strategy=strategy)
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-2)
    fully_shard(net, strategy=strategy)
    return net, optimizer


def _optimizer_before_any_call(tiny, net, strategy):
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-2)
    _per_layer(tiny, net, strategy)
    return net, optimizer


BUILDS = {
    "unit_classes": _unit_classes,
    "per_layer": _per_layer,
    "mixed": _mixed,
    "nested": _nested,
    "optimizer_before_root_call": _optimizer_before_root_call,
    "optimizer_before_any_call": _optimizer_before_any_call,
}


def _train_each_build(tiny):
    rank, world = dist.get_rank(), dist.get_world_size()
    counts = {}
    for strategy in STRATEGIES:
        torch.manual_seed(0)
        reference = tiny.Net(depth=DEPTH)
        runs = {name: build(tiny, copy.deepcopy(reference), strategy) for name, build in BUILDS.items()}
        reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
        for step in range(STEPS):
            inputs, targets = tiny.batch(step, world)
            for name, (model, optimizer) in runs.items():
                with count_collectives() as counter:
                    output = model(tiny.local(inputs, rank, world))
                    tiny.loss(output, tiny.local(targets, rank, world)).backward()
                counts.setdefault((strategy, name), []).append(dict(counter))
                model.clip_grad_norm_(0.5)
                optimizer.step()
                optimizer.zero_grad()
            tiny.loss(reference(inputs), targets).backward()
            torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
            reference_optimizer.step()
            reference_optimizer.zero_grad()
        expected = runs["unit_classes"][0].full_state_dict()
        for name, (model, _) in runs.items():
            assert all(isinstance(block, FSDPModule) for block in model.blocks)
            # Nested units shard other flat buffers, so each rank sums other slices into the
            # gradient norm: equal to float32 rounding, not bit for bit. The rest have the units
            # of unit_classes and must match it exactly.
            exact = dict(rtol=1e-6, atol=1e-7) if name == "nested" else dict(rtol=0, atol=0)
            for key, value in model.full_state_dict().items():
                torch.testing.assert_close(value, expected[key], **exact, msg=f"{strategy} {name} {key}")
                torch.testing.assert_close(value, reference.state_dict()[key], rtol=1e-5, atol=1e-6)
    return counts


def test_per_layer_calls_train_like_unit_classes_and_one_process(run_distributed, tiny):
    counts = run_distributed(_train_each_build, 2, tiny, timeout=60)[0]
    for (strategy, name), per_step in counts.items():
        if name != "nested":
            assert per_step == counts[(strategy, "unit_classes")], (strategy, name)
    # N block units and the root: N + 1 gathers in forward, N in backward.
    assert (
        counts[("optim_grads_params", "per_layer")]
        == [{"all_gather": 2 * DEPTH + 1, "reduce_scatter": DEPTH + 1}] * STEPS
    )
    # Nested: 2N units below the root.
    assert (
        counts[("optim_grads_params", "nested")]
        == [{"all_gather": 4 * DEPTH + 1, "reduce_scatter": 2 * DEPTH + 1}] * STEPS
    )


def test_layers_without_a_root_call_fail_at_first_forward(run_distributed, tiny, rank0_error):
    """The embedding and head would train on rank-local gradients: refused before any collective."""

    def body():
        net = tiny.Net()
        for block in net.blocks:
            fully_shard(block)
        return rank0_error(lambda: net(torch.randn(2, 5)))

    error = run_distributed(body, 2, timeout=20)[0]
    assert "runs inside a TinyNet whose parameters ['embed.weight'" in error
    assert "Call fully_shard on the model's root module too" in error


def test_lone_sharded_layers_train_when_nothing_else_trains(run_distributed, tiny):
    """Each layer is a root of its own (FSDP2 allows it); correct as long as no other parameter
    trains. Oracle: one process with the same frozen embedding and head."""

    def body():
        rank, world = dist.get_rank(), dist.get_world_size()
        torch.manual_seed(0)
        reference = tiny.Net()
        for frozen in (reference.embed, reference.head):
            frozen.requires_grad_(False)
        model = copy.deepcopy(reference)
        for block in model.blocks:
            fully_shard(block)
        optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (reference, model)]
        for step in range(2):
            inputs, targets = tiny.batch(step, world)
            tiny.loss(model(tiny.local(inputs, rank, world)), tiny.local(targets, rank, world)).backward()
            tiny.loss(reference(inputs), targets).backward()
            for optimizer in optimizers:
                optimizer.step()
                optimizer.zero_grad()
        for index, block in enumerate(model.blocks):
            for key, value in block.full_state_dict().items():
                expected = reference.blocks[index].state_dict()[key]
                torch.testing.assert_close(value, expected, rtol=1e-5, atol=1e-6)
                assert not torch.equal(value, _initial_block(tiny, index)[key])
        return True

    assert run_distributed(body, 2) == [True, True]


def _initial_block(tiny, index):
    torch.manual_seed(0)
    return tiny.Net().blocks[index].state_dict()


def _tie_across_blocks(tiny, net):
    net.blocks[1].proj.weight = net.blocks[0].proj.weight
    fully_shard(net.blocks[0])
    return lambda: fully_shard(net.blocks[1])


def _tie_block_to_root(tiny, net):
    net.shared_scale = net.blocks[0].norm.weight
    fully_shard(net.blocks[0])
    return lambda: fully_shard(net)


def _mismatch(child_args, root_args):
    def setup(tiny, net):
        for block in net.blocks:
            fully_shard(block, **child_args)
        return lambda: fully_shard(net, **root_args)

    return setup


def _with_setup(call):
    def setup(tiny, net):
        return lambda: call(tiny, net)

    return setup


def _child_after_unit(tiny, net):
    fully_shard(net, unit_classes=(tiny.Block,))
    return lambda: fully_shard(net.blocks[0])


def _child_after_parent(tiny, net):
    fully_shard(net)
    return lambda: fully_shard(net.blocks[0].proj)


def _twice(tiny, net):
    fully_shard(net.blocks[0])
    return lambda: fully_shard(net.blocks[0])


def _unit_inside_sharded(tiny, net):
    fully_shard(net.blocks[0])
    return lambda: fully_shard(net, unit_classes=(nn.LayerNorm,))


def _fsdp2_child(tiny, net):
    fsdp2_fully_shard(net.blocks[0])
    return lambda: fully_shard(net)


def _init_fn_with_sharded_child(tiny, net):
    fully_shard(net.blocks[0])
    return lambda: fully_shard(net, init_fn=lambda module: None)


COMPOSITION_ERRORS = {
    "twice": (_twice, "already a sharding unit"),
    "child_after_unit_classes": (_child_after_unit, "already a sharding unit"),
    "child_after_parent": (_child_after_parent, "belongs to the sharded enclosing TinyNet"),
    "tied_across_units": (_tie_across_blocks, "'proj.weight' is shared with the already sharded Block"),
    "tied_with_root": (_tie_block_to_root, "'shared_scale' is shared with the already sharded Block"),
    "unit_classes_inside_sharded": (_unit_inside_sharded, "'blocks.0.norm' (LayerNorm) inside a module"),
    "fsdp2_child": (_fsdp2_child, "'blocks.0.norm.weight' is a DTensor, already sharded by another"),
    "init_fn_with_sharded_child": (_init_fn_with_sharded_child, "init_fn cannot be combined"),
    "strategy_mismatch": (_mismatch({"strategy": "optim"}, {}), "strategy differs"),
    "mesh_mismatch": (_mismatch({"mesh": (2,)}, {"mesh": (1, 2)}), "mesh differs"),
    "precision_mismatch": (
        _mismatch({}, {"precision": MixedPrecision(param_dtype=torch.bfloat16)}),
        "precision differs",
    ),
    "offload_mismatch": (_mismatch({}, {"offload_optimizer": True}), "offload_optimizer differs"),
    "prefetch_mismatch": (_mismatch({"prefetch": False}, {}), "prefetch differs"),
    "outer_strategy_mismatch": (
        _mismatch({"mesh": (1, 2)}, {"mesh": (1, 2), "outer_strategy": "optim"}),
        "outer_strategy differs",
    ),
    "reshard_after_forward_int": (
        _with_setup(lambda tiny, net: fully_shard(net, reshard_after_forward=2)),
        "reshard_after_forward must be True, False or None; got 2",
    ),
    "not_a_module": (
        _with_setup(lambda tiny, net: fully_shard(list(net.blocks))),
        "module must be an nn.Module; got list",
    ),
}


@pytest.mark.parametrize("case", sorted(COMPOSITION_ERRORS))
def test_impossible_compositions_fail_before_any_collective(run_distributed, tiny, rank0_error, case):
    setup, message = COMPOSITION_ERRORS[case]

    def body():
        bad_call = setup(tiny, tiny.Net())  # every rank: the valid calls
        return rank0_error(bad_call)  # rank 0 alone: the bad one

    error = run_distributed(body, 2, timeout=20)[0]
    assert error.startswith("FSDPConfigError") and message in error, error
