"""Sequence packing without a model: the layout of the bins against hand-written tensors, its
invariants on random rollouts, the unpack round trip, label log-probs against log_softmax, the packed
loss against ``grpo_loss`` of the unpacked rows, and every bad input."""

import math

import pytest
import torch
import torch.distributed as dist
from mcore_rl import (
    GRPOLossConfig,
    TrainingSequence,
    grpo_loss,
    label_logprobs,
    pack_sequences,
    packed_grpo_loss,
    unpack_completions,
)


def _sequence(prompt, completion, advantage=1.0, ref=False, seed=0):
    generator = torch.Generator().manual_seed(seed)
    logprobs = -torch.rand(len(completion), generator=generator)
    ref_logprobs = -torch.rand(len(completion), generator=generator) if ref else None
    return TrainingSequence(prompt, completion, logprobs, advantage, ref_logprobs)


def _random_sequences(count, seed, max_prompt=5, max_completion=6, vocab=50, ref=False):
    generator = torch.Generator().manual_seed(seed)

    def ids(low, high):
        length = int(torch.randint(low, high + 1, (), generator=generator))
        return torch.randint(0, vocab, (length,), generator=generator).tolist()

    return [
        _sequence(
            ids(1, max_prompt), ids(1, max_completion), float(torch.randn((), generator=generator)), ref, i
        )
        for i in range(count)
    ]


def test_hand_packed_layout():
    sequences = [
        TrainingSequence([1, 2], [3, 4, 5], [-0.1, -0.2, -0.3], 1.0),  # 5 tokens
        TrainingSequence([6], [7], [-0.5], -1.0),  # 2 tokens
        TrainingSequence([8, 9, 10], [11, 12], [-1.0, -2.0], 0.5),  # 5 tokens
    ]
    batch = pack_sequences(sequences, 8, pad_token_id=99)
    first, second = batch.bins
    assert (batch.num_sequences, batch.num_tokens) == (3, 6)
    assert first.tokens.tolist() == [[1, 2, 3, 4, 5, 6, 7, 99]]
    assert first.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1, 0]]
    assert first.packed_seq_params.cu_seqlens.tolist() == [0, 5, 7, 8]
    assert first.labels.tolist() == [[2, 3, 4, 5, -100, 7, -100, -100]]
    assert first.loss_mask.tolist() == [[False, True, True, True, False, True, False, False]]
    assert first.advantages.tolist() == [[0.0, 1.0, 1.0, 1.0, 0.0, -1.0, 0.0, 0.0]]
    torch.testing.assert_close(first.sampling_logprobs, torch.tensor([[0, -0.1, -0.2, -0.3, 0, -0.5, 0, 0]]))
    assert first.sequence_index.tolist() == [[0, 0, 0, 0, 0, 1, 1, -1]]
    assert first.ref_logprobs is None
    assert second.tokens.tolist() == [[8, 9, 10, 11, 12, 99, 99, 99]]
    assert second.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1, 2]]
    assert second.packed_seq_params.cu_seqlens.tolist() == [0, 5, 8]
    assert second.loss_mask.tolist() == [[False, False, True, True, False, False, False, False]]
    assert (first.num_sequences, second.num_sequences) == (2, 1)


def test_first_fit_decreasing_fills_bins():
    # Totals 2, 5, 3, 4, 2 into bins of 8: first-fit-decreasing places 5, 4, 3, 2, 2 and needs two
    # bins, {5, 3} and {4, 2, 2}; first fit in arrival order would need three.
    sequences = [_sequence([1], [2] * (total - 1), seed=i) for i, total in enumerate([2, 5, 3, 4, 2])]
    batch = pack_sequences(sequences, 8)
    members = [sorted(set(b.sequence_index[0].tolist()) - {-1}) for b in batch.bins]
    assert members == [[1, 2], [0, 3, 4]]
    assert [b.padding for b in batch.bins] == [0, 0]


@pytest.mark.parametrize("data_parallel_size", [1, 3])
def test_random_packing_invariants(data_parallel_size):
    sequences = _random_sequences(23, seed=1, ref=True)
    batch = pack_sequences(sequences, 12, data_parallel_size=data_parallel_size)
    again = pack_sequences(sequences, 12, data_parallel_size=data_parallel_size)
    assert len(batch.bins) % data_parallel_size == 0
    seen = {}
    for packed, same in zip(batch.bins, again.bins, strict=True):
        for name in ("tokens", "position_ids", "labels", "loss_mask", "advantages", "sequence_index"):
            assert torch.equal(getattr(packed, name), getattr(same, name)), name  # deterministic
        bounds = packed.packed_seq_params.cu_seqlens
        assert bounds.dtype == torch.int32 and bounds[0] == 0 and bounds[-1] == 12
        assert torch.equal(packed.position_ids, packed.packed_seq_params.position_ids(12))
        owners = packed.sequence_index[0]
        for start, end in zip(bounds[:-1].tolist(), bounds[1:].tolist(), strict=True):
            assert len(set(owners[start:end].tolist())) == 1  # a segment is one sequence (or padding)
            index = int(owners[start])
            if index < 0:
                assert not packed.loss_mask[0, start:end].any()
                continue
            assert index not in seen
            seen[index] = packed.tokens[0, start:end].tolist()
            sequence = sequences[index]
            prompt = len(sequence.prompt_ids)
            mask = packed.loss_mask[0, start:end]
            assert mask.nonzero().squeeze(1).tolist() == list(range(prompt - 1, end - start - 1))
            assert packed.labels[0, start:end][mask].tolist() == list(sequence.completion_ids)
            assert packed.labels[0, end - 1] == -100
            assert torch.all(packed.advantages[0, start:end][mask] == sequence.advantage)
            torch.testing.assert_close(packed.ref_logprobs[0, start:end][mask], sequence.ref_logprobs)
    assert seen == {i: list(s.prompt_ids) + list(s.completion_ids) for i, s in enumerate(sequences)}
    assert batch.num_tokens == sum(len(s.completion_ids) for s in sequences)
    ranks = [batch.data_parallel_bins(rank) for rank in range(data_parallel_size)]
    assert sorted(id(b) for bins in ranks for b in bins) == sorted(id(b) for b in batch.bins)


def test_padding_bins_for_data_parallel():
    batch = pack_sequences(
        _random_sequences(3, seed=2, max_prompt=2, max_completion=2), 16, data_parallel_size=4
    )
    assert len(batch.bins) == 4
    assert [b.num_sequences for b in batch.bins] == [3, 0, 0, 0]
    for empty in batch.bins[1:]:
        assert not empty.loss_mask.any() and (empty.sequence_index == -1).all()
        assert empty.packed_seq_params.cu_seqlens.tolist() == [0, 16]
    assert batch.data_parallel_bins(1) == (batch.bins[1],)


def test_unpack_round_trip_is_differentiable():
    sequences = _random_sequences(9, seed=3)
    batch = pack_sequences(sequences, 10, data_parallel_size=2)
    values = [b.sampling_logprobs.clone().requires_grad_() for b in batch.bins]
    unpacked = unpack_completions(values, batch.bins)
    assert list(unpacked) == list(range(9))
    for index, sequence in enumerate(sequences):
        torch.testing.assert_close(unpacked[index], sequence.sampling_logprobs, rtol=0, atol=0)
    sum(v.sum() * (i + 1) for i, v in unpacked.items()).backward()
    for value, packed in zip(values, batch.bins, strict=True):
        expected = torch.where(packed.loss_mask, packed.sequence_index + 1.0, 0.0)
        torch.testing.assert_close(value.grad, expected)


def test_label_logprobs_equal_log_softmax():
    logits = torch.randn(2, 5, 11, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    labels = torch.randint(0, 11, (2, 5), generator=torch.Generator().manual_seed(1))
    labels[1, 3] = -100
    for temperature in (1.0, 0.7):
        expected = torch.log_softmax(logits / temperature, -1).gather(-1, labels.clamp(min=0)[..., None])[
            ..., 0
        ]
        expected[1, 3] = 0.0
        got = label_logprobs(logits, labels, temperature=temperature)
        torch.testing.assert_close(got, expected.float(), rtol=1e-6, atol=1e-6)


def _vocab_parallel_logprobs(logits, labels):
    """On this rank: the label log-probs and logits' gradient from this rank's vocabulary half."""
    shard = logits.chunk(2, dim=-1)[dist.get_rank()].clone().requires_grad_()
    logp = label_logprobs(shard, labels, dist.group.WORLD, temperature=0.8)
    (logp * torch.arange(1.0, 1.0 + logp.numel()).view(logp.shape)).sum().backward()
    return logp.detach(), shard.grad


def test_label_logprobs_vocab_parallel_equal_log_softmax(run_distributed):
    logits = torch.randn(2, 5, 12, generator=torch.Generator().manual_seed(2)).requires_grad_()
    labels = torch.randint(0, 12, (2, 5), generator=torch.Generator().manual_seed(3))
    labels[0, 4] = -100
    expected = label_logprobs(logits, labels, temperature=0.8)
    (expected * torch.arange(1.0, 11.0).view(2, 5)).sum().backward()
    for rank, (logp, grad) in enumerate(
        run_distributed(_vocab_parallel_logprobs, 2, logits.detach(), labels)
    ):
        torch.testing.assert_close(logp, expected.detach(), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(grad, logits.grad.chunk(2, dim=-1)[rank], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("stacked", [False, True], ids=["one_bin_a_call", "stacked_per_rank"])
@pytest.mark.parametrize("aggregation", ["token_mean", "sequence_mean"])
def test_packed_loss_equals_grpo_loss_of_the_rows(aggregation, stacked):
    # The oracle: grpo_loss on one row per completion, with the same per-token values. Stacked:
    # each data-parallel rank's bins in one call, their tensors as rows.
    sequences = _random_sequences(11, seed=4, ref=True)
    batch = pack_sequences(sequences, 9, data_parallel_size=2)
    config = GRPOLossConfig(
        aggregation=aggregation, beta=0.05, clip_high=0.28, tis_cap=1.5, entropy_coef=0.01
    )
    generator = torch.Generator().manual_seed(5)
    logp = [(-torch.rand(b.tokens.shape, generator=generator)).requires_grad_() for b in batch.bins]
    old = [-torch.rand(b.tokens.shape, generator=generator) for b in batch.bins]
    entropy = [torch.rand(b.tokens.shape, generator=generator) for b in batch.bins]
    calls = [[i] for i in range(len(batch.bins))]
    if stacked:
        calls = [list(range(len(batch.bins)))[rank::2] for rank in range(2)]
    total = sum(
        packed_grpo_loss(
            torch.cat([logp[i] for i in call]),
            [batch.bins[i] for i in call] if stacked else batch.bins[call[0]],
            config,
            num_sequences=batch.num_sequences,
            num_tokens=batch.num_tokens,
            old_logp=torch.cat([old[i] for i in call]),
            entropy=torch.cat([entropy[i] for i in call]),
        ).loss
        for call in calls
    )
    total.backward()

    def rows(values):
        unpacked = unpack_completions(values, batch.bins)
        return torch.nn.utils.rnn.pad_sequence(list(unpacked.values()), batch_first=True)

    row_logp = rows([v.detach() for v in logp]).requires_grad_()
    lengths = torch.tensor([len(s.completion_ids) for s in sequences])
    expected = grpo_loss(
        row_logp,
        torch.tensor([s.advantage for s in sequences]),
        torch.arange(row_logp.shape[1]) < lengths[:, None],
        config,
        old_logp=rows(old),
        ref_logp=torch.nn.utils.rnn.pad_sequence([s.ref_logprobs for s in sequences], batch_first=True),
        entropy=rows(entropy),
        inference_logp=torch.nn.utils.rnn.pad_sequence(
            [s.sampling_logprobs for s in sequences], batch_first=True
        ),
    ).loss
    expected.backward()
    torch.testing.assert_close(total, expected, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(rows([v.grad for v in logp]), row_logp.grad, rtol=1e-6, atol=1e-8)


def test_empty_bin_loss_is_zero_and_connected():
    batch = pack_sequences(_random_sequences(1, seed=6), 8, data_parallel_size=2)
    logp = torch.zeros(1, 8, requires_grad=True)
    result = packed_grpo_loss(logp, batch.bins[1], num_sequences=1, num_tokens=batch.num_tokens)
    result.loss.backward()
    assert result.loss.item() == 0.0 and result.metrics == {}
    assert torch.equal(logp.grad, torch.zeros(1, 8))


def _bad(**fields):
    base = dict(prompt_ids=[1, 2], completion_ids=[3, 4], sampling_logprobs=[-0.1, -0.2], advantage=1.0)
    return TrainingSequence(**(base | fields))


@pytest.mark.parametrize(
    ("sequence", "error", "message"),
    [
        (
            _bad(completion_ids=[3, 4, 5, 6, 7, 8, 9], sampling_logprobs=[-0.1] * 7),
            ValueError,
            r"sequences\[1\]: 2 prompt \+ 7 completion tokens do not fit in bin_length 8",
        ),
        (
            _bad(sampling_logprobs=[-0.1]),
            ValueError,
            r"sequences\[1\]\.sampling_logprobs: must hold one value per completion token \(2\), got 1",
        ),
        (
            _bad(ref_logprobs=[-0.1, -0.2, -0.3]),
            ValueError,
            r"sequences\[1\]\.ref_logprobs: must hold one value",
        ),
        (
            _bad(completion_ids=[], sampling_logprobs=[]),
            ValueError,
            r"sequences\[1\]\.completion_ids: must not be empty",
        ),
        (_bad(prompt_ids=[]), ValueError, r"sequences\[1\]\.prompt_ids: must not be empty"),
        (
            _bad(advantage=math.nan),
            ValueError,
            r"sequences\[1\]\.advantage: must be a finite number, got nan",
        ),
        (
            _bad(advantage=math.inf),
            ValueError,
            r"sequences\[1\]\.advantage: must be a finite number, got inf",
        ),
        (
            _bad(sampling_logprobs=[-0.1, math.nan]),
            ValueError,
            r"sequences\[1\]\.sampling_logprobs: must be finite",
        ),
        (
            _bad(sampling_logprobs=[-0.1, 0.5]),
            ValueError,
            r"sequences\[1\]\.sampling_logprobs: log-probs must be <= 0",
        ),
        (_bad(prompt_ids=[1.5, 2.0]), TypeError, r"sequences\[1\]\.prompt_ids: must hold integer token ids"),
        (_bad(completion_ids=[3, -4]), ValueError, r"sequences\[1\]\.completion_ids: token ids must be >= 0"),
        (_bad(prompt_ids="12"), TypeError, r"sequences\[1\]\.prompt_ids: must be a sequence or a 1-D tensor"),
        (
            _bad(prompt_ids=torch.ones(1, 2, dtype=torch.long)),
            ValueError,
            r"sequences\[1\]\.prompt_ids: must be 1-D",
        ),
        ("not a rollout", TypeError, r"sequences\[1\]: must be a TrainingSequence, got str"),
    ],
)
def test_bad_sequence_is_named(sequence, error, message):
    with pytest.raises(error, match=message):
        pack_sequences([_bad(), sequence], 8)


@pytest.mark.parametrize(
    ("arguments", "error", "message"),
    [
        (dict(bin_length=1), ValueError, r"bin_length: must be >= 2, got 1"),
        (dict(bin_length=8.0), TypeError, r"bin_length: must be an int >= 2"),
        (dict(data_parallel_size=0), ValueError, r"data_parallel_size: must be >= 1, got 0"),
        (dict(pad_token_id=-1), ValueError, r"pad_token_id: must be >= 0, got -1"),
        (dict(sequences=[]), ValueError, r"sequences: must not be empty"),
        (dict(sequences=_bad()), TypeError, r"sequences: must be a list or tuple of TrainingSequence"),
        (
            dict(sequences=[_bad(ref_logprobs=[-1.0, -1.0]), _bad()]),
            ValueError,
            r"sequences\[1\]\.ref_logprobs: given for some sequences, so needed for all",
        ),
    ],
)
def test_bad_packing_arguments_are_named(arguments, error, message):
    with pytest.raises(error, match=message):
        pack_sequences(**(dict(sequences=[_bad()], bin_length=8) | arguments))


def test_bad_loss_and_logprob_arguments_are_named():
    batch = pack_sequences([_bad()], 8)
    (packed,) = batch.bins
    (short,) = pack_sequences([_bad()], 6).bins
    logp = torch.zeros(1, 8)
    counts = dict(num_sequences=1, num_tokens=2)
    cases = [
        (
            lambda: packed_grpo_loss(torch.zeros(1, 7), packed, **counts),
            ValueError,
            r"logp: must be the bins' \[k, L\] = \(1, 8\)",
        ),
        (
            lambda: packed_grpo_loss(logp, packed, old_logp=torch.zeros(8), **counts),
            ValueError,
            "old_logp: must be",
        ),
        (lambda: packed_grpo_loss(logp, "bin", **counts), TypeError, "packed_bin: must be a PackedBin"),
        (lambda: packed_grpo_loss(logp, [], **counts), TypeError, "packed_bin: must be a PackedBin"),
        (lambda: packed_grpo_loss(logp, [packed, "bin"], **counts), TypeError, r"packed_bin\[1\]: must be"),
        (
            lambda: packed_grpo_loss(torch.zeros(2, 8), [packed, short], **counts),
            ValueError,
            r"packed_bin\[1\]: \(1, 6\) tokens, but packed_bin\[0\] has \(1, 8\)",
        ),
        (
            lambda: packed_grpo_loss(torch.zeros(2, 8), [packed, packed], num_sequences=2, num_tokens=4),
            ValueError,
            "packed_bin: the bins hold one sequence index twice",
        ),
        (
            lambda: packed_grpo_loss(logp, [packed, packed], num_sequences=2, num_tokens=4),
            ValueError,
            r"logp: must be the bins' \[k, L\] = \(2, 8\)",
        ),
        (
            lambda: packed_grpo_loss(logp, packed, {"beta": 0.1}, **counts),
            TypeError,
            "config: must be a GRPOLossConfig",
        ),
        (
            lambda: packed_grpo_loss(logp, packed, num_sequences=1, num_tokens=1),
            ValueError,
            r"num_tokens: must be >= this bin's 2",
        ),
        (
            lambda: packed_grpo_loss(logp, packed, num_sequences=0, num_tokens=2),
            ValueError,
            "num_sequences: must be >=",
        ),
        (
            lambda: packed_grpo_loss(logp, packed, num_sequences=1.0, num_tokens=2),
            TypeError,
            "num_sequences: must be an int",
        ),
        (
            lambda: packed_grpo_loss(logp, packed, GRPOLossConfig(tis_cap=2.0), **counts),
            ValueError,
            "old_logp: required when config.tis_cap is set",
        ),
        (
            lambda: packed_grpo_loss(logp, packed, GRPOLossConfig(beta=0.1), **counts),
            ValueError,
            "ref_logp: required when config.beta > 0",
        ),
        (
            lambda: unpack_completions([logp, logp], batch.bins),
            ValueError,
            r"values: must hold one tensor per bin \(1\)",
        ),
        (
            lambda: unpack_completions([torch.zeros(8)], batch.bins),
            ValueError,
            r"values\[0\]: must be a tensor of the bin's shape",
        ),
        (
            lambda: label_logprobs(torch.zeros(1, 8), packed.labels),
            ValueError,
            r"logits: must be \[b, s, vocab\]",
        ),
        (
            lambda: label_logprobs(torch.zeros(1, 8, 4), packed.labels.float()),
            TypeError,
            "labels: must be a long tensor",
        ),
        (
            lambda: label_logprobs(torch.zeros(1, 7, 4), packed.labels),
            ValueError,
            "labels: must have the shape",
        ),
        (
            lambda: label_logprobs(torch.zeros(1, 8, 4), packed.labels, temperature=0.0),
            ValueError,
            "temperature: must be a finite number > 0",
        ),
        (lambda: batch.data_parallel_bins(1), ValueError, r"rank: must be an int in \[0, 1\)"),
    ]
    for call, error, message in cases:
        with pytest.raises(error, match=message):
            call()
