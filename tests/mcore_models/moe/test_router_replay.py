"""Router replay: a replayed forward is bitwise the recorded one, the recompute of a checkpointed
forward keeps its routing, and pipeline schedules (1F1B, interleaved) replay in order.

Every test moves the routers' expert bias between recording and replaying far enough that fresh
routing would pick other experts (the bias shifts the choice only, not the weights), so equality
shows the routing was replayed, and a control without replay shows it would have differed.
"""

import pytest
import torch
from mcore_models import GPTModel
from mcore_models.transformer.moe import (
    RouterReplay,
    RouterReplayAction,
    TopKRouter,
    attach_router_replay,
    set_router_replay_action,
)
from mcore_testing.moe_reference import moe_config

VOCAB = 64
MOE = {"moe_router_enable_expert_bias": True, "position_embedding_type": "rope"}


def _routers(model):
    return [m for m in model.modules() if isinstance(m, TopKRouter)]


def _shift_routing(model):
    """Bias every router towards experts 2 and 3, away from 0 and 1."""
    with torch.no_grad():
        for router in _routers(model):
            router.expert_bias.copy_(torch.tensor([-100.0, -100.0, 100.0, 100.0]))


def _ids(seed):
    return torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(seed))


def test_replayed_forward_is_bitwise_the_recorded_one(run_distributed, model_parallel):
    def body():
        groups = model_parallel(1)
        torch.manual_seed(0)
        model = GPTModel(moe_config(**MOE), VOCAB, pg_collection=groups).train()
        replays = attach_router_replay(model, RouterReplayAction.RECORD)
        assert len(replays) == 2 and all(r.router_replay is not None for r in _routers(model))
        recorded = [model(_ids(seed), labels=_ids(seed)) for seed in (1, 2)]
        assert [len(r.recorded) for r in replays] == [2, 2]
        _shift_routing(model)
        set_router_replay_action(model, RouterReplayAction.REPLAY_FORWARD)
        replayed = [model(_ids(seed), labels=_ids(seed)) for seed in (1, 2)]
        assert [len(r.recorded) for r in replays] == [0, 0]  # first in, first out, all used
        set_router_replay_action(model, None)
        fresh = model(_ids(1), labels=_ids(1))
        with pytest.raises(RuntimeError, match="no recorded routing left"):
            set_router_replay_action(model, RouterReplayAction.REPLAY_FORWARD)
            model(_ids(1), labels=_ids(1))
        return (
            all(torch.equal(a, b) for a, b in zip(recorded, replayed, strict=True)),
            torch.equal(fresh, recorded[0]),
        )

    assert run_distributed(body, 1)[0] == (True, False)


def test_replay_checks_the_shape_of_a_pushed_routing():
    replay = RouterReplay(RouterReplayAction.REPLAY_FORWARD)
    replay.push(torch.zeros(3, 2, dtype=torch.long))
    with pytest.raises(ValueError, match=r"shape \(3, 2\), this forward routes 4 tokens to 2 experts"):
        replay.route(lambda: None, 4, 2)


@pytest.mark.parametrize("action", [None, RouterReplayAction.RECORD, RouterReplayAction.REPLAY_BACKWARD])
def test_recompute_reuses_the_forward_routing(action, run_distributed, model_parallel):
    """Activation recompute of every layer: moving the bias between forward and backward changes
    nothing with a ``RouterReplay`` (any action), and changes the gradients without one."""
    recompute = {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}

    def body():
        groups = model_parallel(1)
        grads = {}
        for case in ("reference", "replay", "no-replay"):
            torch.manual_seed(0)
            model = GPTModel(moe_config(**MOE, **recompute), VOCAB, pg_collection=groups).train()
            if case == "replay":
                replays = attach_router_replay(model, action)
                with torch.no_grad():  # no backward will follow: nothing is kept for a recompute
                    model(_ids(3), labels=_ids(3))
                assert all(not r._for_recompute for r in replays)
                set_router_replay_action(model, action)
            loss = model(_ids(1), labels=_ids(1)).sum()
            if case != "reference":
                _shift_routing(model)  # the recompute would route elsewhere
            loss.backward()
            grads[case] = [p.grad.clone() for p in model.parameters()]
            if case == "replay":
                recorded = 2 if action is RouterReplayAction.RECORD else 0  # recorded once per forward
                assert [len(r.recorded) for r in replays] == [recorded, recorded]
                assert all(not r._for_recompute for r in replays)
        same = all(torch.equal(a, b) for a, b in zip(grads["reference"], grads["replay"], strict=True))
        control = all(torch.equal(a, b) for a, b in zip(grads["reference"], grads["no-replay"], strict=True))
        return same, control

    assert run_distributed(body, 1)[0] == (True, False)


@pytest.mark.parametrize("vpp", [None, 2], ids=["1f1b", "interleaved"])
def test_pipeline_schedules_replay_every_micro_batch_in_order(vpp, run_distributed):
    """PP = 2 (and 2 virtual stages), 4 micro-batches, activation recompute: a step recorded, the
    bias moved, the step replayed: losses and gradients bitwise equal."""

    def body():
        from mcore_models.training import TrainModelConfig, build_train_model
        from mcore_models.training.schedule import run_micro_batches
        from mcore_parallel import (
            DistributedDataParallelConfig,
            destroy_model_parallel,
            initialize_model_parallel,
        )

        destroy_model_parallel()
        groups = initialize_model_parallel(
            pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=vpp
        )
        config = TrainModelConfig(
            num_layers=4,
            hidden_size=16,
            num_attention_heads=2,
            ffn_hidden_size=32,
            num_moe_experts=4,
            moe_router_topk=2,
            moe_router_enable_expert_bias=True,
            pipeline_model_parallel_size=2,
            virtual_pipeline_model_parallel_size=vpp,
            recompute_granularity="full",
            recompute_method="uniform",
            recompute_num_layers=1,
        )
        model = build_train_model(config, VOCAB, groups, DistributedDataParallelConfig(), seed=0)
        batches = []
        for seed in range(4):
            ids = _ids(10 + seed)
            batches.append(
                {
                    "tokens": ids,
                    "labels": torch.roll(ids, -1, 1),
                    "loss_mask": torch.ones(ids.shape),
                    "position_ids": torch.arange(8).expand(2, 8),
                }
            )
        replays = attach_router_replay(model.container, RouterReplayAction.RECORD)
        results = []
        for action in (RouterReplayAction.RECORD, RouterReplayAction.REPLAY_FORWARD, None):
            set_router_replay_action(model.container, action)
            model.ddp.zero_grad_buffer()
            losses = run_micro_batches(model, batches, groups)
            model.ddp.finish_grad_sync()
            results.append(
                (
                    [loss.detach() for loss in losses],
                    [p.main_grad.clone() for p in model.container.parameters()],
                )
            )
            if action is RouterReplayAction.RECORD:
                assert {len(r.recorded) for r in replays} == {4}
                _shift_routing(model.container)
        assert all(not r.recorded and not r._for_recompute for r in replays)
        (losses, grads), (replayed_losses, replayed_grads), (_, fresh_grads) = results
        return (
            all(torch.equal(a, b) for a, b in zip(losses, replayed_losses, strict=True)),
            all(torch.equal(a, b) for a, b in zip(grads, replayed_grads, strict=True)),
            all(torch.equal(a, b) for a, b in zip(grads, fresh_grads, strict=True)),  # control
            len(losses),
        )

    results = run_distributed(body, 2, timeout=60)
    assert [r[:3] for r in results] == [(True, True, False), (True, True, False)]
    assert [r[3] for r in results] == [0, 4]  # the losses live on the last stage


@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
def test_replay_across_expert_parallel_ranks(dispatcher, run_distributed):
    """EP = 2: each rank replays its own tokens' routing; outputs and gradients bitwise equal."""

    def body():
        from mcore_models.transformer.moe import MoELayer, MoESubmodules, SequentialExperts
        from mcore_parallel import destroy_model_parallel, initialize_model_parallel

        destroy_model_parallel()
        initialize_model_parallel(expert_model_parallel_size=2)
        torch.manual_seed(0)
        config = moe_config(
            moe_router_enable_expert_bias=True,
            expert_model_parallel_size=2,
            moe_token_dispatcher_type=dispatcher,
        )
        layer = MoELayer(config, MoESubmodules(experts=SequentialExperts)).train()
        replays = attach_router_replay(layer, RouterReplayAction.RECORD)
        x = torch.randn(6, 2, 16, generator=torch.Generator().manual_seed(torch.distributed.get_rank()))
        results = []
        for action in (RouterReplayAction.RECORD, RouterReplayAction.REPLAY_FORWARD, None):
            set_router_replay_action(layer, action)
            layer.zero_grad()
            out = layer(x)
            out.square().sum().backward()
            results.append((out.detach(), [p.grad.clone() for p in layer.parameters()]))
            _shift_routing(layer)
        assert not replays[0].recorded
        (out, grads), (replayed, replayed_grads), (fresh, _) = results
        same = torch.equal(out, replayed) and all(
            torch.equal(a, b) for a, b in zip(grads, replayed_grads, strict=True)
        )
        return same, torch.equal(out, fresh)

    assert run_distributed(body, 2) == [(True, False), (True, False)]
