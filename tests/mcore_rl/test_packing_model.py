"""Packed GRPO with a tiny random-weight mcore GPT model: the loss and every parameter gradient
from packed bins equal those of the unpacked batch (one sequence per row, right-padded), for
token-mean and sequence-mean, on one process, with tensor parallelism 2 and with pipeline
parallelism 2 (gloo). The oracle is built without the packing code. float32."""

import math

import pytest
import torch
import torch.distributed as dist
from mcore_models import GPTModel
from mcore_parallel import destroy_model_parallel, forward_backward_pipelining, initialize_model_parallel
from mcore_rl import (
    GRPOLossConfig,
    TrainingSequence,
    grpo_loss,
    label_logprobs,
    pack_sequences,
    packed_grpo_loss,
)
from mcore_testing.tiny_llama import tiny_llama_config

VOCAB = 64
BIN_LENGTH = 16
TOLERANCE = dict(rtol=1e-5, atol=1e-6)


def _sequences(count=7, seed=0):
    """Random rollouts whose sampling log-probs lie near a random model's (about -log VOCAB), so the
    ratio is clipped on some tokens and not on others."""
    generator = torch.Generator().manual_seed(seed)

    def ids(low, high):
        length = int(torch.randint(low, high + 1, (), generator=generator))
        return torch.randint(0, VOCAB, (length,), generator=generator)

    sequences = []
    for _ in range(count):
        prompt, completion = ids(1, 6), ids(1, 7)
        near = -math.log(VOCAB) + 0.15 * torch.randn(len(completion), generator=generator)
        ref = -math.log(VOCAB) + 0.15 * torch.randn(len(completion), generator=generator)
        advantage = float(torch.randn((), generator=generator))
        sequences.append(TrainingSequence(prompt, completion, near, advantage, ref))
    return sequences


def _unpacked(sequences):
    """One sequence per row, right-padded: tokens, labels, completion mask, advantages, sampling and
    reference log-probs aligned with the positions that predict completion tokens."""
    width = max(len(s.prompt_ids) + len(s.completion_ids) for s in sequences)
    rows = len(sequences)
    tokens = torch.zeros(rows, width, dtype=torch.long)
    labels = torch.full((rows, width), -100, dtype=torch.long)
    mask = torch.zeros(rows, width, dtype=torch.bool)
    sampling, ref = torch.zeros(rows, width), torch.zeros(rows, width)
    for row, s in enumerate(sequences):
        full = torch.cat([s.prompt_ids, s.completion_ids])
        tokens[row, : len(full)] = full
        labels[row, : len(full) - 1] = full[1:]
        first, last = len(s.prompt_ids) - 1, len(full) - 1
        mask[row, first:last] = True
        sampling[row, first:last] = s.sampling_logprobs
        ref[row, first:last] = s.ref_logprobs
    advantages = torch.tensor([s.advantage for s in sequences])
    return dict(tokens=tokens, labels=labels, mask=mask, advantages=advantages, sampling=sampling, ref=ref)


def _reference_loss(model, logits, batch, config):
    logp = label_logprobs(logits, batch["labels"], model.tp_group)
    return grpo_loss(
        logp, batch["advantages"], batch["mask"], config, old_logp=batch["sampling"], ref_logp=batch["ref"]
    )


def _packed_forward(model, packed, input_tensor=None):
    if input_tensor is not None:
        model.set_input_tensor(input_tensor)
    return model(packed.tokens, position_ids=packed.position_ids, packed_seq_params=packed.packed_seq_params)


def _grads(model):
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return grads


def _packed_equals_unpacked(sequences, aggregation, tensor_parallel):
    """On this rank: loss and gradients of the packed bins (each its own backward, as micro-batches)
    and of the unpacked batch, with the same model."""
    destroy_model_parallel()
    groups = initialize_model_parallel(tensor_model_parallel_size=tensor_parallel)
    torch.manual_seed(0)
    model = GPTModel(
        tiny_llama_config(tensor_model_parallel_size=tensor_parallel), VOCAB, pg_collection=groups
    )
    config = GRPOLossConfig(aggregation=aggregation, clip_high=0.28, beta=0.04)
    # As many bins as sequences: the padding bins (no sequence) of a data-parallel split ride along.
    batch = pack_sequences(sequences, BIN_LENGTH, data_parallel_size=len(sequences))
    packed_loss = torch.zeros(())
    for packed in batch.bins:
        logp = label_logprobs(_packed_forward(model, packed), packed.labels, model.tp_group)
        share = packed_grpo_loss(
            logp, packed, config, num_sequences=batch.num_sequences, num_tokens=batch.num_tokens
        ).loss
        share.backward()
        packed_loss += share.detach()
    packed_grads = _grads(model)
    unpacked = _unpacked(sequences)
    reference = _reference_loss(model, model(unpacked["tokens"]), unpacked, config)
    reference.loss.backward()
    clipped = reference.metrics["clip_fraction_low"] + reference.metrics["clip_fraction_high"]
    return dict(
        bins=len(batch.bins),
        empty_bins=sum(b.num_sequences == 0 for b in batch.bins),
        clipped=clipped.item(),
        losses=(packed_loss, reference.loss.detach()),
        grads=(packed_grads, _grads(model)),
    )


def _assert_equal(result):
    torch.testing.assert_close(*result["losses"], **TOLERANCE)
    packed, unpacked = result["grads"]
    assert packed.keys() == unpacked.keys()
    for name, grad in unpacked.items():
        assert grad.abs().max() > 0, name
        torch.testing.assert_close(packed[name], grad, **TOLERANCE, msg=name)


@pytest.mark.parametrize("aggregation", ["token_mean", "sequence_mean"])
def test_packed_equals_unpacked_one_process(aggregation, run_distributed):
    sequences = _sequences()
    (result,) = run_distributed(_packed_equals_unpacked, 1, sequences, aggregation, 1, timeout=60)
    assert result["bins"] == len(sequences) and result["empty_bins"] > 0  # packing did pack
    assert 0.0 < result["clipped"] < 1.0  # both branches of the clipped objective are exercised
    _assert_equal(result)


@pytest.mark.parametrize("aggregation", ["token_mean", "sequence_mean"])
def test_packed_equals_unpacked_tensor_parallel(aggregation, run_distributed):
    sequences = _sequences(seed=1)
    for result in run_distributed(_packed_equals_unpacked, 2, sequences, aggregation, 2, timeout=60):
        _assert_equal(result)


def _pipeline(sequences, aggregation):
    """Packed bins as the micro-batches of 1F1B over two stages, against the unpacked batch as one
    micro-batch through the same schedule and stages."""
    destroy_model_parallel()
    groups = initialize_model_parallel(pipeline_model_parallel_size=2)
    stage = dist.get_rank(groups.pp)
    torch.manual_seed(0)
    model = GPTModel(
        tiny_llama_config(), VOCAB, pre_process=stage == 0, post_process=stage == 1, pg_collection=groups
    )
    config = GRPOLossConfig(aggregation=aggregation, clip_high=0.28, beta=0.04)
    batch = pack_sequences(sequences, BIN_LENGTH, data_parallel_size=len(sequences))

    def packed_step(iterator, chunk, input_tensor):
        packed = next(iterator)
        output = _packed_forward(chunk, packed, input_tensor)
        if not chunk.post_process:
            return output
        logp = label_logprobs(output, packed.labels, chunk.tp_group)
        share = packed_grpo_loss(
            logp, packed, config, num_sequences=batch.num_sequences, num_tokens=batch.num_tokens
        )
        return share.loss * len(batch.bins)  # the schedule averages the micro-batches' losses

    def unpacked_step(iterator, chunk, input_tensor):
        unpacked = next(iterator)
        if input_tensor is not None:
            chunk.set_input_tensor(input_tensor)
        output = chunk(unpacked["tokens"])
        return _reference_loss(chunk, output, unpacked, config).loss if chunk.post_process else output

    runs = {}
    for name, step, micro_batches in (
        ("packed", packed_step, list(batch.bins)),
        ("unpacked", unpacked_step, [_unpacked(sequences)]),
    ):
        losses = forward_backward_pipelining(
            forward_step_func=step,
            data_iterator=iter(micro_batches),
            model=model,
            num_microbatches=len(micro_batches),
            pp_group=groups.pp,
        )
        runs[name] = (sum(losses) / len(micro_batches) if losses else torch.zeros(()), _grads(model))
    return dict(
        losses=(runs["packed"][0], runs["unpacked"][0]),
        grads=(runs["packed"][1], runs["unpacked"][1]),
    )


@pytest.mark.parametrize("aggregation", ["token_mean", "sequence_mean"])
def test_packed_equals_unpacked_pipeline_parallel(aggregation, run_distributed):
    sequences = _sequences(seed=2)
    for result in run_distributed(_pipeline, 2, sequences, aggregation, timeout=90):
        _assert_equal(result)
