"""Knowledge distillation in ``mcore-train``: a frozen teacher loaded from an mcore-train checkpoint
runs on each micro-batch beside the student, whose loss becomes a weighted sum of the logit KL to
the teacher, hidden-state distances on chosen layer pairs and the usual cross entropy.

The teacher is built from its own config (any depth, width or head count; the same vocabulary and
tokenizer as the student), at the run's tensor-parallel size, on the run's device and dtype; it is
not wrapped for data parallelism, never seen by the optimizer and not saved with the student. The
projections of ``kd_hidden_projection`` are submodules of the student (``kd_projections``), so they
train and are saved with it. Supported: data and tensor parallelism (sequence parallelism without
hidden pairs), the distributed optimizer; refused: pipeline and context parallelism, ``--fsdp``,
MoE student or teacher, full activation recompute with hidden pairs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from mcore_parallel import ConfigError, ProcessGroupCollection, vocab_parallel_cross_entropy

from ..checkpoints.errors import CheckpointConfigMissingError
from ..checkpoints.inference_loader import load_mcore_train_model
from ..checkpoints.metadata import TOKENIZER_FILE, read_model_config, read_tokenizer
from ..data.tokenizer import Tokenizer
from ..models.gpt.model import GPTModel
from .config import DistillationConfig, TrainConfigs
from .distillation_losses import hidden_state_loss, logit_kl_loss
from .evaluation import heldout_mean
from .model_setup import TrainModel
from .resume_config import latest_checkpoint_directory
from .schedule import global_mean_loss, masked_mean_loss

PROJECTIONS = "kd_projections"
"""Name of the student's submodule holding the hidden-state projections (``ModuleDict``, key ``S_T``)."""


def _teacher_directory(config: DistillationConfig) -> Path:
    directory = latest_checkpoint_directory(config.teacher_load)
    if directory is None:
        raise ConfigError(["teacher_load"], f"no mcore-train checkpoint in {config.teacher_load}")
    return directory


def teacher_model_config(config: DistillationConfig) -> tuple[dict, int]:
    """The teacher's saved ``TransformerConfig`` fields and vocabulary size: from ``teacher_config``
    where given, else from the checkpoint of ``teacher_load``.

    Raises:
        ConfigError: no checkpoint in ``teacher_load``, or no model config for it.
    """
    directory = _teacher_directory(config)
    try:
        return read_model_config(Path(config.teacher_config) if config.teacher_config else directory)
    except CheckpointConfigMissingError as error:
        raise ConfigError(["teacher_load", "teacher_config"], str(error)) from error


def check_distillation(configs: TrainConfigs) -> None:
    """Refuse, before training, a distillation run this implementation does not do.

    Raises:
        ConfigError: pipeline or context parallelism, ``--fsdp``, an MoE student or teacher,
            hidden pairs out of range or with sequence parallelism or full recompute, widths that
            differ without ``kd_hidden_projection``, a teacher the TP size does not split; each
            naming the fields.
    """
    kd, model = configs.distillation, configs.model
    if kd.teacher_load is None:
        return
    refused = [
        (model.pipeline_model_parallel_size > 1, "pipeline_model_parallel_size", "pipeline parallelism"),
        (model.context_parallel_size > 1, "context_parallel_size", "context parallelism"),
        (configs.training.fsdp, "fsdp", "--fsdp"),
        (model.num_moe_experts is not None, "num_moe_experts", "an MoE student"),
    ]
    for refuse, field, what in refused:
        if refuse:
            raise ConfigError(["teacher_load", field], f"distillation does not support {what}")
    fields, _ = teacher_model_config(kd)
    if fields.get("num_moe_experts") is not None:
        raise ConfigError(["teacher_load"], "distillation does not support an MoE teacher")
    tp = model.tensor_model_parallel_size
    for name in ("num_attention_heads", "num_query_groups"):
        value = fields.get(name) or fields["num_attention_heads"]
        if value % tp:
            raise ConfigError(
                ["teacher_load", "tensor_model_parallel_size"],
                f"the teacher's {name} ({value}) does not split over {tp} tensor-parallel ranks",
            )
    _check_hidden_pairs(configs, fields)


def _check_hidden_pairs(configs: TrainConfigs, teacher: dict) -> None:
    kd, model = configs.distillation, configs.model
    pairs = kd.hidden_pairs
    if not pairs:
        return
    for field, refuse, what in (
        ("sequence_parallel", model.sequence_parallel, "sequence parallelism"),
        ("recompute_granularity", model.recompute_granularity == "full", "full activation recompute"),
    ):
        if refuse:
            raise ConfigError(
                ["kd_hidden_pairs", field], f"hidden-state distillation does not support {what}"
            )
    for student, teacher_layer in pairs:
        if student >= model.num_layers or teacher_layer >= teacher["num_layers"]:
            raise ConfigError(
                ["kd_hidden_pairs"],
                f"pair {student}:{teacher_layer} is out of range: the student has {model.num_layers} layers, "
                f"the teacher {teacher['num_layers']}",
            )
    if model.hidden_size != teacher["hidden_size"] and not kd.kd_hidden_projection:
        raise ConfigError(
            ["kd_hidden_pairs", "kd_hidden_projection", "hidden_size"],
            f"the student's hidden states ({model.hidden_size} wide) and the teacher's "
            f"({teacher['hidden_size']}) differ in width: add --kd-hidden-projection",
        )


def build_projections(configs: TrainConfigs) -> dict[str, torch.nn.Module]:
    """``{PROJECTIONS: ModuleDict}`` of a linear map per hidden pair (student width to teacher width)
    for ``build_train_model(extra_modules=...)``, seeded by the run's seed; ``{}`` without them."""
    kd, model = configs.distillation, configs.model
    if not (kd.teacher_load and kd.hidden_pairs and kd.kd_hidden_projection):
        return {}
    width = teacher_model_config(kd)[0]["hidden_size"]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(configs.training.seed)
        maps = {
            f"{s}_{t}": torch.nn.Linear(model.hidden_size, width, bias=False, dtype=model.params_dtype)
            for s, t in kd.hidden_pairs
        }
    return {PROJECTIONS: torch.nn.ModuleDict(maps)}


def _check_same_tokenizer(teacher: Tokenizer | None, student: Tokenizer, teacher_vocab: int, where: Path):
    same = teacher is None or teacher.backend.get_vocab() == student.backend.get_vocab()
    if teacher_vocab != student.vocab_size or not same:
        raise ConfigError(
            ["teacher_load", "tokenizer_file"],
            f"the teacher in {where} was trained with another vocabulary ({teacher_vocab} ids) than the "
            f"student's tokenizer ({student.vocab_size} ids): distillation needs the same tokenizer",
        )


def load_teacher(
    config: DistillationConfig,
    tokenizer: Tokenizer,
    groups: ProcessGroupCollection,
    device: torch.device,
    dtype: torch.dtype,
) -> GPTModel:
    """The frozen teacher (eval mode, no gradients) of ``config`` on ``device`` in ``dtype``, split
    over the tensor-parallel group of ``groups`` (collective over it).

    Raises:
        ConfigError: the teacher's vocabulary or tokenizer differs from ``tokenizer``'s.
    """
    directory = _teacher_directory(config)
    fields, vocab_size = teacher_model_config(config)
    saved_tokenizer = read_tokenizer(directory) if (directory / TOKENIZER_FILE).is_file() else None
    _check_same_tokenizer(saved_tokenizer, tokenizer, vocab_size, directory)
    teacher = load_mcore_train_model(directory, fields, vocab_size, tokenizer, dtype, groups)
    return teacher.to(device).requires_grad_(False).eval()


@contextlib.contextmanager
def layer_outputs(model: GPTModel, layers: list[int]) -> Iterator[dict[int, torch.Tensor]]:
    """Within the block: ``{layer index: its latest output [s, b, h]}`` of ``model``'s chosen
    layers, recorded by forward hooks (removed on exit)."""
    outputs: dict[int, torch.Tensor] = {}

    def hook(index):
        return lambda module, args, output: outputs.__setitem__(index, output)

    handles = [model.decoder.layers[i].register_forward_hook(hook(i)) for i in sorted(set(layers))]
    try:
        yield outputs
    finally:
        for handle in handles:
            handle.remove()


def _in_shard(full: torch.Tensor, local: int, rank: int) -> torch.Tensor:
    """Columns ``[rank * local, (rank + 1) * local)`` of ``full`` logits, ``-inf`` beyond its vocabulary."""
    shard = full[..., rank * local : (rank + 1) * local]
    missing = local - shard.shape[-1]
    return torch.nn.functional.pad(shard, (0, missing), value=float("-inf")) if missing else shard


class DistillationLoss:
    """The ``last_stage_output`` of a distillation run (with ``pass_labels=False``): student logits
    and micro-batch in, the weighted loss out; the teacher runs on the same micro-batch.

    Use it inside ``capture()`` (the hooks recording hidden states). Each part's value per
    micro-batch is kept for ``metrics``."""

    def __init__(self, config: DistillationConfig, student: GPTModel, teacher: GPTModel, tp_group):
        self.config, self.student, self.teacher, self.tp_group = config, student, teacher, tp_group
        self.pairs = config.hidden_pairs
        # a teacher padded otherwise than the student hands over whole logits, resharded here
        teacher.parallel_output = teacher.padded_vocab_size == student.padded_vocab_size
        self.parts: dict[str, list[torch.Tensor]] = {}
        self._student_h: dict[int, torch.Tensor] = {}
        self._teacher_h: dict[int, torch.Tensor] = {}

    @contextlib.contextmanager
    def capture(self) -> Iterator[None]:
        """Record the paired layers' outputs of student and teacher while in the block."""
        with (
            layer_outputs(self.student, [s for s, _ in self.pairs]) as student_h,
            layer_outputs(self.teacher, [t for _, t in self.pairs]) as teacher_h,
        ):
            self._student_h, self._teacher_h = student_h, teacher_h
            yield

    def teacher_logits(self, batch: dict[str, torch.Tensor], local: int) -> torch.Tensor:
        """The teacher's logits of ``batch`` in the student's vocabulary shard (``local`` columns)."""
        with torch.no_grad():
            logits = self.teacher(batch["tokens"], position_ids=batch["position_ids"])
        if self.teacher.parallel_output:
            return logits
        rank = dist.get_rank(self.tp_group) if self.tp_group is not None else 0
        return _in_shard(logits, local, rank)

    def kl(self, logits: torch.Tensor, batch: dict[str, torch.Tensor], temperature=1.0, direction="forward"):
        """The logit KL of student ``logits`` to the teacher's on ``batch``."""
        teacher = self.teacher_logits(batch, logits.shape[-1])
        return logit_kl_loss(logits, teacher, batch["loss_mask"], temperature, direction, self.tp_group)

    def __call__(self, logits: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        config = self.config
        kl = self.kl(logits, batch, config.kd_temperature, config.kd_direction)
        per_token_ce = vocab_parallel_cross_entropy(
            logits.transpose(0, 1), batch["labels"].t(), self.tp_group
        )
        ce = masked_mean_loss(per_token_ce.t(), batch["loss_mask"])
        loss = config.kd_logit_weight * kl + config.kd_ce_weight * ce
        values = {"kd/logit_kl": kl, "kd/ce": ce}
        if self.pairs:
            hidden = self._hidden_loss(batch["loss_mask"].t())
            loss = loss + config.kd_hidden_weight * hidden
            values["kd/hidden"] = hidden
        for name, value in values.items():
            self.parts.setdefault(name, []).append(value.detach())
        return loss

    def _hidden_loss(self, loss_mask: torch.Tensor) -> torch.Tensor:
        """Mean over the pairs of the hidden-state loss (token-major ``loss_mask [s, b]``)."""
        projections = getattr(self.student, PROJECTIONS, None)
        losses = [
            hidden_state_loss(
                self._student_h[s],
                self._teacher_h[t],
                self.config.kd_hidden_kind,
                projections[f"{s}_{t}"] if projections is not None else None,
                loss_mask,
            )
            for s, t in self.pairs
        ]
        return torch.stack(losses).mean()

    def metrics(self, groups: ProcessGroupCollection) -> dict[str, float]:
        """Each part's mean over the micro-batches since the last call and the data-parallel ranks
        (collective); resets them."""
        parts, self.parts = self.parts, {}
        return {name: global_mean_loss(values, groups) for name, values in sorted(parts.items())}


class DistillationRun:
    """What the training loop does for distillation: the teacher and the loss, the schedule's
    arguments, the per-iteration metrics and the held-out KL of the report."""

    def __init__(self, configs: TrainConfigs, model: TrainModel, tokenizer: Tokenizer, groups, device, dtype):
        teacher = load_teacher(configs.distillation, tokenizer, groups, device, dtype)
        self.loss = DistillationLoss(configs.distillation, model.chunks[0], teacher, groups.tp)
        self.configs, self.model, self.groups, self.device, self.dtype = configs, model, groups, device, dtype
        self.history: list[list[float]] = []

    def schedule_arguments(self) -> dict:
        """``run_micro_batches``' keywords for a training step."""
        return {"last_stage_output": self.loss, "pass_labels": False}

    def metrics(self, iteration: int) -> dict[str, float]:
        """This iteration's loss parts (collective); the logit KL goes into the history."""
        metrics = self.loss.metrics(self.groups)
        self.history.append([iteration, metrics["kd/logit_kl"]])
        return metrics

    def heldout_kl(self, dataset) -> float:
        """The student's ``KL(teacher ‖ student)`` at temperature 1 on the held-out batches of the
        evaluations (collective)."""
        training = self.configs.training
        return heldout_mean(
            self.model,
            dataset,
            training.eval_iters,
            training.global_batch_size,
            training.micro_batch_size,
            self.groups,
            self.device,
            self.dtype,
            last_stage_output=self.loss.kl,
            pass_labels=False,
        )

    def report(self, kl_before: float, kl_after: float) -> dict:
        """The ``kd`` entry of ``report.json``."""
        kd = self.configs.distillation
        return {
            "teacher_load": kd.teacher_load,
            "teacher_directory": str(_teacher_directory(kd)),
            "heldout_kl_before": kl_before,
            "heldout_kl_after": kl_after,
            "train_logit_kl": self.history,
            "weights": {"logit": kd.kd_logit_weight, "ce": kd.kd_ce_weight, "hidden": kd.kd_hidden_weight},
            "temperature": kd.kd_temperature,
            "direction": kd.kd_direction,
            "hidden_pairs": kd.hidden_pairs,
        }
