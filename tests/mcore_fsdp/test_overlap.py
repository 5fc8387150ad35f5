"""Prefetch, resharding after use, and activation recompute without re-gathering.

With ``optim_grads_params`` a model with N block units plus a root unit needs N all-gathers in
forward, N in backward and one for the root: 2N + 1 per step. Activation recompute runs each
block's forward again inside backward; since the block was just gathered for its backward, it
stays resident (deferred release) and the count must not change.
"""

import torch
import torch.distributed as dist
from mcore_fsdp import count_collectives, fully_shard

DEPTH = 3


def _gathers_and_params(tiny, recompute: bool, prefetch: bool):
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = fully_shard(
        tiny.Net(depth=DEPTH, recompute=recompute), unit_classes=(tiny.Block,), prefetch=prefetch
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    counts, shapes_between = [], None
    for step in range(3):
        inputs, targets = tiny.batch(step, world)
        with count_collectives() as counter:
            loss = tiny.loss(model(tiny.local(inputs, rank, world)), tiny.local(targets, rank, world))
            # Between forward and backward the blocks are resharded (their main shards are
            # registered, flat 1-D); the root keeps its full parameters for the backward.
            shapes_between = (tuple(model.blocks[0].proj.weight.shape), tuple(model.head.weight.shape))
            loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        counts.append(dict(counter))
    return counts, shapes_between, model.full_state_dict()


def test_recompute_does_not_regather_and_prefetch_keeps_counts(run_distributed, tiny):
    def body():
        plain = _gathers_and_params(tiny, recompute=False, prefetch=False)
        prefetched = _gathers_and_params(tiny, recompute=False, prefetch=True)
        recomputed = _gathers_and_params(tiny, recompute=True, prefetch=True)
        # Results travel back as plain Python values; tensors are compared here, on the rank.
        for key, value in plain[2].items():
            torch.testing.assert_close(prefetched[2][key], value, rtol=0, atol=0)
            torch.testing.assert_close(recomputed[2][key], value, rtol=1e-6, atol=1e-7)
        return [(counts, shapes) for counts, shapes, _ in (plain, prefetched, recomputed)]

    expected = {"all_gather": 2 * DEPTH + 1, "reduce_scatter": DEPTH + 1}
    for runs in run_distributed(body, 2):
        for counts, (block_shape, head_shape) in runs:
            assert counts == [expected] * 3
            assert len(block_shape) == 1 and head_shape == (3, 8)


def test_explicit_unshard_and_reshard(run_distributed, tiny):
    def body():
        torch.manual_seed(0)
        reference = tiny.Net()
        torch.manual_seed(0)
        model = fully_shard(tiny.Net(), unit_classes=(tiny.Block,))
        sharded_shape = tuple(model.blocks[1].proj.weight.shape)
        with count_collectives() as counter:
            model.unshard()
        full = dict(model.named_parameters())
        expected = reference.state_dict()
        assert full.keys() == expected.keys()
        for key, value in expected.items():
            torch.testing.assert_close(full[key], value, rtol=0, atol=0)
        model.reshard()
        return sharded_shape, dict(counter), tuple(model.blocks[1].proj.weight.shape)

    results = run_distributed(body, 2)
    # The 8x8 weight is split between the two ranks' flat shards, as 1-D main parameters.
    assert sum(sharded_shape[0] for sharded_shape, _, _ in results) == 64
    for sharded_shape, counts, after in results:
        assert len(sharded_shape) == 1 and after == sharded_shape
        assert counts == {"all_gather": DEPTH + 1}
