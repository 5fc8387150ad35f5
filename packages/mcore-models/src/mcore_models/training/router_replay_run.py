"""``mcore-train --moe-router-replay {record,replay}``: record the routing of every training forward
of a run into a directory, or route a later run's training forwards as recorded.

The directory holds ``routing.json`` (the layout, model and batch shape of the recording run and the
iterations it covers) and one ``routing-rankNNNNN.pt`` per rank: the global layer numbers of that
rank's MoE routers and, per iteration, one ``[micro-batches, tokens, topk]`` tensor of expert ids per
router. A replaying run must have the recording's layout and batch shape (checked before training)
and may change anything else (learning rate, expert-bias update rate, ...): its training forwards
use the recorded experts, its evaluation and sampling route afresh. Recompute of checkpointed layers
and pipeline schedules replay in order (see ``mcore_models.transformer.moe.router_replay``).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist
from mcore_api import internal_api
from mcore_parallel import ConfigError

from ..transformer.moe import RouterReplayAction, attach_router_replay, set_router_replay_action
from .config import TrainConfigs

METADATA_FILE = "routing.json"
_FORMAT = 1
_RECORDED_FIELDS = (  # (section of TrainConfigs, field): what a replaying run must share
    ("model", "num_layers"),
    ("model", "num_moe_experts"),
    ("model", "moe_router_topk"),
    ("model", "tensor_model_parallel_size"),
    ("model", "pipeline_model_parallel_size"),
    ("model", "virtual_pipeline_model_parallel_size"),
    ("model", "context_parallel_size"),
    ("model", "expert_model_parallel_size"),
    ("model", "sequence_parallel"),
    ("training", "micro_batch_size"),
    ("training", "global_batch_size"),
    ("data", "seq_length"),
)


def rank_file(directory: str | Path, rank: int) -> Path:
    """The routing file of global ``rank`` in a recording directory."""
    return Path(directory) / f"routing-rank{rank:05d}.pt"


def _recorded_values(configs: TrainConfigs, world_size: int) -> dict:
    values = {field: getattr(getattr(configs, section), field) for section, field in _RECORDED_FIELDS}
    return {"world_size": world_size, **values}


@internal_api
def check_router_replay(configs: TrainConfigs, world_size: int) -> None:
    """Refuse a router replay setting that cannot work, before training (every rank reads the same).

    Raises:
        ConfigError: record or replay without MoE layers; replay of a directory without a recording
            (``routing.json`` or a rank's file missing), of a recording with another layout, layer
            count, expert count, top-k or batch shape (each differing field named), or one that ends
            before ``train_iters``.
    """
    training = configs.training
    if training.moe_router_replay == "off":
        return
    if configs.model.num_moe_experts is None:
        raise ConfigError(
            ["moe_router_replay", "num_moe_experts"], "router replay needs MoE layers (--num-moe-experts)"
        )
    if training.moe_router_replay != "replay":
        return
    directory = Path(training.moe_router_replay_dir)
    metadata = read_recording_metadata(directory)
    expected = _recorded_values(configs, world_size)
    differ = [name for name, value in expected.items() if metadata["run"].get(name) != value]
    if differ:
        made = ", ".join(f"{n}={metadata['run'].get(n)!r}" for n in differ)
        now = ", ".join(f"{n}={expected[n]!r}" for n in differ)
        raise ConfigError(
            ["moe_router_replay_dir", *(n for n in differ if n != "world_size")],
            f"the recording in {directory} was made with {made}; this run has {now}",
        )
    missing = [
        str(rank_file(directory, r)) for r in range(world_size) if not rank_file(directory, r).is_file()
    ]
    if missing:
        raise ConfigError(["moe_router_replay_dir"], f"the recording lacks the routing of ranks: {missing}")
    if metadata["last_iteration"] < training.train_iters:
        raise ConfigError(
            ["moe_router_replay_dir", "train_iters"],
            f"the recording in {directory} ends at iteration {metadata['last_iteration']}, "
            f"this run trains to {training.train_iters}",
        )


def read_recording_metadata(directory: str | Path) -> dict:
    """``routing.json`` of a recording directory.

    Raises:
        ConfigError: naming ``moe_router_replay_dir`` when it holds no recording.
    """
    path = Path(directory) / METADATA_FILE
    if not path.is_file():
        raise ConfigError(
            ["moe_router_replay_dir"],
            f"no recorded routing in {directory} (no {METADATA_FILE}; record one with --moe-router-replay record)",
        )
    metadata = json.loads(path.read_text())
    if metadata.get("format") != _FORMAT:
        raise ConfigError(["moe_router_replay_dir"], f"{path} is not a routing recording of format {_FORMAT}")
    return metadata


def _router_layers(container: torch.nn.Module) -> list[int]:
    """Global layer numbers of the layers whose MLP has a replayable router, in module order."""
    return [
        module.layer_number
        for module in container.modules()
        if isinstance(getattr(module, "layer_number", None), int)
        and hasattr(getattr(getattr(module, "mlp", None), "router", None), "router_replay")
    ]


@internal_api
class RouterReplayRun:
    """The routers of this rank's ``container`` under ``--moe-router-replay`` (record or replay).

    ``begin(iteration)`` before an iteration's micro-batches and ``end(iteration)`` after them; the
    forwards in between are recorded or replayed, all others route afresh. ``save`` writes a
    recording. ``first_iteration`` is the first one this run trains (after a resume).
    """

    def __init__(self, configs: TrainConfigs, container: torch.nn.Module, rank: int, first_iteration: int):
        training = configs.training
        self.mode, self.directory, self.rank = (
            training.moe_router_replay,
            training.moe_router_replay_dir,
            rank,
        )
        self.container = container
        self.replays = attach_router_replay(container, None)
        self.layers = _router_layers(container)
        if len(self.layers) != len(self.replays):
            raise RuntimeError(f"router replay: {len(self.replays)} routers in {len(self.layers)} MoE layers")
        self.first_iteration = first_iteration
        self.num_experts = configs.model.num_moe_experts
        self.iterations: dict[int, list[torch.Tensor]] = {}
        if self.mode == "replay":
            self.iterations = self._load(first_iteration, training.train_iters)

    def _load(self, first: int, last: int) -> dict[int, list[torch.Tensor]]:
        path = rank_file(self.directory, self.rank)
        recording = torch.load(path, weights_only=True)
        if recording["layers"] != self.layers:
            raise ConfigError(
                ["moe_router_replay_dir"],
                f"{path} holds routers of layers {recording['layers']}, this rank has MoE layers {self.layers}",
            )
        missing = [i for i in range(first, last + 1) if i not in recording["iterations"]]
        if missing:
            raise ConfigError(
                ["moe_router_replay_dir"], f"{path} has no routing of iterations {missing[0]}..{missing[-1]}"
            )
        return {i: recording["iterations"][i] for i in range(first, last + 1)}

    def begin(self, iteration: int) -> None:
        """Record or replay the forwards from here to ``end``."""
        if self.mode == "replay":
            for replay, micro_batches in zip(self.replays, self.iterations.pop(iteration), strict=True):
                for indices in micro_batches:
                    replay.push(indices.long())
            set_router_replay_action(self.container, RouterReplayAction.REPLAY_FORWARD)
        else:
            set_router_replay_action(self.container, RouterReplayAction.RECORD)

    def end(self, iteration: int) -> None:
        """Stop recording or replaying; keep the recorded routing of ``iteration``.

        Raises:
            RuntimeError: a replayed iteration ran fewer forwards than were recorded.
        """
        set_router_replay_action(self.container, None)
        if self.mode == "replay":
            left = [len(r.recorded) for r in self.replays]
            if any(left):
                raise RuntimeError(
                    f"router replay: iteration {iteration} left recorded forwards unused: {left}"
                )
            return
        dtype = torch.int16 if self.num_experts <= torch.iinfo(torch.int16).max else torch.int32
        self.iterations[iteration] = [
            torch.stack(list(r.recorded)).to(device="cpu", dtype=dtype) for r in self.replays
        ]
        for replay in self.replays:
            replay.clear()

    def save(self, configs: TrainConfigs, world_size: int, last_iteration: int) -> None:
        """Write this rank's recording (and, on rank 0, ``routing.json``); call on every rank.

        A resumed run adds its iterations to a recording of the same run already in the directory
        (the iterations before the resume); any other recording there is replaced."""
        if self.mode != "record":
            return
        directory, run = Path(self.directory), _recorded_values(configs, world_size)
        directory.mkdir(parents=True, exist_ok=True)
        iterations, first = self.iterations, self.first_iteration
        earlier = _earlier_recording(directory, run, self.rank, first)
        if dist.is_initialized():
            dist.barrier()  # every rank has read what was there before any rank writes
        if earlier is not None:
            first = earlier[0]
            iterations = {i: r for i, r in earlier[1].items() if i < self.first_iteration} | iterations
        torch.save({"layers": self.layers, "iterations": iterations}, rank_file(directory, self.rank))
        if self.rank == 0:
            metadata = {
                "format": _FORMAT,
                "run": run,
                "first_iteration": first,
                "last_iteration": last_iteration,
            }
            (directory / METADATA_FILE).write_text(json.dumps(metadata, indent=1) + "\n")


def _earlier_recording(directory: Path, run: dict, rank: int, first: int) -> tuple[int, dict] | None:
    """``(first iteration, iterations)`` of this rank's recording of the same ``run`` in ``directory``
    when it reaches up to ``first`` (where a resumed run goes on), else ``None``."""
    path = directory / METADATA_FILE
    if first == 1 or not path.is_file() or not rank_file(directory, rank).is_file():
        return None
    metadata = json.loads(path.read_text())
    if (
        metadata.get("run") != run
        or not metadata["first_iteration"] < first <= metadata["last_iteration"] + 1
    ):
        return None
    return metadata["first_iteration"], torch.load(rank_file(directory, rank), weights_only=True)[
        "iterations"
    ]
