"""Distributed checkpoints: reshard across topologies, async save, entries of one rank, crash safety,
format errors.

Resharding: a residual-MLP model trains with the distributed optimizer at TP=2 x PP=2, saves after
step 2 and runs on to step 6 (the uninterrupted run). Loading that checkpoint at TP=1 x DP=4 gives
steps 3-4, saved again and loaded at TP=4 for steps 5-6: every loss equals the uninterrupted run's
(rtol 1e-5; fp32, only summation order differs between topologies).
"""

import os
import signal

import pytest
import torch
import torch.distributed as dist
from mcore_parallel import (
    CheckpointConfig,
    ColumnParallelLinear,
    ConfigError,
    DistributedCheckpointer,
    DistributedDataParallel,
    DistributedDataParallelConfig,
    DistributedOptimizer,
    OptimizerConfig,
    RowParallelLinear,
    checkpoint_dir,
    forward_backward_no_pipelining,
    forward_backward_pipelining,
    initialize_model_parallel,
    latest_iteration,
    load_sharded_optimizer_state_dict,
    sharded_model_state_dict,
    sharded_optimizer_state_dict,
)
from torch import nn

HIDDEN, FFN, BATCH, SEQ, LAYERS, MICRO = 4, 8, 2, 3, 4, 4


class Block(nn.Module):
    def __init__(self, tp_group):
        super().__init__()
        self.fc1 = ColumnParallelLinear(HIDDEN, FFN, tp_group=tp_group)
        self.fc2 = RowParallelLinear(FFN, HIDDEN, tp_group=tp_group)

    def forward(self, x):
        return x + self.fc2(torch.tanh(self.fc1(x)[0]))[0]


class Stage(nn.Module):
    """Blocks named by their global layer index, so every topology names them alike."""

    def __init__(self, layer_ids, tp_group):
        super().__init__()
        self.layers = nn.ModuleDict({str(i): Block(tp_group) for i in layer_ids})

    def forward(self, x):
        for block in self.layers.values():
            x = block(x)
        return x


def _batch(step):
    generator = torch.Generator().manual_seed(100 + step)
    return [
        (
            torch.randn(SEQ, BATCH, HIDDEN, generator=generator),
            torch.randn(SEQ, BATCH, HIDDEN, generator=generator),
        )
        for _ in range(MICRO)
    ]


def _train(tp, pp, directory, load_step, save_step, last_step):
    groups = initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    stage, dp, dp_rank = dist.get_rank(groups.pp), dist.get_world_size(groups.dp), dist.get_rank(groups.dp)
    per_stage = LAYERS // pp
    torch.manual_seed(0)
    module = Stage(range(stage * per_stage, (stage + 1) * per_stage), groups.tp)
    model = DistributedDataParallel(
        module, DistributedDataParallelConfig(use_distributed_optimizer=True, bucket_size=64), groups.dp
    )
    optimizer = DistributedOptimizer(model, OptimizerConfig(lr=1e-2, weight_decay=0.1))
    checkpointer = DistributedCheckpointer(CheckpointConfig(save=directory, load=directory))

    def state_dict():
        return sharded_model_state_dict(module, groups.tp) | sharded_optimizer_state_dict(
            optimizer, module, groups.tp
        )

    if load_step is not None:
        loaded = state_dict()
        assert checkpointer.load(loaded) == load_step
        load_sharded_optimizer_state_dict(optimizer, module, loaded)
    last = stage == pp - 1
    losses = []
    for step in range((load_step or 0) + 1, last_step + 1):
        per_rank = MICRO // dp
        data = _batch(step)[dp_rank * per_rank : (dp_rank + 1) * per_rank]

        def forward_step(iterator, chunk, input_tensor):
            x, target = next(iterator)
            output = chunk(x if input_tensor is None else input_tensor)
            return (output - target).square().mean() if last else output

        optimizer.zero_grad()
        kwargs = dict(
            forward_step_func=forward_step, data_iterator=iter(data), model=model, num_microbatches=per_rank
        )
        if pp > 1:
            step_losses = forward_backward_pipelining(**kwargs, pp_group=groups.pp)
        else:
            step_losses = forward_backward_no_pipelining(**kwargs)
        optimizer.step()
        if last:
            loss = torch.stack(step_losses).mean()
            dist.all_reduce(loss, group=groups.dp)
            losses.append(loss.item() / dp)
        if step == save_step:
            checkpointer.save(state_dict(), step)
    return losses if last else None


def _losses(results):
    return next(r for r in results if r is not None)


def test_save_and_load_across_topologies(run_distributed, tmp_path):
    a = str(tmp_path)
    uninterrupted = _losses(run_distributed(_train, 4, 2, 2, a, None, 2, 6, timeout=60))
    assert latest_iteration(a) == 2
    resumed = _losses(run_distributed(_train, 4, 1, 1, a, 2, 4, 4, timeout=60))  # TP1 x DP4
    assert latest_iteration(a) == 4
    resumed += _losses(run_distributed(_train, 4, 4, 1, a, 4, None, 6, timeout=60))  # TP4
    torch.testing.assert_close(torch.tensor(resumed), torch.tensor(uninterrupted[2:]), rtol=1e-5, atol=0)
    assert len(set(uninterrupted)) == len(uninterrupted)  # the run does change the model


def _async_save_snapshots(directory):
    module = nn.Linear(4, 4)
    before = {k: v.clone() for k, v in module.state_dict().items()}
    checkpointer = DistributedCheckpointer(CheckpointConfig(save=directory, load=directory, async_save=True))
    checkpointer.save(sharded_model_state_dict(module), 1)
    with torch.no_grad():
        module.weight.add_(1.0)  # training goes on while the save is in flight
    checkpointer.wait()
    loaded = sharded_model_state_dict(module)
    checkpointer.load(loaded)
    return all(torch.equal(loaded[k], before[k]) for k in before)


def test_async_save_writes_the_state_at_save_time(run_distributed, tmp_path):
    assert run_distributed(_async_save_snapshots, 2, str(tmp_path)) == [True, True]
    assert latest_iteration(tmp_path) == 1


def _entries_of_each_rank(directory):
    rank = dist.get_rank()
    checkpointer = DistributedCheckpointer(CheckpointConfig(save=directory, load=directory))
    own = {f"values.{rank}": torch.full((3,), float(rank)), f"note.{rank}": f"rank {rank}"}
    checkpointer.save({"shared": torch.ones(2), **own}, 1)
    loaded = {f"values.{rank}": torch.zeros(3), f"note.{rank}": ""}
    checkpointer.load(loaded)
    return checkpointer.saved_keys(), loaded[f"values.{rank}"].tolist(), loaded[f"note.{rank}"]


def test_entries_of_one_rank_are_listed_and_load_on_it(run_distributed, tmp_path):
    results = run_distributed(_entries_of_each_rank, 2, str(tmp_path))
    for rank, (keys, values, note) in enumerate(results):
        assert keys == {"shared", "values.0", "values.1", "note.0", "note.1"}
        assert values == [float(rank)] * 3 and note == f"rank {rank}"


@pytest.mark.filterwarnings("ignore:torch.distributed is .*uninitialized")
def test_killed_save_leaves_previous_checkpoint_loadable(tmp_path):
    config = CheckpointConfig(save=str(tmp_path), load=str(tmp_path))
    module = nn.Linear(4, 4)
    saved = {k: v.clone() for k, v in module.state_dict().items()}
    DistributedCheckpointer(config).save(sharded_model_state_dict(module), 1)

    pid = os.fork()
    if pid == 0:  # the saver: it writes all its files, then dies before publishing them
        try:
            checkpointer = DistributedCheckpointer(config)
            checkpointer._publish = lambda iteration: os.kill(os.getpid(), signal.SIGKILL)
            with torch.no_grad():
                module.weight.add_(1.0)
            checkpointer.save(sharded_model_state_dict(module), 2)
        finally:
            os._exit(1)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    partial = tmp_path / "iter_0000002.inprogress"
    assert any(partial.iterdir()), "the killed saver should have written files"
    assert latest_iteration(tmp_path) == 1 and not checkpoint_dir(tmp_path, 2).exists()

    loaded = sharded_model_state_dict(nn.Linear(4, 4))
    assert DistributedCheckpointer(config).load(loaded) == 1
    assert all(torch.equal(loaded[k], saved[k]) for k in saved)
    DistributedCheckpointer(config).save(sharded_model_state_dict(module), 2)  # a retry cleans up
    assert latest_iteration(tmp_path) == 2 and not partial.exists()


def test_format_errors(tmp_path):
    with pytest.raises(ConfigError, match=r"zarr.*use 'torch_dist'"):
        CheckpointConfig(ckpt_format="zarr")
    with pytest.raises(ConfigError, match="ckpt_format"):
        DistributedCheckpointer(CheckpointConfig(ckpt_format="fsdp_dtensor"))
    with pytest.raises(FileNotFoundError, match="nothing has been saved"):
        DistributedCheckpointer(CheckpointConfig(load=str(tmp_path))).load({})
    with pytest.raises(FileNotFoundError, match="nothing has been saved"):
        DistributedCheckpointer(CheckpointConfig(load=str(tmp_path))).saved_keys()


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_files_written_beside_the_tensors_are_published_with_them(tmp_path, async_save):
    config = CheckpointConfig(save=str(tmp_path), load=str(tmp_path), async_save=async_save)
    checkpointer = DistributedCheckpointer(config)
    seen = []

    def write_files(directory):
        seen.append(directory)
        (directory / "note.json").write_text('{"iteration": 3}')

    checkpointer.save(sharded_model_state_dict(nn.Linear(2, 2)), 3, write_files=write_files)
    checkpointer.wait()
    assert seen == [tmp_path / "iter_0000003.inprogress"]  # written before the checkpoint is published
    assert (checkpoint_dir(tmp_path, 3) / "note.json").read_text() == '{"iteration": 3}'
    assert latest_iteration(tmp_path) == 3
