"""``GRPOLoop``: GRPO iterations of an mcore policy with rollouts from a live inference engine."""

from __future__ import annotations

import copy
import dataclasses
import math
import time
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
import torch.distributed as dist
from mcore_api import experimental_api
from mcore_inference import DynamicInferenceEngine
from mcore_models import GPTModel
from mcore_models.training import build_optimizer
from mcore_parallel import DistributedDataParallel, DistributedDataParallelConfig, ProcessGroupCollection

from ..agents.agent import RewardOnlyAgent, TaskExample
from ..agents.evaluation import evaluate
from ..agents.generators import grouped_rollouts
from ..agents.rollout import RolloutGroup
from ..inference.engine_handle import EngineHandle
from ..inference.vocab import check_vocabulary
from ..packing import PackedBin, TrainingSequence, label_logprobs, pack_sequences, packed_grpo_loss
from ..packing.first_fit import tightest_capacity
from ..refit import refit
from .batch import RolloutBatch, rollout_batch
from .config import GRPOLoopConfig
from .fsdp import FSDPAdam, check_fsdp_policy, shard_policy
from .prompts import PromptStream

PHASES = ("generation", "reference", "training", "refit")
"""Where an iteration's time goes, in order (``time_<phase>`` in its record)."""


def _frozen_copy(model: GPTModel, groups: ProcessGroupCollection) -> GPTModel:
    """An eval-mode copy of ``model`` without gradients, on the same process groups, its
    parameters tagged as the originals (tensor-parallel split, ...: a deep copy drops the tags)."""
    shared = [dist.group.WORLD, *(getattr(groups, f.name) for f in dataclasses.fields(groups))]
    shared += [v for m in model.modules() for v in vars(m).values() if isinstance(v, dist.ProcessGroup)]
    frozen = copy.deepcopy(model, {id(g): g for g in shared if g is not None}).eval()
    for original, copied in zip(model.parameters(), frozen.parameters(), strict=True):
        vars(copied).update(vars(original))
    frozen.requires_grad_(False)
    return frozen


def _tp_group(model: GPTModel) -> dist.ProcessGroup | None:
    group = model.tp_group
    return group if group is not None and dist.get_world_size(group) > 1 else None


def _engine_options(config: GRPOLoopConfig, model: GPTModel) -> dict[str, Any]:
    """A KV cache that holds every rollout of an iteration at once, each up to ``max_sequence_length``."""
    block_size, requests = 16, config.prompts_per_iteration * config.group_size
    spec = model.kv_cache_spec
    bytes_per_block = 2 * len(spec.layer_numbers) * block_size * spec.num_kv_heads * spec.head_dim * 4
    blocks = requests * math.ceil(config.max_sequence_length / block_size) + 1
    return dict(
        block_size=block_size,
        max_requests=requests,
        max_tokens=max(512, config.max_sequence_length),
        max_sequence_length=config.max_sequence_length,
        kv_cache_memory=blocks * bytes_per_block,
    )


@experimental_api
class GRPOLoop:
    """GRPO on ``policy`` (a float32 ``GPTModel``, one process or data-parallel ranks of
    ``groups``) with the prompts and rewards of ``agent``, text through ``tokenizer``.

    It owns: the policy wrapped in mcore-parallel's ``DistributedDataParallel`` with Adam,
    mcore-models' ``LocalOptimizer`` or, with ``config.distributed_optimizer``, mcore-parallel's
    ``DistributedOptimizer`` (each data-parallel rank keeps a shard of the optimizer state); or,
    with ``config.fsdp``, the policy sharded in place by mcore-fsdp's ``fully_shard`` over the
    data-parallel group (``config.fsdp_strategy``; each ``TransformerLayer`` a unit, the
    embedding, final norm and output layer the root unit) with Adam on its FP32 main-parameter
    shards, clipped by its ``clip_grad_norm_``; ``config.optimizer_cpu_offload`` keeps the
    optimizer state on the CPU (with FSDP: ``fully_shard``'s ``offload_optimizer``); a
    ``DynamicInferenceEngine`` over a copy of the policy (``engine_options``: its context's
    keywords, default sized for one iteration's rollouts); a frozen copy of the
    initial policy as the KL reference when ``config.beta > 0`` (none otherwise). Both copies are
    made from the whole policy before DDP or FSDP takes it over.

    ``step()`` runs one iteration: the next training prompts through the engine
    (``grouped_rollouts``, ``group_size`` samples each, seeded by ``config.seed`` and the
    iteration; each data-parallel rank samples and scores a share of the prompts, then the groups
    are gathered), the engine's KV cache suspended, advantages per prompt, then
    ``config.minibatches`` optimizer steps, each on a share of the groups: its rollouts packed
    into bins, the reference's log-probs, a step on ``packed_grpo_loss`` (the loss times the
    data-parallel size: DDP and FSDP average the ranks' gradients; with FSDP the forward chunks
    before the last accumulate their gradients under ``no_sync``); then the new weights refit
    into the engine (``refit_engine()``; with FSDP the weights gathered whole on every rank), its
    cache resumed. A rollout whose reward failed is left out, counted and its error kept.
    ``evaluate()``: greedy held-out reward and accuracy; ``baseline``: the one before the first
    iteration. ``policy_state_dict()``: the policy's whole weights (gathered with FSDP);
    ``save_checkpoint`` / ``load_checkpoint``: the whole RL state (see ``loop.checkpoint``).

    Raises ``VocabularyMismatchError`` when ``tokenizer`` has ids the policy has no rows for,
    ``TypeError``/``ValueError`` for a policy that is not a float32 ``GPTModel``, and
    mcore-parallel's ``ConfigError`` naming the fields for ``config.fsdp`` with a policy split
    over tensor-parallel ranks or without mcore-fsdp installed (``GRPOLoopConfig`` itself refuses
    ``fsdp`` with ``distributed_optimizer``)."""

    def __init__(
        self,
        policy: GPTModel,
        agent: RewardOnlyAgent,
        tokenizer: Any,
        config: GRPOLoopConfig,
        groups: ProcessGroupCollection,
        *,
        engine_options: dict[str, Any] | None = None,
    ):
        if not isinstance(policy, GPTModel):
            raise TypeError(f"policy: must be an mcore_models.GPTModel, got {type(policy).__name__}")
        dtypes = {p.dtype for p in policy.parameters()}
        if dtypes != {torch.float32}:
            raise ValueError(
                f"policy: must be float32 (the trainer's weights), got {sorted(map(str, dtypes))}"
            )
        check_vocabulary(tokenizer, policy.vocab_size, "the policy model")
        if config.fsdp:
            check_fsdp_policy(policy)
        self.agent, self.tokenizer, self.config, self.groups = agent, tokenizer, config, groups
        self.loss_config = config.loss_config()
        self.reference = _frozen_copy(policy, groups) if config.beta > 0 else None
        options = _engine_options(config, policy) | (engine_options or {})
        self.engine = DynamicInferenceEngine(
            _frozen_copy(policy, groups), tokenizer=tokenizer, freeze_gc=False, **options
        )  # the copies are made before DDP or FSDP takes the policy's parameters over
        if config.fsdp:
            self.model = shard_policy(policy, groups.dp, config.fsdp_strategy, config.optimizer_cpu_offload)
            self.optimizer = FSDPAdam(self.model, config.optimizer_config(), groups.dp)
        else:
            ddp = DistributedDataParallelConfig(use_distributed_optimizer=config.distributed_optimizer)
            self.model = DistributedDataParallel(policy, ddp, groups.dp)
            self.optimizer = build_optimizer(self.model, config.optimizer_config(), groups)
        self.handle = EngineHandle(self.engine)
        self.prompts = PromptStream(agent, config.seed)
        self.iteration = 0
        self.history: list[dict[str, Any]] = []
        self.baseline: dict[str, float] | None = None

    @property
    def policy(self) -> GPTModel:
        """The policy being trained: the ``GPTModel`` that DDP wraps or, with ``config.fsdp``, the
        sharded ``GPTModel`` itself (also an mcore-fsdp ``FSDPModule``): its ``parameters()`` are
        then this rank's FP32 main-parameter shards (1-D), its forward is collective over the
        data-parallel group, and ``policy_state_dict()`` gathers its whole weights."""
        return self.model if self.config.fsdp else self.model.module

    def policy_state_dict(self) -> dict[str, torch.Tensor]:
        """The policy's weights and persistent buffers by state-dict name, as plain tensors: with
        ``config.fsdp`` gathered whole from the shards (collective over the data-parallel group:
        call it on every rank), else the policy's own ``state_dict()``."""
        if self.config.fsdp:
            return self.policy.full_state_dict(cpu=False)
        return self.policy.state_dict()

    def refit_engine(self) -> int:
        """Copy the policy's current weights into the engine (``refit``; with ``config.fsdp`` from
        the gathered whole weights, collective over the data-parallel group); returns the
        engine's new ``weight_version``."""
        if self.config.fsdp:
            return refit(self.policy, self.engine, tensors=self.policy_state_dict())
        return refit(self.policy, self.engine)

    @property
    def dp_size(self) -> int:
        """Data-parallel ranks of the policy."""
        return dist.get_world_size(self.groups.dp)

    def sampling_seed(self, iteration: int) -> int:
        """The seed of ``iteration``'s rollouts: sample ``j`` of its prompt ``p`` draws with it
        plus ``p * group_size + j``, so no two completions of a run share a stream."""
        config = self.config
        return (config.seed << 32) + iteration * config.prompts_per_iteration * config.group_size

    def step(self, evaluate_after: bool = False) -> dict[str, Any]:
        """One GRPO iteration (and a held-out evaluation after it when ``evaluate_after``); its
        record, also appended to ``history``."""
        iteration, config, times = self.iteration + 1, self.config, {}
        with _timed(times, "generation"):
            self.engine.resume()
            groups = self._rollouts(self.prompts.take(config.prompts_per_iteration), iteration)
            self.engine.suspend()  # the KV cache is free while the policy trains
        batch = rollout_batch(groups, self.loss_config)
        steps = [self._train_minibatch(sequences, times) for sequences in self._minibatches(batch)]
        with _timed(times, "refit"):
            version = self.refit_engine()
            self.engine.resume()
        self.iteration = iteration
        record = {"iteration": iteration, **_reward_record(batch), **_mean_record(steps)}
        record["weight_version"] = version
        record |= {f"time_{phase}": times[phase] for phase in PHASES}
        if evaluate_after:
            record |= {f"heldout_{k}": v for k, v in self.evaluate().items()}
        self.history.append(record)
        return record

    def _rollouts(self, tasks: list[TaskExample], iteration: int) -> list[RolloutGroup]:
        """The scored groups of ``tasks``, in order, every rank's: each data-parallel rank
        generates and scores a consecutive share of the prompts; the groups are then gathered.
        A sample's seed depends on its iteration, its prompt's place in the batch and its sample
        number only, so the groups are the same for any number of ranks."""
        config, rank, ranks = self.config, dist.get_rank(self.groups.dp), self.dp_size
        start, end = rank * len(tasks) // ranks, (rank + 1) * len(tasks) // ranks
        seed = self.sampling_seed(iteration) + start * config.group_size
        sampling = dict(max_tokens=config.max_tokens, temperature=config.temperature, seed=seed)
        mine = (
            grouped_rollouts(self.handle, tasks[start:end], config.group_size, **sampling)
            if end > start
            else []
        )
        if ranks == 1:
            return mine
        shares: list[list[RolloutGroup] | None] = [None] * ranks
        dist.all_gather_object(shares, mine, group=self.groups.dp)
        # each rank numbered its groups from 0: number them by their prompt's place in the batch
        return [
            _renumbered(group, group_id)
            for group_id, group in enumerate(g for share in shares for g in share)
        ]

    def evaluate(self) -> dict[str, float]:
        """The held-out prompts (``config.eval_prompts`` of them, default all): ``reward``, the
        mean reward of ``config.eval_samples`` completions each sampled as in training (same
        temperature, fixed seed: the expected reward GRPO raises); ``accuracy`` and
        ``greedy_reward`` of the greedy completion; ``failed``: completions whose reward failed."""
        self.engine.resume()
        config = self.config
        examples = list(self.agent.evaluation_prompts())[: config.eval_prompts]
        common = dict(examples=examples, max_tokens=config.max_tokens)
        sampled = evaluate(
            self.agent,
            self.handle,
            n=config.eval_samples,
            temperature=config.temperature,
            seed=config.seed,
            **common,
        )
        greedy = evaluate(self.agent, self.handle, temperature=0, **common)
        return {
            "reward": sampled.mean_reward,
            "accuracy": greedy.pass_at_k[1],
            "greedy_reward": greedy.mean_reward,
            "failed": sampled.num_failed + greedy.num_failed,
        }

    def _minibatches(self, batch: RolloutBatch) -> list[list[TrainingSequence]]:
        """``batch``'s sequences in ``config.minibatches`` consecutive runs of whole prompt groups
        (as even in groups as they divide), one optimizer step each; empty runs are dropped, and a
        batch without sequences gives one empty run (a step that trains nothing)."""
        groups = batch.group_sizes
        count = min(self.config.minibatches, max(len(groups), 1))
        runs, start = [], 0
        for part in range(count):
            members = groups[part * len(groups) // count : (part + 1) * len(groups) // count]
            runs.append(batch.sequences[start : start + sum(members)])
            start += sum(members)
        return [run for run in runs if run] or [[]]

    def _train_minibatch(
        self, sequences: list[TrainingSequence], times: dict[str, float]
    ) -> dict[str, float]:
        bins, sizes = self._pack(sequences)
        with _timed(times, "reference"):
            ref = self._reference_logprobs(bins) if self.reference is not None else None
        with _timed(times, "training"):
            return self._train(bins, sizes, ref)

    def _pack(self, sequences: list[TrainingSequence]) -> tuple[tuple[PackedBin, ...], tuple[int, int]]:
        """This data-parallel rank's bins of ``sequences`` and their (sequences, tokens): bins of
        the length, up to ``config.bin_length``, that pads them least (``tightest_capacity``)."""
        if not sequences:
            return (), (0, 0)
        lengths = [len(s.prompt_ids) + len(s.completion_ids) for s in sequences]
        packed = pack_sequences(
            sequences,
            tightest_capacity(lengths, self.config.bin_length, self._tp_size),
            data_parallel_size=self.dp_size,
            pad_token_id=self.tokenizer.pad_id if hasattr(self.tokenizer, "pad_id") else 0,
        )
        rank = dist.get_rank(self.groups.dp)
        return packed.data_parallel_bins(rank), (packed.num_sequences, packed.num_tokens)

    @property
    def _tp_size(self) -> int:
        group = _tp_group(self.policy)
        return 1 if group is None else dist.get_world_size(group)

    def _chunks(self, bins: tuple[PackedBin, ...]) -> list[tuple[PackedBin, ...]]:
        """``bins`` in as few runs as hold at most ``config.bins_per_forward`` x ``bin_length``
        tokens each (as even as they divide), one forward and backward each."""
        if not bins:
            return []
        budget = self.config.bins_per_forward * self.config.bin_length
        rows_per_run = max(1, budget // bins[0].tokens.shape[1])
        runs = -(-len(bins) // rows_per_run)
        return [bins[run * len(bins) // runs : (run + 1) * len(bins) // runs] for run in range(runs)]

    def _forward(self, model: torch.nn.Module, bins: tuple[PackedBin, ...]) -> torch.Tensor:
        """The label log-probs ``[len(bins), L]`` of ``bins`` stacked as rows of one batch (each
        row's documents told apart by its position resets). The padding that ends every row is
        left out of the forward (causal: no token before it sees it), up to a multiple of the
        tensor-parallel size (so that sequence-parallel splits still divide it); its log-probs are 0."""
        tp_group, multiple = _tp_group(self.policy), self._tp_size
        length = bins[0].tokens.shape[1]
        longest = max(1, *(length - b.padding for b in bins))
        used = min(length, math.ceil(longest / multiple) * multiple)

        def rows(field: str) -> torch.Tensor:
            return torch.cat([getattr(b, field)[:, :used] for b in bins])

        logits = model(rows("tokens"), position_ids=rows("position_ids"))
        logp = label_logprobs(logits, rows("labels"), tp_group)
        return torch.nn.functional.pad(logp, (0, length - used))

    def _reference_logprobs(self, bins: tuple[PackedBin, ...]) -> list[torch.Tensor]:
        """The reference's label log-probs of each of ``_chunks(bins)``, ``[len(chunk), L]``."""
        with torch.no_grad():
            return [self._forward(self.reference, chunk) for chunk in self._chunks(bins)]

    def _gradient_sync(self, last: bool):
        """Where a backward runs: under the sharded model's ``no_sync`` (gradients accumulated
        locally, no communication) unless it is the ``last`` of an optimizer step; DDP reduces
        every backward's gradients."""
        return self.model.no_sync() if self.config.fsdp and not last else nullcontext()

    def _train(
        self, bins: tuple[PackedBin, ...], sizes: tuple[int, int], ref: list[torch.Tensor] | None
    ) -> dict[str, float]:
        """One optimizer step on the bins' GRPO loss (none when no sequence has an advantage)."""
        num_sequences, num_tokens = sizes
        if num_sequences == 0:
            return {"loss": 0.0, "grad_norm": 0.0, "trained_sequences": 0, "trained_tokens": 0}
        self.policy.train()
        warmup = self.config.lr_warmup_iterations
        for group in self.optimizer.param_groups:
            group["lr"] = (
                self.config.lr * min(1.0, (self.iteration + 1) / warmup) if warmup else self.config.lr
            )
        self.optimizer.zero_grad()
        loss, kl, clipped = 0.0, 0.0, 0.0
        chunks = self._chunks(bins)  # as many on every rank: each rank has as many bins
        for number, chunk in enumerate(chunks):
            result = packed_grpo_loss(
                self._forward(self.model, chunk),
                chunk,
                self.loss_config,
                num_sequences=num_sequences,
                num_tokens=num_tokens,
                ref_logp=None if ref is None else ref[number],
            )
            share, metrics = sum(int(b.loss_mask.sum()) for b in chunk) / num_tokens, result.metrics
            if metrics:
                clipped += share * float(metrics["clip_fraction_low"] + metrics["clip_fraction_high"])
                kl += share * float(metrics.get("kl_mean", 0.0))
            # DDP and mcore-fsdp average the ranks' gradients; mcore-fsdp accumulates the chunks
            # before the last locally (in FP32) and reduces their sum with the last one's
            with self._gradient_sync(last=number == len(chunks) - 1):
                (result.loss * self.dp_size).backward()
            loss += float(result.loss.detach())
        grad_norm = float(self.optimizer.step())
        self.policy.eval()
        totals = torch.tensor([loss, kl, clipped], dtype=torch.float64)
        dist.all_reduce(totals, group=self.groups.dp)
        loss, kl, clipped = totals.tolist()
        record = {"loss": loss, "grad_norm": grad_norm, "clip_fraction": clipped}
        record |= {"trained_sequences": num_sequences, "trained_tokens": num_tokens}
        return record | ({"kl": kl} if self.reference is not None else {})


def _renumbered(group: RolloutGroup, group_id: int) -> RolloutGroup:
    """``group`` and its rollouts with ``group_id`` (their prompt's position in the whole batch)."""
    rollouts = [dataclasses.replace(r, group_id=group_id) for r in group.rollouts]
    return dataclasses.replace(group, group_id=group_id, rollouts=rollouts)


def _mean_record(steps: list[dict[str, float]]) -> dict[str, float]:
    """The optimizer steps' records averaged (sequence and token counts summed), and their number."""
    summed = ("trained_sequences", "trained_tokens")
    record = {k: sum(s[k] for s in steps) / (1 if k in summed else len(steps)) for k in steps[0]}
    return record | {"optimizer_steps": sum(s["trained_sequences"] > 0 for s in steps)}


def _reward_record(batch: RolloutBatch) -> dict[str, Any]:
    """The rollouts' mean reward and accuracy, and their failures."""
    rewards = batch.rewards
    return {
        "train_reward": sum(rewards) / len(rewards) if rewards else math.nan,
        "train_accuracy": sum(r >= 1.0 for r in rewards) / len(rewards) if rewards else math.nan,
        "failed_rollouts": len(batch.errors),
        "first_error": batch.errors[0] if batch.errors else None,
        "skipped_groups": batch.skipped_groups,
    }


@contextmanager
def _timed(times: dict[str, float], phase: str):
    began = time.perf_counter()
    try:
        yield
    finally:
        times[phase] = times.get(phase, 0.0) + time.perf_counter() - began
