"""Per-unit controls of a model sharded layer by layer: ``recurse=``, resharding after forward and
after backward, and ``set_is_last_backward``.

Each case trains two steps of two micro-batches (``optim_grads_params``, 3 blocks) and must end
where one process training on the whole batch ends; collective counts show what each control
saves. One spawn runs every case.
"""

import copy

import torch
import torch.distributed as dist
from mcore_fsdp import count_collectives, fully_shard

DEPTH = 3
TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}


def _shard_per_layer(reference, **root_kwargs):
    model = copy.deepcopy(reference)
    for block in model.blocks:
        fully_shard(block)
    return fully_shard(model, **root_kwargs)


def _train(tiny, model, before_micro_batch):
    """Two steps of two micro-batches; ``before_micro_batch(model, index)`` sets controls up.
    Returns the collectives of each micro-batch's forward and backward."""
    rank, world = dist.get_rank(), dist.get_world_size()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    counts = []
    for step in range(2):
        inputs, targets = tiny.batch(step, world)
        halves = zip(
            tiny.local(inputs, rank, world).chunk(2), tiny.local(targets, rank, world).chunk(2), strict=True
        )
        for index, (x, y) in enumerate(halves):
            before_micro_batch(model, index)
            with count_collectives() as counter:
                tiny.loss(model(x), y).div(2).backward()
            counts.append(dict(counter))
        optimizer.step()
        optimizer.zero_grad()
    return counts


def _one_process(tiny, reference):
    model = copy.deepcopy(reference)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(2):
        inputs, targets = tiny.batch(step, dist.get_world_size())
        tiny.loss(model(inputs), targets).backward()
        optimizer.step()
        optimizer.zero_grad()
    return model.state_dict()


def _sync_only_last(model, index):
    model.set_requires_gradient_sync(index == 1)


def _root_syncs_only_last(model, index):
    model.set_requires_gradient_sync(True)
    model.set_requires_gradient_sync(index == 1, recurse=False)  # the root unit alone


def _keep_gathered(model, index):
    """Accumulate locally and keep every unit gathered between the micro-batches of a step."""
    model.set_requires_gradient_sync(index == 1)
    model.set_reshard_after_forward(False)
    model.set_reshard_after_backward(index == 1)


def _first_is_not_last():
    """After a backward that is not the last, the root's reduction is still in flight: its
    gradient is not there yet; the next forward completes it."""
    seen = []

    def control(model, index):
        if index == 1:
            seen.append(model.embed.weight.grad is None)
        model.set_is_last_backward(index == 1)

    return control, seen


def _controls(tiny):
    torch.manual_seed(0)
    reference = tiny.Net(depth=DEPTH)
    expected = _one_process(tiny, reference)
    not_last, grads_absent = _first_is_not_last()
    cases = {
        "default": (_shard_per_layer(reference), lambda model, index: None),
        "no_sync_first": (_shard_per_layer(reference), _sync_only_last),
        "root_no_sync_first": (_shard_per_layer(reference), _root_syncs_only_last),
        "keep_gathered": (_shard_per_layer(reference), _keep_gathered),
        "not_last_first": (_shard_per_layer(reference), not_last),
        # Every backward is "not the last": optimizer.step() completes the reductions.
        "never_last": (_shard_per_layer(reference), lambda model, index: model.set_is_last_backward(False)),
        "root_reshards": (_shard_per_layer(reference, reshard_after_forward=True), lambda m, i: None),
        "blocks_stay": (_keep_blocks_after_forward(reference), lambda model, index: None),
    }
    counts = {}
    for name, (model, control) in cases.items():
        counts[name] = _train(tiny, model, control)
        for key, value in model.full_state_dict().items():
            torch.testing.assert_close(
                value, expected[key], **TOLERANCE, msg=lambda m, k=f"{name} {key}": f"{k}: {m}"
            )
    explicit = _explicit_gathers(reference)
    return counts, grads_absent, explicit


def _keep_blocks_after_forward(reference):
    model = copy.deepcopy(reference)
    for block in model.blocks:
        fully_shard(block, reshard_after_forward=False)
    return fully_shard(model)


def _explicit_gathers(reference):
    """Collectives of ``unshard`` on one block without and with ``recurse`` on the root."""
    model = _shard_per_layer(reference)
    with count_collectives() as one_block:
        model.blocks[0].unshard()
    with count_collectives() as root_only:
        model.unshard(recurse=False)
    shapes = (model.blocks[0].proj.weight.shape, model.blocks[1].proj.weight.shape, model.head.weight.shape)
    model.reshard(recurse=False)
    root_after = model.head.weight.shape
    model.reshard()
    return dict(one_block), dict(root_only), [tuple(shape) for shape in (*shapes, root_after)]


def test_controls_train_exactly_and_save_collectives(run_distributed, tiny):
    counts, grads_absent, explicit = run_distributed(_controls, 2, tiny, timeout=60)[0]
    gather_all = {"all_gather": 2 * DEPTH + 1, "reduce_scatter": DEPTH + 1}
    assert counts["default"] == [gather_all] * 4
    local = {"all_gather": 2 * DEPTH + 1}
    assert counts["no_sync_first"] == [local, gather_all] * 2
    # Only the root unit skipped its reduction in the first micro-batch.
    root_local = {"all_gather": 2 * DEPTH + 1, "reduce_scatter": DEPTH}
    assert counts["root_no_sync_first"] == [root_local, gather_all] * 2
    # Gathered once per step: the second micro-batch reuses the first one's parameters.
    assert counts["keep_gathered"] == [{"all_gather": DEPTH + 1}, {"reduce_scatter": DEPTH + 1}] * 2
    assert counts["not_last_first"] == counts["never_last"] == [gather_all] * 4
    assert grads_absent == [True, True]
    # The root gathered again for backward; blocks kept from forward to backward.
    assert counts["root_reshards"] == [{"all_gather": 2 * DEPTH + 2, "reduce_scatter": DEPTH + 1}] * 4
    assert counts["blocks_stay"] == [{"all_gather": DEPTH + 1, "reduce_scatter": DEPTH + 1}] * 4

    one_block, root_only, shapes = explicit
    assert one_block == {"all_gather": 1} and root_only == {"all_gather": 1}
    block0, block1, head, head_after = shapes
    assert block0 == (8, 8) and len(block1) == 1 and head == (3, 8) and len(head_after) == 1
