"""``Trainer``: the iterations of a training run over its components, then the run's end.

One iteration: set the learning rate, take the global batch, zero the gradients, run the
forward and backward passes of its micro-batches (with distillation's loss and router replay where
given), reduce the sequence-parallel gradients, step the optimizer (and the MoE expert biases), log;
evaluate and save on their intervals. The end: final evaluation and checkpoint, Hugging Face
export, a greedy sample and, on rank 0, the report (see ``run_report``).
"""

from __future__ import annotations

import contextlib
import time

from mcore_api import experimental_api
from mcore_parallel import reduce_sequence_parallel_grads

from ..transformer.moe import reset_global_loads, router_loss_metrics, update_expert_biases
from .batches import TrainData, iteration_micro_batches
from .evaluator import HeldoutEvaluator
from .final_outputs import count_parameters, export_hf, greedy_sample
from .lr_schedule import LearningRateSchedule
from .model_setup import TrainModel
from .optimizer_protocol import TrainOptimizer
from .router_replay_run import RouterReplayRun
from .run_context import RunContext
from .run_logging import RunLogging
from .run_report import RunOutcome, publish_report, run_report
from .schedule import global_mean_loss, run_micro_batches
from .train_checkpoint import TrainCheckpoint


@experimental_api
class Trainer:
    """Trains ``model`` with ``optimizer`` on ``data`` under ``context``.

    The other components: ``schedule`` (the learning rate of each iteration), ``checkpoint``
    (resume, saves), ``logging`` (metrics, progress, stragglers, gradients), ``evaluator``
    (held-out loss) and, optionally, ``distillation`` (``DistillationRun``). Router replay is
    started by ``train`` itself, at the iteration it resumes from. Everything is collective:
    build and run a ``Trainer`` on every rank.
    """

    def __init__(
        self,
        context: RunContext,
        *,
        model: TrainModel,
        optimizer: TrainOptimizer,
        data: TrainData,
        schedule: LearningRateSchedule,
        checkpoint: TrainCheckpoint,
        logging: RunLogging,
        evaluator: HeldoutEvaluator,
        distillation=None,
    ):
        if not isinstance(optimizer, TrainOptimizer):
            raise TypeError(f"{type(optimizer).__name__} is not a TrainOptimizer")
        self.context, self.model, self.optimizer, self.data = context, model, optimizer, data
        self.schedule, self.checkpoint, self.logging = schedule, checkpoint, logging
        self.evaluator, self.distillation = evaluator, distillation
        self.history: dict = {"train": [], "heldout": [], "lr": []}
        self.start, self.last_saved, self.router_replay = 0, None, None

    def train(self) -> dict | None:
        """Resume, run the iterations and the run's end; the report on rank 0, else ``None``."""
        context, training = self.context, self.context.configs.training
        self._resume()
        self.model.train(True)
        distill = self.distillation
        kl_before = distill.heldout_kl(self.data.heldout) if distill is not None else None
        if training.moe_router_replay != "off":
            self.router_replay = RouterReplayRun(
                context.configs, self.model.container, context.rank, self.start + 1
            )
        began = time.perf_counter()
        for iteration in range(self.start + 1, training.train_iters + 1):
            self._iteration(iteration)
        self.logging.progress.close()
        train_seconds = time.perf_counter() - began
        return self._finish(train_seconds, kl_before)

    def _resume(self) -> None:
        """Load the latest checkpoint of ``--load`` (if any) and open the progress bar from there."""
        self.start, saved = self.checkpoint.resume()
        self.history.update(saved)
        progress = self.logging.open_progress(self.start)
        if self.context.is_writer and self.start:
            progress.write(f"resumed from {self.context.configs.checkpoint.load} at iteration {self.start}")

    def _iteration(self, iteration: int) -> None:
        """One optimizer step, its records, and evaluation and save when due."""
        timers, log = self.context.timers, self.logging.log
        timers("iteration").start()
        lr = self.schedule.apply(self.optimizer, iteration)
        with log.timed("batch"):
            batches = self._batches(iteration)
        self.optimizer.zero_grad()
        with self.logging.step():
            self.logging.begin_gradients(iteration)
            losses = self._forward_backward(iteration, batches)
            grad_norm = self._update()
        loss = global_mean_loss(losses, self.context.groups)
        seconds = timers("iteration").stop()
        self._record(iteration, loss, lr, grad_norm, seconds)
        self._evaluate_when_due(iteration)
        self._save_when_due(iteration)

    def _batches(self, iteration: int) -> list:
        """This data-parallel rank's micro-batches of ``iteration``'s global batch."""
        context, training = self.context, self.context.configs.training
        return iteration_micro_batches(
            self.data.train,
            iteration,
            training.global_batch_size,
            training.micro_batch_size,
            context.dp_rank,
            context.dp_size,
            context.device,
        )

    def _forward_backward(self, iteration: int, batches: list) -> list:
        """The micro-batches' forward and backward passes; their losses."""
        distill, replay = self.distillation, self.router_replay
        with self.logging.log.timed("forward-backward"):
            if replay is not None:
                replay.begin(iteration)
            with distill.loss.capture() if distill is not None else contextlib.nullcontext():
                kd_arguments = distill.schedule_arguments() if distill is not None else {}
                losses = run_micro_batches(
                    self.model, batches, self.context.groups, dtype=self.context.dtype, **kd_arguments
                )
            if replay is not None:
                replay.end(iteration)
        return losses

    def _update(self) -> float:
        """Reduce the sequence-parallel gradients, step; returns the gradient norm before clipping."""
        container, groups, log = self.model.container, self.context.groups, self.logging.log
        with log.timed("sequence-parallel-grads"):
            reduce_sequence_parallel_grads(container, groups.tp)  # their main_grads
        self.logging.end_gradients(self.model)
        with log.timed("optimizer"):
            grad_norm = self.optimizer.step()
            update_expert_biases(container, groups.dp_cp)  # CP ranks route other tokens
            reset_global_loads(container)
        return grad_norm

    def _record(self, iteration: int, loss: float, lr: float, grad_norm: float, seconds: float) -> None:
        """History, progress bar, metrics and the straggler check of one iteration."""
        self.history["train"].append([iteration, loss])
        self.history["lr"].append([iteration, lr])
        self.logging.progress.update(iteration, loss, seconds, lr)
        extra = router_loss_metrics(self.model.container)
        if self.distillation is not None:
            extra = extra | self.distillation.metrics(iteration)
        self.logging.log.iteration(iteration, loss, lr, grad_norm, seconds, extra)
        self.logging.check_stragglers(iteration)

    def _evaluate_when_due(self, iteration: int) -> None:
        """Held-out evaluation on the evaluation interval (the last iteration's comes at the end)."""
        training = self.context.configs.training
        interval = training.eval_interval
        if not interval or iteration % interval or iteration >= training.train_iters:
            return
        with self.logging.log.timed("evaluation"):
            result = self.evaluator()
        self.history["heldout"].append([iteration, result["loss"]])
        self.logging.progress.write(
            f"iteration {iteration}: held-out loss {result['loss']:.3f} (ppl {result['perplexity']:.1f})"
        )
        self.logging.log.heldout(iteration, result)

    def _save_when_due(self, iteration: int) -> None:
        """A checkpoint on the save interval (the last iteration's comes at the end)."""
        configs = self.context.configs
        interval = configs.checkpoint.save_interval
        if not interval or iteration % interval or iteration >= configs.training.train_iters:
            return
        with self.logging.log.timed("save"):
            self.last_saved = self.checkpoint.save(iteration, self.history)
            if self.router_replay is not None:
                self.router_replay.save(
                    configs, self.context.world, iteration
                )  # a resume records on from here

    def _finish(self, train_seconds: float, kl_before: float | None) -> dict | None:
        """The run's end: final evaluation and checkpoint, export, sample, report (rank 0)."""
        context, training = self.context, self.context.configs.training
        if self.router_replay is not None:
            self.router_replay.save(context.configs, context.world, training.train_iters)
        final = self._final_evaluation()
        kd_report = None
        if self.distillation is not None:
            kd_report = self.distillation.report(kl_before, self.distillation.heldout_kl(self.data.heldout))
        self._final_save()
        if training.export_hf:
            export_hf(context, self.model, self.data.tokenizer)
        sample = greedy_sample(context, self.model, self.data.tokenizer) if training.sample_tokens else None
        parameters = count_parameters(self.model, context.groups, training.fsdp)
        self.logging.close()
        if not context.is_writer:
            return None
        outcome = RunOutcome(
            start=self.start,
            train_seconds=train_seconds,
            final=final,
            parameters=parameters,
            last_saved=self.last_saved,
            sample=sample,
            history=self.history,
            straggler_reports=self.logging.straggler_reports,
            unigram_baseline=self.data.unigram_baseline,
            kd_report=kd_report,
        )
        report = run_report(context, outcome)
        publish_report(context, report, self.logging.wandb_run)
        return report

    def _final_evaluation(self) -> dict[str, float]:
        """The held-out result after the last iteration, recorded in the history and logged."""
        train_iters = self.context.configs.training.train_iters
        with self.logging.log.timed("evaluation"):
            final = self.evaluator()
        heldout = self.history["heldout"]
        if not heldout or heldout[-1][0] != train_iters:
            heldout.append([train_iters, final["loss"]])
        self.logging.log.heldout(train_iters, final)
        return final

    def _final_save(self) -> None:
        """The last iteration's checkpoint (unless nothing ran and one was loaded), complete."""
        train_iters = self.context.configs.training.train_iters
        if train_iters - self.start > 0 or self.last_saved is None:
            with self.logging.log.timed("save"):
                self.last_saved = self.checkpoint.save(train_iters, self.history)
        with self.logging.log.timed("save"):
            self.checkpoint.wait()  # an asynchronous save is complete and marked latest from here on
