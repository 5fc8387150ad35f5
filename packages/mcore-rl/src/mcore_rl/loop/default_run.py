"""The embedded default run of ``mcore-rl``: a small GPT learns addition by a short supervised run,
then GRPO iterations on the task's rewards; outputs in ``RunConfig.output_dir``."""

from __future__ import annotations

import random
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from mcore_api import experimental_api
from mcore_models import GPTModel
from mcore_parallel import destroy_model_parallel, initialize_model_parallel
from tqdm import tqdm

from ..agents.addition import AdditionAgent
from .checkpoint import load_checkpoint, save_checkpoint
from .config import RLConfigs
from .grpo_loop import GRPOLoop
from .report import run_report, summary_text, write_report, write_reward_plot
from .tokenizer import CharTokenizer
from .warmup import supervised_warmup


@contextmanager
def single_process_group() -> Iterator[None]:
    """A one-rank gloo process group unless one exists (then that one, left as it is)."""
    if dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def addition_agent(configs: RLConfigs) -> AdditionAgent:
    """The task's ``AdditionAgent``."""
    task = configs.task
    return AdditionAgent(
        task.num_train,
        task.num_test,
        num_warmup=task.num_warmup,
        min_digits=task.min_digits,
        max_digits=task.max_digits,
        seed=task.task_seed,
        partial_credit=task.partial_credit,
    )


def _progress(total: int, initial: int, enabled: bool, desc: str) -> tqdm:
    return tqdm(
        total=total, initial=initial, desc=desc, file=sys.stdout, disable=not enabled, dynamic_ncols=True
    )


def _warm_up(
    policy: GPTModel, agent: AdditionAgent, tokenizer: CharTokenizer, configs: RLConfigs
) -> list[float]:
    steps = configs.warmup.sft_steps
    with _progress(steps, 0, configs.run.progress and steps > 0, "supervised warm-up") as bar:

        def on_step(step: int, loss: float) -> None:
            bar.set_postfix_str(f"loss {loss:.3f}", refresh=False)
            bar.update(1)

        return supervised_warmup(
            policy,
            agent,
            tokenizer,
            configs.warmup,
            seed=configs.grpo.seed,
            on_step=on_step,
            split="warmup" if configs.task.num_warmup else "train",
        )


def _train(loop: GRPOLoop, configs: RLConfigs, output: Path) -> None:
    grpo, run = configs.grpo, configs.run
    with _progress(grpo.iterations, loop.iteration, run.progress, "GRPO") as bar:
        for iteration in range(loop.iteration + 1, grpo.iterations + 1):
            due = bool(grpo.eval_interval) and iteration % grpo.eval_interval == 0
            record = loop.step(evaluate_after=due or iteration == grpo.iterations)
            text = f"train reward {record['train_reward']:.3f}"
            if "heldout_reward" in record:
                text += f" held-out {record['heldout_reward']:.3f}"
            bar.set_postfix_str(text, refresh=False)
            bar.update(1)
            if record["failed_rollouts"]:
                bar.write(
                    f"iteration {iteration}: {record['failed_rollouts']} rollouts failed: {record['first_error']}"
                )
            if run.save_interval and iteration % run.save_interval == 0:
                save_checkpoint(loop, output / "checkpoint")


@experimental_api
def run_default(configs: RLConfigs | None = None) -> dict[str, Any]:
    """Run the embedded default (``configs``: ``RLConfigs()`` when ``None``): the supervised
    warm-up (skipped when resuming from ``run.load``), held-out evaluation, GRPO iterations,
    a checkpoint; writes ``reward.png`` and ``report.json`` to ``run.output_dir``, prints the
    summary and returns the report."""
    configs = RLConfigs() if configs is None else configs
    output = Path(configs.run.output_dir)
    output.mkdir(parents=True, exist_ok=True)
    random.seed(configs.grpo.seed)
    with single_process_group():
        groups = initialize_model_parallel()
        try:
            loop, warmup_losses = _build_loop(configs, groups)
            _train(loop, configs, output)
            after = loop.history[-1] if loop.history else {}
            after = {
                k[len("heldout_") :]: v for k, v in after.items() if k.startswith("heldout_")
            } or loop.evaluate()
            save_checkpoint(loop, output / "checkpoint")
        finally:
            destroy_model_parallel()
    report = run_report(loop.history, loop.baseline, after, {"warmup_losses": warmup_losses})
    write_reward_plot(output / "reward.png", loop.history, loop.baseline)
    write_report(output / "report.json", report)
    if configs.run.progress:
        print(summary_text(report))
        print(f"output: {output} (reward.png, report.json, checkpoint/)")
    return report


def _build_loop(configs: RLConfigs, groups) -> tuple[GRPOLoop, list[float]]:
    """The loop of a fresh run (after the warm-up; its losses) or of a resumed one (none)."""
    tokenizer, agent = CharTokenizer(), addition_agent(configs)
    torch.manual_seed(configs.policy.model_seed)
    policy = GPTModel(configs.policy.transformer_config(), tokenizer.vocab_size, pg_collection=groups)
    losses = [] if configs.run.load else _warm_up(policy, agent, tokenizer, configs)
    policy.eval()
    loop = GRPOLoop(policy, agent, tokenizer, configs.grpo, groups)
    if configs.run.load:
        load_checkpoint(loop, configs.run.load)
    else:
        loop.baseline = loop.evaluate()
    return loop, losses
