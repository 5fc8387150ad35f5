"""``GRPOLoopConfig.minibatches``: an iteration's rollouts split into consecutive shares of whole
prompt groups, one optimizer step each, the later steps off-policy; each share's packed bins
stacked ``bins_per_forward`` to a forward. Oracle: the same rollouts
trained by hand on a plain copy of the policy, each share unpacked (one forward per sequence),
``grpo_loss`` against the rollouts' sampling log-probs, ``torch.optim.Adam`` and
``clip_grad_norm_``."""

import sys
from pathlib import Path

import torch
from mcore_models import GPTModel
from mcore_rl import grpo_loss
from mcore_rl.loop.batch import rollout_batch

sys.path.insert(0, str(Path(__file__).parent))
from test_loop import TINY, VariedRewards, build_loop


def _completion_logprobs(model, sequence):
    ids = torch.tensor([[*sequence.prompt_ids, *sequence.completion_ids]])
    logp = torch.log_softmax(model(ids)[0, :-1, : model.vocab_size].float(), -1)
    logp = logp.gather(1, ids[0, 1:, None])[:, 0]
    return logp[len(sequence.prompt_ids) - 1 :]


def _padded(rows):
    out = torch.zeros(len(rows), max(len(r) for r in rows))
    mask = torch.zeros(out.shape, dtype=torch.bool)
    for i, row in enumerate(rows):
        out[i, : len(row)], mask[i, : len(row)] = row, True
    return out, mask


def _hand_steps(model, sequences, shares, loop):
    optimizer = torch.optim.Adam(model.parameters(), lr=loop.config.lr, eps=1e-8)
    start = 0
    for share in shares:
        members, start = sequences[start : start + share], start + share
        logp, mask = _padded([_completion_logprobs(model, s) for s in members])
        old, _ = _padded([torch.tensor(s.sampling_logprobs) for s in members])
        advantages = torch.tensor([s.advantage for s in members])
        optimizer.zero_grad()
        grpo_loss(logp, advantages, mask, loop.loss_config, old_logp=old).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), loop.config.clip_grad)
        optimizer.step()


def _two_minibatches():
    loop = build_loop(
        agent=VariedRewards(200, 20, max_digits=2),
        minibatches=2,
        clip_grad=0.5,
        bin_length=32,  # several bins per mini-batch, stacked two per forward
        max_sequence_length=32,
        bins_per_forward=2,
    )
    model = GPTModel(TINY.transformer_config(), loop.policy.vocab_size, pg_collection=loop.groups)
    model.load_state_dict(loop.policy.state_dict())
    captured, rollouts = [], loop._rollouts
    loop._rollouts = lambda tasks, iteration: captured.extend(rollouts(tasks, iteration)) or captured
    record = loop.step()
    batch = rollout_batch(captured, loop.loss_config)
    assert batch.group_sizes == [4, 4, 4, 4]  # VariedRewards: every group has a spread
    _hand_steps(model.train(), batch.sequences, [8, 8], loop)
    return record, dict(loop.policy.named_parameters()), dict(model.named_parameters())


def test_each_minibatch_is_one_adam_step_on_its_share(run_distributed):
    ((record, loop_weights, hand_weights),) = run_distributed(_two_minibatches, 1, timeout=120)
    assert record["optimizer_steps"] == 2 and record["trained_sequences"] == 16
    for name, value in hand_weights.items():
        torch.testing.assert_close(loop_weights[name], value, rtol=2e-4, atol=2e-5, msg=name)
