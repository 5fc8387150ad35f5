"""Time per GRPO iteration of mcore-rl's ``GRPOLoop`` against TRL's ``GRPOTrainer`` on the same
Hugging Face model, in the same process, and where each one's time goes.

    uv run python benchmarks/rl_step.py [--quick] [--prompts 8] [--group-size 8] [--max-tokens 32]
        [--iterations 5] [--hidden 256] [--layers 4] [--beta 0.0] [--bin-length 128]

The workload is the same on both sides:

- model: a float32 Llama-style ``GPTModel`` (RMSNorm, SwiGLU with ffn = 3 x hidden, RoPE, no
  bias, untied embeddings, heads of 64 channels; ``--hidden``, ``--layers``) over the 13 ids of
  mcore-rl's ``CharTokenizer``, exported with mcore-models' ``export_hf_checkpoint`` to a
  temporary folder that TRL loads as ``LlamaForCausalLM``; the two are checked (asserted) to give
  the same logits on one input before any timing. mcore-rl trains that ``GPTModel`` itself.
- tokenizer: TRL gets a ``PreTrainedTokenizerFast`` built locally over the same characters with
  the same ids (a BPE without merges: one token per character; ``"\\n"``, id 0, is EOS and pad).
- prompts: ``AdditionAgent``'s training sums in the order of mcore-rl's ``PromptStream`` (seed 0);
  TRL reads them unshuffled (``shuffle_dataset=False``), so iteration ``i`` sees the same
  ``--prompts`` prompts on both sides, each sampled ``--group-size`` times at temperature 1.
- rewards: ``AdditionAgent``'s (partial credit) on the completion text, on both sides.
- completion length: exactly ``--max-tokens`` tokens for every completion. ``GRPOLoop`` has no
  ``ignore_eos`` setting, so the benchmark wraps its inference handle to add
  ``ignore_eos=True`` to every ``generate`` (EOS may be sampled and generation goes on); TRL gets
  ``generation_kwargs={"min_new_tokens": max_tokens}`` (EOS is never sampled, so its completion
  mask keeps every token). Both sides' trained-token counts are checked to be
  ``prompts x group x max_tokens``.
- training: one optimizer step per iteration (TRL: ``num_iterations=1``, ``steps_per_generation=1``,
  ``gradient_accumulation_steps=1``, ``per_device_train_batch_size = prompts x group``), Adam
  (TRL: ``adamw_torch`` with weight decay 0), the same constant learning rate, gradient clipping
  at 1.0, clipped ratio 0.2 / 0.28, token-mean loss (TRL ``loss_type="dapo"``), advantages
  scaled by the group's std, ``--beta`` (default 0; above 0 both sides run a frozen reference
  model). TRL: ``use_vllm=False`` (plain ``model.generate``), ``use_cpu=True``, float32 (``bf16``
  off), gradient checkpointing off (GRPOConfig's default is on), no logging or saving.

Each side runs ``--iterations`` timed iterations after one warm-up iteration (not counted); its
figure is the median iteration time, and ``ratio`` is TRL's over mcore's (above 1: mcore-rl is
faster). mcore-rl runs first, then TRL, in one process on the same threads.

Phases (medians of each phase over the timed iterations; ``other`` is the iteration time minus
the phases):

- mcore-rl (``GRPOLoop.step`` record): ``generation`` = rollouts through the in-process
  ``DynamicInferenceEngine`` including reward scoring and the KV cache's resume/suspend;
  ``reference`` = the reference model's log-prob passes over the packed bins (0 with beta 0);
  ``training`` = zeroing the gradients, forward + GRPO loss + backward over the packed bins,
  clipping and the Adam step; ``refit`` = copying the trained weights into the engine's model
  and resuming its cache; ``other`` = advantages, packing and the record.
- TRL (timers wrapped around the trainer's methods and a ``TrainerCallback``): ``generation`` =
  ``_generate_and_score_completions`` less the log-prob passes inside it (prompt tokenisation,
  ``model.generate``, decoding, rewards, advantages); ``reference`` = the
  ``_get_per_token_logps_and_entropies`` calls inside it (the reference model with beta > 0;
  the old policy's log-probs are not computed with these settings); ``training`` = the rest of
  ``training_step`` (``compute_loss``: forward, loss, backward) and from its end to
  ``on_optimizer_step`` (gradient clipping, the optimizer step); ``refit`` = 0 (TRL generates
  with the training model itself: no weight sync without vLLM); ``other`` = learning-rate
  scheduler, ``zero_grad``, the trainer's bookkeeping and callbacks, fetching the batch. An
  iteration is the interval between consecutive ``on_step_end`` callbacks.

The figures count only when the 1-minute load average was below 0.5 at the start (printed).
Prints a readable table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

PHASES = ("generation", "reference", "training", "refit")
LOGITS_TOLERANCE = 1e-4
QUICK = dict(prompts=2, group_size=2, max_tokens=4, iterations=2, hidden=64, layers=1)


def _parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=8, help="prompts per iteration")
    parser.add_argument("--group-size", type=int, default=8, help="completions per prompt")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens of every completion")
    parser.add_argument("--iterations", type=int, default=5, help="timed iterations after one warm-up")
    parser.add_argument("--hidden", type=int, default=256, help="hidden size (heads of 64 channels)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--beta", type=float, default=0.0, help="KL coefficient (> 0: a reference model)")
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--bin-length", type=int, default=128, help="mcore-rl's packed training bin")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--quick", action="store_true", help="tiny sizes, for a smoke test")
    args = parser.parse_args(argv)
    if args.quick:
        for name, value in QUICK.items():
            setattr(args, name, value)
    return args


def load_at_start() -> tuple[str, float]:
    """``uptime``'s line (or the load averages when it is missing) and the 1-minute load."""
    one_minute = os.getloadavg()[0]
    try:
        line = subprocess.run(["uptime"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        line = "load average: " + ", ".join(f"{x:.2f}" for x in os.getloadavg())
    return line, one_minute


# -- the shared model, tokenizer and prompts ------------------------------------------------------


def build_policy(args, vocab_size: int, groups):
    """The float32 Llama-style ``GPTModel`` both sides start from."""
    from mcore_models import GPTModel
    from mcore_rl.loop import PolicyConfig

    hidden = args.hidden
    heads = max(1, hidden // 64)
    policy = PolicyConfig(
        num_layers=args.layers, hidden_size=hidden, num_attention_heads=heads, ffn_hidden_size=3 * hidden
    )
    config = policy.transformer_config()  # untied embeddings, no dropout
    torch.manual_seed(0)
    return GPTModel(config, vocab_size, pg_collection=groups, eos_token_ids=(0,), pad_token_id=0)


def check_same_logits(policy, directory: Path) -> float:
    """Load ``directory`` as ``LlamaForCausalLM`` and assert its logits equal ``policy``'s on one
    input; the largest difference."""
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    ids = torch.randint(0, policy.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = policy.eval()(ids)[..., : policy.vocab_size]
        theirs = hf(input_ids=ids).logits
    difference = float((ours - theirs).abs().max())
    assert difference < LOGITS_TOLERANCE, f"mcore and HF logits differ by {difference:.3g}"
    return difference


def hf_tokenizer(char_tokenizer, max_length: int):
    """A ``PreTrainedTokenizerFast`` with ``char_tokenizer``'s ids: one token per character (a BPE
    without merges), ``"\\n"`` (id 0) as EOS and pad."""
    import tokenizers
    from transformers import PreTrainedTokenizerFast

    end = char_tokenizer.decode([char_tokenizer.eod_id])
    vocab = {char_tokenizer.decode([i]): i for i in range(char_tokenizer.vocab_size)}
    backend = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=vocab, merges=[]))
    backend.decoder = tokenizers.decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token=end, pad_token=end, model_max_length=max_length
    )
    text = "12+345=" + end
    assert tokenizer(text)["input_ids"] == char_tokenizer.encode(text), "tokenizers disagree"
    return tokenizer


def addition_agent():
    from mcore_rl.agents.addition import AdditionAgent

    return AdditionAgent(3000, 200, min_digits=1, max_digits=2, seed=0, partial_credit=True)


# -- mcore-rl --------------------------------------------------------------------------------------


class IgnoreEOSHandle:
    """An inference handle that passes ``ignore_eos=True`` with every ``generate`` (``GRPOLoop``
    has no setting for it): every completion runs to ``max_tokens``."""

    def __init__(self, handle):
        self.handle = handle

    @property
    def tokenizer(self):
        return self.handle.tokenizer

    def generate(self, prompts, **sampling):
        return self.handle.generate(prompts, **sampling, ignore_eos=True)


def run_mcore(args, policy, agent, tokenizer, groups, prompts: list[str]) -> list[dict[str, float]]:
    """``GRPOLoop`` iterations (the warm-up first): per iteration its wall time and phases. The
    engine's context (``max_sequence_length``, which sizes its KV cache) holds the longest of
    ``prompts`` and ``max_tokens``, as TRL's generation cache holds them."""
    from mcore_rl.loop import GRPOLoop, GRPOLoopConfig

    config = GRPOLoopConfig(
        iterations=args.iterations + 1,
        prompts_per_iteration=args.prompts,
        group_size=args.group_size,
        max_tokens=args.max_tokens,
        temperature=1.0,
        lr=args.lr,
        lr_warmup_iterations=0,
        clip_grad=1.0,
        beta=args.beta,
        clip_low=0.2,
        clip_high=0.28,
        aggregation="token_mean",
        scale_rewards="group",
        bin_length=args.bin_length,
        max_sequence_length=min(
            args.bin_length, max(map(len, map(tokenizer.encode, prompts))) + args.max_tokens
        ),
        seed=0,
    )
    loop = GRPOLoop(policy, agent, tokenizer, config, groups)
    loop.handle = IgnoreEOSHandle(loop.handle)
    expected_tokens = args.prompts * args.group_size * args.max_tokens
    iterations = []
    for _ in range(args.iterations + 1):
        began = time.perf_counter()
        record = loop.step()
        total = time.perf_counter() - began
        assert record["trained_tokens"] == expected_tokens, (record["trained_tokens"], expected_tokens)
        assert record["optimizer_steps"] == 1 and record["failed_rollouts"] == 0, record
        iterations.append({"total": total, **{phase: record[f"time_{phase}"] for phase in PHASES}})
    return iterations


# -- TRL ---------------------------------------------------------------------------------------------


def _trl_timer(trainer, expected_tokens: int):
    """Wrap ``trainer``'s methods with timers; returns the callback that collects the iterations
    (see the module docstring for what each phase covers)."""
    from transformers import TrainerCallback

    class IterationTimer(TrainerCallback):
        def __init__(self):
            self.iterations: list[dict[str, float]] = []
            self.phases = dict.fromkeys(PHASES, 0.0)
            self.last = self.step_done = None
            self.in_generation = False

        def on_train_begin(self, args, state, control, **kwargs):
            self.last = time.perf_counter()

        def on_optimizer_step(self, args, state, control, **kwargs):
            self.phases["training"] += time.perf_counter() - self.step_done

        def on_step_end(self, args, state, control, **kwargs):
            now = time.perf_counter()
            self.iterations.append({"total": now - self.last, **self.phases})
            self.last, self.phases = now, dict.fromkeys(PHASES, 0.0)

    timer = IterationTimer()
    generate_and_score = trainer._generate_and_score_completions
    logps = trainer._get_per_token_logps_and_entropies
    training_step = trainer.training_step

    def timed_generate_and_score(*args, **kwargs):
        began, reference_before = time.perf_counter(), timer.phases["reference"]
        timer.in_generation = True
        try:
            output = generate_and_score(*args, **kwargs)
        finally:
            timer.in_generation = False
        inner = timer.phases["reference"] - reference_before
        timer.phases["generation"] += time.perf_counter() - began - inner
        tokens = int(output["completion_mask"].sum())
        assert tokens == expected_tokens, (tokens, expected_tokens)
        return output

    def timed_logps(*args, **kwargs):
        if not timer.in_generation:  # the policy's pass inside compute_loss: training
            return logps(*args, **kwargs)
        began = time.perf_counter()
        output = logps(*args, **kwargs)
        timer.phases["reference"] += time.perf_counter() - began
        return output

    def timed_training_step(*args, **kwargs):
        began = time.perf_counter()
        before = timer.phases["generation"] + timer.phases["reference"]
        output = training_step(*args, **kwargs)
        timer.step_done = time.perf_counter()
        inner = timer.phases["generation"] + timer.phases["reference"] - before
        timer.phases["training"] += timer.step_done - began - inner
        return output

    trainer._generate_and_score_completions = timed_generate_and_score
    trainer._get_per_token_logps_and_entropies = timed_logps
    trainer.training_step = timed_training_step
    trainer.add_callback(timer)
    return timer


def run_trl(args, directory: Path, agent, tokenizer, prompts: list[str], output_dir: Path):
    """``GRPOTrainer`` on ``directory``'s model: per iteration its wall time and phases."""
    from datasets import Dataset
    from mcore_rl.agents.addition import AdditionExample
    from transformers import LlamaForCausalLM, PrinterCallback
    from trl import GRPOConfig, GRPOTrainer

    def addition_reward(prompts, completions, **kwargs):
        rewards = []
        for prompt, completion in zip(prompts, completions, strict=True):
            a, b = prompt.rstrip("=").split("+")
            rewards.append(agent.get_reward(AdditionExample(int(a), int(b)), completion))
        return rewards

    config = GRPOConfig(
        output_dir=str(output_dir),
        use_cpu=True,
        bf16=False,
        fp16=False,
        activation_checkpointing=False,  # GRPOConfig's default is on
        max_steps=args.iterations + 1,
        per_device_train_batch_size=args.prompts * args.group_size,
        gradient_accumulation_steps=1,
        steps_per_generation=1,
        num_iterations=1,
        num_generations=args.group_size,
        max_completion_length=args.max_tokens,
        generation_kwargs={"min_new_tokens": args.max_tokens},
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        use_vllm=False,
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        optim="adamw_torch",
        weight_decay=0.0,
        adam_beta1=0.9,
        adam_beta2=0.999,
        adam_epsilon=1e-8,
        max_grad_norm=1.0,
        beta=args.beta,
        epsilon=0.2,
        epsilon_high=0.28,
        loss_type="dapo",
        scale_rewards="group",
        shuffle_dataset=False,
        seed=0,
        report_to="none",
        logging_strategy="no",
        save_strategy="no",
        disable_tqdm=True,
        log_completions=False,
        dataloader_num_workers=0,
    )
    model = LlamaForCausalLM.from_pretrained(directory, dtype=torch.float32)
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=addition_reward,
        args=config,
        train_dataset=Dataset.from_dict({"prompt": prompts}),
        processing_class=tokenizer,
    )
    assert not (config.gradient_checkpointing or config.bf16 or trainer.use_vllm)
    trainer.remove_callback(PrinterCallback)  # its end-of-training metrics line
    timer = _trl_timer(trainer, args.prompts * args.group_size * args.max_tokens)
    torch.set_num_threads(args.threads)  # as mcore ran
    trainer.train()
    assert len(timer.iterations) == args.iterations + 1, len(timer.iterations)
    return timer.iterations


# -- the report ------------------------------------------------------------------------------------


def summarize(iterations: list[dict[str, float]]) -> dict[str, float]:
    """Medians over the timed iterations (the warm-up, the first, left out), ``other`` included."""
    timed = iterations[1:]
    summary = {key: statistics.median(it[key] for it in timed) for key in ("total", *PHASES)}
    summary["other"] = statistics.median(it["total"] - sum(it[p] for p in PHASES) for it in timed)
    return summary


def print_table(mcore: dict[str, float], trl: dict[str, float], ratio: float) -> None:
    columns = ("total", *PHASES, "other")
    print(f"{'side':<22}" + "".join(f"{name + ' [ms]':>17}" for name in columns))
    for name, summary in (("mcore-rl GRPOLoop", mcore), ("TRL GRPOTrainer", trl)):
        print(f"{name:<22}" + "".join(f"{1e3 * summary[c]:>17.1f}" for c in columns))
    print(f"ratio TRL / mcore-rl (per iteration, > 1: mcore-rl faster): {ratio:.2f}x")
    print(
        "mcore-rl phases: generation = engine rollouts + rewards; reference = reference log-probs; "
        "training = forward/backward over packed bins + clip + Adam; refit = weights into the engine; "
        "other = advantages, packing, record"
    )
    print(
        "TRL phases: generation = _generate_and_score_completions (tokenise, model.generate, decode, "
        "rewards, advantages) less its log-prob passes; reference = _get_per_token_logps_and_entropies "
        "inside it (reference model, beta > 0); training = compute_loss forward/backward + clip + "
        "optimizer step; refit = none (no weight sync without vLLM); other = scheduler, zero_grad, "
        "trainer bookkeeping"
    )


def main(argv=None) -> None:
    args = _parse_args(argv)
    uptime, one_minute = load_at_start()
    print(f"uptime at start: {uptime}")
    idle = one_minute < 0.5
    if not idle:
        print(f"1-minute load {one_minute:.2f} >= 0.5: the machine was busy, the figures are provisional")
    torch.set_num_threads(args.threads)
    from mcore_models import export_hf_checkpoint
    from mcore_parallel import destroy_model_parallel, initialize_model_parallel
    from mcore_rl.loop import CharTokenizer
    from mcore_rl.loop.prompts import PromptStream
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
    hf_logging.disable_progress_bar()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    groups = initialize_model_parallel()
    char_tokenizer, agent = CharTokenizer(), addition_agent()
    prompts = [
        t.agent.get_prompt(t.example)
        for t in PromptStream(agent, 0).take(args.prompts * (args.iterations + 1))
    ]
    with tempfile.TemporaryDirectory(prefix="rl-step-") as scratch:
        directory = Path(scratch) / "model"
        policy = build_policy(args, char_tokenizer.vocab_size, groups)
        export_hf_checkpoint(policy, directory, "llama")
        logits_difference = check_same_logits(policy, directory)
        tokenizer = hf_tokenizer(char_tokenizer, policy.config.max_position_embeddings)
        mcore_iterations = run_mcore(args, policy, agent, char_tokenizer, groups, prompts)
        trl_iterations = run_trl(args, directory, agent, tokenizer, prompts, Path(scratch) / "trl")
    destroy_model_parallel()
    dist.destroy_process_group()

    mcore, trl = summarize(mcore_iterations), summarize(trl_iterations)
    ratio = trl["total"] / mcore["total"]
    print(
        f"model: Llama, {args.layers} layers, hidden {args.hidden}, {max(1, args.hidden // 64)} heads, "
        f"ffn {3 * args.hidden}, vocab {char_tokenizer.vocab_size}, float32 "
        f"(max |logits difference| mcore vs HF {logits_difference:.2g}); "
        f"{args.prompts} prompts x {args.group_size} completions x {args.max_tokens} tokens, "
        f"beta {args.beta}, {args.threads} threads; median of {args.iterations} iterations after 1 warm-up"
    )
    print_table(mcore, trl, ratio)
    result = {
        "benchmark": "rl_step",
        "uptime": uptime,
        "load_1min": one_minute,
        "idle": idle,
        "layers": args.layers,
        "hidden": args.hidden,
        "prompts": args.prompts,
        "group_size": args.group_size,
        "max_tokens": args.max_tokens,
        "iterations": args.iterations,
        "beta": args.beta,
        "lr": args.lr,
        "bin_length": args.bin_length,
        "threads": args.threads,
        "logits_max_difference": logits_difference,
        "mcore_s": mcore,
        "trl_s": trl,
        "ratio": ratio,
        "mcore_iterations_s": mcore_iterations,
        "trl_iterations_s": trl_iterations,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
