"""The two protocols of the training loop: every optimizer of ``mcore-train`` is a ``TrainOptimizer``
(the first two also ``ParamStatesOptimizer``s), and every checkpoint component is ``Stateful``;
anything else is refused with a ``TypeError`` naming it."""

import typing

import pytest
import torch
from mcore_models.training import (
    LocalOptimizer,
    Stateful,
    TrainModelConfig,
    TrainOptimizer,
    build_train_model,
)
from mcore_models.training.checkpoint_components import LossHistory, RandomStates
from mcore_models.training.fsdp import FSDPOptimizer
from mcore_models.training.optimizer_protocol import ParamStatesOptimizer
from mcore_models.training.stateful import checkpoint_entries, load_entries, require_stateful
from mcore_parallel import (
    DistributedDataParallelConfig,
    DistributedOptimizer,
    OptimizerConfig,
    destroy_model_parallel,
    initialize_model_parallel,
)

_MODEL = TrainModelConfig(num_layers=2, hidden_size=16, num_attention_heads=2, ffn_hidden_size=32)


def _satisfied(distributed: bool):
    destroy_model_parallel()
    groups = initialize_model_parallel()
    ddp = DistributedDataParallelConfig(use_distributed_optimizer=distributed)
    model = build_train_model(_MODEL, 64, groups, ddp, seed=1)
    optimizer = (DistributedOptimizer if distributed else LocalOptimizer)(
        model.ddp, OptimizerConfig(), groups
    )
    component = model.checkpoint_state(optimizer, groups.tp)
    return (
        isinstance(optimizer, TrainOptimizer),
        isinstance(optimizer, ParamStatesOptimizer),
        isinstance(component, Stateful),
        isinstance(RandomStates(groups), Stateful),
        "optimizer.step" in checkpoint_entries([component]),
    )


@pytest.mark.parametrize("distributed", [False, True], ids=["LocalOptimizer", "DistributedOptimizer"])
def test_param_state_optimizers_are_train_optimizers(run_distributed, distributed):
    for result in run_distributed(_satisfied, 2, distributed):
        assert result == (True, True, True, True, True)


def _fsdp_satisfied():
    from mcore_models.training.fsdp import build_fsdp_train_model

    destroy_model_parallel()
    groups = initialize_model_parallel()
    model = build_fsdp_train_model(_MODEL, 64, groups, "optim_grads_params", seed=1)
    optimizer = FSDPOptimizer(model.ddp, OptimizerConfig())
    component = model.checkpoint_state(optimizer)
    return (
        isinstance(optimizer, TrainOptimizer),
        isinstance(optimizer, ParamStatesOptimizer),
        isinstance(component, Stateful),
        sorted(checkpoint_entries([component])),
    )


def test_fsdp_optimizer_is_a_train_optimizer(run_distributed):
    pytest.importorskip("mcore_fsdp")
    for result in run_distributed(_fsdp_satisfied, 2):
        assert result == (True, False, True, ["model", "optimizer"])


def test_the_optimizer_classes_declare_the_protocols_members():
    members = {"param_groups", "zero_grad", "step"}
    for cls in (LocalOptimizer, DistributedOptimizer, FSDPOptimizer):
        assert members <= set(dir(cls)), cls
    for cls in (LocalOptimizer, DistributedOptimizer):
        assert {"step_count", "gather_param_states", "scatter_param_states"} <= set(dir(cls)), cls
    assert typing.get_type_hints(TrainOptimizer.step)["return"] is float


def test_loss_history_round_trips_through_its_entries():
    history = {"train": [[1, 2.5]], "heldout": [], "lr": [[1, 0.1]]}
    entries = checkpoint_entries([LossHistory(history)])
    loaded = LossHistory(loading=True)
    assert checkpoint_entries([loaded]) == {"history": ""}
    load_entries([loaded], entries)
    assert loaded.history == history


def test_a_component_that_is_not_stateful_is_refused():
    class Counter:
        def state_dict(self):
            return {"count": 1}

    with pytest.raises(TypeError, match=r"Counter is not Stateful.*load_state_dict"):
        checkpoint_entries([LossHistory({}), Counter()])
    with pytest.raises(TypeError, match="dict is not Stateful"):
        require_stateful([{"history": ""}])
    assert isinstance(torch.nn.Linear(2, 2), Stateful)  # a module checkpoints itself the same way


def test_two_components_with_one_key_are_refused():
    with pytest.raises(ValueError, match="repeats checkpoint keys"):
        checkpoint_entries([LossHistory({}), LossHistory({})])


def test_a_trainer_refuses_an_optimizer_that_is_not_a_train_optimizer():
    from mcore_models.training import Trainer

    class NoStep:
        param_groups = ()

        def zero_grad(self):
            pass

    parts = dict(model=None, data=None, schedule=None, checkpoint=None, logging=None, evaluator=None)
    with pytest.raises(TypeError, match="NoStep is not a TrainOptimizer"):
        Trainer(None, optimizer=NoStep(), **parts)


def test_the_schedule_component_sets_every_group_to_learning_rate():
    from mcore_models.training import SchedulerConfig, learning_rate
    from mcore_models.training.lr_schedule import LearningRateSchedule

    config = SchedulerConfig(lr_warmup_iters=2, lr_decay_style="cosine", min_lr=1e-4)
    schedule = LearningRateSchedule(1e-2, config, 10)
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0)
    optimizer.add_param_group({"params": [torch.nn.Parameter(torch.zeros(1))]})
    for iteration in (1, 2, 5, 10):
        lr = schedule.apply(optimizer, iteration)
        assert lr == learning_rate(iteration, 1e-2, config, 10)
        assert [group["lr"] for group in optimizer.param_groups] == [lr, lr]
