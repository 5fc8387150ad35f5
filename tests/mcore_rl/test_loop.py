"""``GRPOLoop`` on one gloo rank with a tiny float32 GPT on the addition task: after an iteration
the engine's log-probabilities equal the trainer model's (refit), the engine's KV cache is
suspended whenever the trainer runs a forward and resumed after, a reward function that fails
costs only its rollouts, the KL reference exists only with beta > 0, and bad policies or
tokenizers are refused at start."""

import math

import torch
from mcore_inference import SamplingParams
from mcore_models import GPTModel
from mcore_parallel import destroy_model_parallel, initialize_model_parallel
from mcore_rl.agents import AdditionAgent
from mcore_rl.inference import VocabularyMismatchError
from mcore_rl.loop import CharTokenizer, GRPOLoop, GRPOLoopConfig, PolicyConfig

TINY = PolicyConfig(num_layers=1, hidden_size=32, num_attention_heads=2, ffn_hidden_size=64)
FAST = dict(
    prompts_per_iteration=4, group_size=4, max_tokens=4, lr=1e-2, lr_warmup_iterations=0, eval_prompts=8
)


def build_loop(agent=None, tokenizer=None, vocab=None, seed=0, **config):
    """A loop over a fresh tiny policy (built on the current process groups)."""
    destroy_model_parallel()
    groups = initialize_model_parallel()
    tokenizer = tokenizer or CharTokenizer()
    torch.manual_seed(seed)
    policy = GPTModel(TINY.transformer_config(), vocab or tokenizer.vocab_size, pg_collection=groups)
    agent = agent or AdditionAgent(200, 20, max_digits=2)
    return GRPOLoop(policy, agent, tokenizer, GRPOLoopConfig(**(FAST | config)), groups)


def engine_and_trainer_logprobs(loop):
    """Prompt log-probabilities of one sum under the engine and under the trainer's policy."""
    prompt = loop.tokenizer.encode("12+34=579")
    params = SamplingParams(temperature=0.0, num_tokens_to_generate=1, prompt_logprobs=True, ignore_eos=True)
    (request,) = loop.engine.generate([prompt], params)
    with torch.no_grad():
        logits = loop.policy(torch.tensor([prompt]))[0, :, : loop.policy.vocab_size].float()
    trainer = torch.log_softmax(logits[:-1], -1).gather(1, torch.tensor(prompt[1:])[:, None]).squeeze(1)
    return torch.tensor(request.prompt_logprobs[1:]), trainer


class VariedRewards(AdditionAgent):
    """Rewards the completion's length and its digits' sum: an untrained policy's samples differ
    in them, so every group has advantages to learn from."""

    def get_reward(self, example, completion_text):
        return float(len(completion_text) + sum(int(c) for c in completion_text if c.isdigit()))


def _refit_and_suspend():
    loop = build_loop(agent=VariedRewards(200, 20, max_digits=2))
    before = engine_and_trainer_logprobs(loop)[0]
    seen = []
    hook = loop.policy.register_forward_pre_hook(
        lambda *_: seen.append((loop.policy.training, loop.engine.suspended))
    )
    record = loop.step()
    hook.remove()
    after, trainer = engine_and_trainer_logprobs(loop)
    return dict(
        record=record,
        seen=seen,
        suspended_after=loop.engine.suspended,
        version=loop.engine.weight_version,
        before=before,
        after=after,
        trainer=trainer,
    )


def test_refit_inside_the_loop_and_suspend_during_training(run_distributed):
    (result,) = run_distributed(_refit_and_suspend, 1, timeout=120)
    record = result["record"]
    assert record["trained_sequences"] > 0 and record["weight_version"] == result["version"] == 1
    torch.testing.assert_close(result["after"], result["trainer"], atol=1e-5, rtol=1e-5)
    assert (result["after"] - result["before"]).abs().max() > 1e-3  # the step did change the policy
    # every trainer forward of the step (all in train mode) ran with the engine's cache freed;
    # after the step the engine is resumed
    assert result["seen"] and all(training and suspended for training, suspended in result["seen"])
    assert not result["suspended_after"]
    assert all(record[f"time_{p}"] >= 0 for p in ("generation", "reference", "training", "refit"))


class FlakyAddition(AdditionAgent):
    """Addition whose reward raises for the sums with an odd first operand, NaN for a = 10."""

    def get_reward(self, example, completion_text):
        if example.a == 10:
            return math.nan
        if example.a % 2:
            raise RuntimeError(f"grader crashed on {example.prompt}")
        return super().get_reward(example, completion_text)


def _failing_rewards():
    loop = build_loop(agent=FlakyAddition(200, 20, max_digits=2))
    return loop.step(evaluate_after=True)


def test_failed_rewards_cost_only_their_rollouts(run_distributed):
    (record,) = run_distributed(_failing_rewards, 1, timeout=120)
    assert record["failed_rollouts"] > 0
    assert "get_reward raised RuntimeError: grader crashed on" in record["first_error"]
    assert record["trained_sequences"] > 0  # the other prompts still trained
    assert record["heldout_failed"] > 0 and not math.isnan(record["heldout_reward"])


def _reference(beta):
    loop = build_loop(beta=beta)
    record = loop.step()
    initial = build_loop(beta=beta).policy  # same seed: the initial weights
    same = (
        all(torch.equal(a, b) for a, b in zip(loop.reference.parameters(), initial.parameters(), strict=True))
        if loop.reference is not None
        else None
    )
    return loop.reference is None, same, record.get("kl")


def test_reference_only_with_a_kl_coefficient(run_distributed):
    assert run_distributed(_reference, 1, 0.0, timeout=120) == [(True, None, None)]
    ((none, frozen, kl),) = run_distributed(_reference, 1, 0.1, timeout=120)
    assert not none and frozen  # the reference stays the initial policy
    assert kl is not None and kl >= 0.0  # k3 of the policy against it, before this step: ~0


def _refusals():
    errors = {}
    for name, build in {
        "vocabulary": lambda: build_loop(vocab=8),  # 13 character ids, 8 embedding rows
        "dtype": lambda: build_loop_with(lambda p: p.to(torch.bfloat16)),
        "type": lambda: build_loop_with(lambda p: torch.nn.Linear(2, 2)),
    }.items():
        try:
            build()
        except Exception as error:
            errors[name] = (type(error), str(error))
    return errors


def build_loop_with(change):
    destroy_model_parallel()
    groups = initialize_model_parallel()
    policy = change(GPTModel(TINY.transformer_config(), 13, pg_collection=groups))
    return GRPOLoop(policy, AdditionAgent(200, 20), CharTokenizer(), GRPOLoopConfig(**FAST), groups)


def test_bad_policies_and_tokenizers_are_refused_at_start(run_distributed):
    (errors,) = run_distributed(_refusals, 1, timeout=120)
    kind, message = errors["vocabulary"]
    assert issubclass(kind, VocabularyMismatchError) and "13 ids" in message and "8 embedding rows" in message
    assert errors["dtype"][0] is ValueError and "float32" in errors["dtype"][1]
    assert errors["type"][0] is TypeError and "GPTModel" in errors["type"][1]
