"""The batched sampler against plain per-row references: filters, greedy rows, seeded draws that
do not depend on the batch, draw frequencies, log-probabilities only where asked, and a number of
tensor ops that does not grow with the batch."""

import math

import pytest
import torch
from mcore_inference import SamplingParams, filter_logits, sample
from mcore_inference.sampler import seeded_uniform
from torch.utils._python_dispatch import TorchDispatchMode


def reference_kept(logits, params):
    """The token ids one row keeps, written plainly: temperature, then top-k, top-p, min-p."""
    scaled = [x / params.temperature for x in logits.tolist()]
    order = sorted(range(len(scaled)), key=lambda t: -scaled[t])
    if params.top_k:
        order = order[: params.top_k]
    weights = [math.exp(scaled[t] - scaled[order[0]]) for t in order]
    probs = [w / sum(weights) for w in weights]
    kept, mass = [], 0.0
    for t, p in zip(order, probs, strict=True):
        if params.top_p < 1 and mass >= params.top_p:
            break
        if p >= params.min_p * probs[0]:
            kept.append(t)
        mass += p
    return sorted(kept)


def test_hand_computed_filters():
    # softmax([2, 1, 0, -1]) = [0.6439, 0.2369, 0.0871, 0.0321]
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]] * 5)
    params = [
        SamplingParams(top_k=3),  # drops token 3
        SamplingParams(top_p=0.85),  # 0.64 + 0.24 = 0.88 >= 0.85: tokens 0, 1
        SamplingParams(min_p=0.1),  # 0.0871 / 0.6439 = 0.135 >= 0.1, 0.0321 / 0.6439 = 0.05 < 0.1
        SamplingParams(temperature=0.5, min_p=0.1),  # softmax([4, 2, 0, -2]): 0.135 >= 0.1 > 0.018
        SamplingParams(top_k=3, top_p=0.95, min_p=0.2),  # top-3 renormalised: [0.665, 0.245, 0.090]
    ]
    kept = torch.isfinite(filter_logits(logits, params)).tolist()
    assert [[t for t in range(4) if row[t]] for row in kept] == [[0, 1, 2], [0, 1], [0, 1, 2], [0, 1], [0, 1]]
    for row, p in zip(logits, params, strict=True):
        assert reference_kept(row, p) == [t for t in range(4) if kept[params.index(p)][t]]


def test_filters_match_the_per_row_reference_in_one_mixed_batch():
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(40, 30, generator=generator) * 2
    params = []
    for i in range(40):
        params.append(
            SamplingParams(
                temperature=[0.3, 1.0, 1.7][i % 3],
                top_k=[0, 1, 5, 29][i % 4],
                top_p=[1.0, 0.5, 0.9, 0.2, 0.99][i % 5],
                min_p=[0.0, 0.05, 0.3][i % 3 if i % 2 else 0],
            )
        )
    filtered = filter_logits(logits, params)
    for i, p in enumerate(params):
        kept = torch.isfinite(filtered[i]).nonzero().squeeze(1).tolist()
        assert kept == reference_kept(logits[i], p), (i, p)
        torch.testing.assert_close(filtered[i, kept], logits[i, kept] / p.temperature)


def test_greedy_rows_are_the_argmax_and_mixed_rows_keep_their_own_filters():
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(4))
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(top_k=1, temperature=3.0),  # one token left: the argmax
        SamplingParams(temperature=0.0, seed=9),  # a seed does not change a greedy row
        SamplingParams(top_p=1e-6),  # only the most likely token
        SamplingParams(min_p=1.0),  # only the most likely token
        SamplingParams(temperature=2.0, seed=1),
    ]
    out = sample(logits, params, torch.Generator().manual_seed(0))
    assert out.tokens[:5] == logits[:5].argmax(-1).tolist()
    assert 0 <= out.tokens[5] < 50


def test_a_seeded_row_draws_the_same_whatever_its_batch():
    generator = torch.Generator().manual_seed(5)
    row = torch.randn(64, generator=generator)
    params = SamplingParams(temperature=1.5, top_p=0.95, seed=77)
    history = [3, 1, 4]  # its draw depends on how many tokens it generated, not on its neighbours
    alone = sample(row.unsqueeze(0), [params], torch.Generator(), output_tokens=[history]).tokens[0]
    for size, where in [(2, 0), (7, 3), (33, 32)]:
        others = torch.randn(size, 64, generator=generator)
        others[where] = row
        batch = [SamplingParams(temperature=0.8, seed=i, top_k=i % 5) for i in range(size)]
        batch[where] = params
        histories = [[0] * (i % 4) for i in range(size)]
        histories[where] = history
        out = sample(others, batch, torch.Generator().manual_seed(size), output_tokens=histories)
        assert out.tokens[where] == alone
    draws = {
        sample(row.unsqueeze(0), [params], output_tokens=[[0] * n]).tokens[0] for n in range(30)
    }  # the next positions draw afresh
    assert len(draws) > 3


def test_seeded_uniforms_are_a_function_of_seed_and_position():
    pairs = [(0, 0), (1, 0), (2**62 + 5, 7), (0, 1), (2**63 - 1, 2**31)]
    u = [seeded_uniform(seed, position) for seed, position in pairs]
    assert all(isinstance(x, float) and 0 <= x < 1 for x in u)
    # the numbers of the tensor-op hash of mcore-inference 0.3.9: seeded draws keep their tokens
    pinned = ["0x1.180d2b94280d9p-1", "0x1.579f7984054c8p-1", "0x1.cb178e8575c95p-1"]
    pinned += ["0x1.9ad808d843db4p-1", "0x1.1d661c10d8d50p-1"]
    assert u == [float.fromhex(h) for h in pinned]
    assert len(set(u)) == 5
    assert seeded_uniform(2**62 + 5, 7) == u[2]  # again, from the cached seed state
    many = torch.tensor([seeded_uniform(i % 50, i // 50) for i in range(20000)])  # 50 seeds, 400 steps
    histogram = torch.histc(many.float(), bins=10, min=0, max=1)
    assert float(((histogram - 2000) ** 2 / 2000).sum()) < 27.9  # chi-square, 9 dof, p = 0.001


# chi-square critical values at p = 0.001 by degrees of freedom
CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52}


def _chi_square(tokens, expected):
    counts = torch.bincount(torch.tensor(tokens), minlength=len(expected)).double()
    expected = torch.tensor(expected, dtype=torch.float64) * len(tokens)
    assert bool((counts[expected == 0] == 0).all()), "a filtered-out token was drawn"
    support = expected > 0
    statistic = ((counts[support] - expected[support]) ** 2 / expected[support]).sum()
    return float(statistic), int(support.sum()) - 1


@pytest.mark.parametrize(
    "params, expected",
    [
        (SamplingParams(), [0.5, 0.3, 0.15, 0.05]),
        (SamplingParams(top_k=3), [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0.0]),
        (SamplingParams(top_p=0.7), [0.5 / 0.8, 0.3 / 0.8, 0.0, 0.0]),
        (SamplingParams(min_p=0.25), [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0.0]),
        (SamplingParams(temperature=0.5), [25 / 36.5, 9 / 36.5, 2.25 / 36.5, 0.25 / 36.5]),
    ],
    ids=["plain", "top_k", "top_p", "min_p", "temperature"],
)
def test_draw_frequencies_follow_the_filtered_softmax(params, expected):
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05])).expand(6000, 4)
    unseeded = sample(logits, [params] * 6000, torch.Generator().manual_seed(0)).tokens  # one batched draw
    statistic, dof = _chi_square(unseeded, expected)
    assert statistic < CHI2_999[dof]
    seeded = [SamplingParams(**{**params.__dict__, "seed": s}) for s in range(6000)]  # the hash's draws
    statistic, dof = _chi_square(sample(logits, seeded).tokens, expected)
    assert statistic < CHI2_999[dof]


def test_log_probabilities_only_for_the_rows_that_ask(monkeypatch):
    logits = torch.randn(5, 40, generator=torch.Generator().manual_seed(6))
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.0, logprobs=True),
        SamplingParams(temperature=0.9, seed=3),
        SamplingParams(temperature=0.9, seed=4, top_n_logprobs=4),
        SamplingParams(temperature=0.9, top_k=3, logprobs=True, top_n_logprobs=2),
    ]
    shapes = []
    log_softmax = torch.log_softmax
    monkeypatch.setattr(
        torch, "log_softmax", lambda x, *a, **k: shapes.append(x.shape) or log_softmax(x, *a, **k)
    )
    out = sample(logits, params, torch.Generator().manual_seed(1))
    assert shapes == [torch.Size([3, 40])]
    reference = log_softmax(logits, dim=-1)
    for i in (1, 3, 4):
        assert out.logprobs[i] == pytest.approx(float(reference[i, out.tokens[i]]), abs=1e-6)
    assert all(math.isnan(out.logprobs[i]) for i in (0, 2))
    assert out.top_logprobs[0] == out.top_logprobs[1] == out.top_logprobs[2] == {}
    for i, n in ((3, 4), (4, 2)):
        top = reference[i].topk(n)
        assert out.top_logprobs[i] == pytest.approx(
            dict(zip(top.indices.tolist(), top.values.tolist(), strict=True))
        )
    shapes.clear()
    sample(logits, [SamplingParams(temperature=0.0)] * 5)
    assert shapes == []


class CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def _mixed_batch(rows):
    kinds = [
        SamplingParams(temperature=0.0, logprobs=True),
        SamplingParams(temperature=0.8, seed=1, top_p=0.9, top_n_logprobs=2),
        SamplingParams(temperature=1.2, top_k=5, min_p=0.05, frequency_penalty=0.5),
        SamplingParams(temperature=0.7, presence_penalty=-0.3, repetition_penalty=1.2),
    ]
    params = [kinds[i % 4] for i in range(rows)]
    outputs = [list(range(i % 7)) for i in range(rows)]
    prompts = [[5, 6, 7]] * rows
    return params, outputs, prompts


def test_tensor_ops_do_not_grow_with_the_batch():
    counts = []
    for rows in (8, 64):
        logits = torch.randn(rows, 100, generator=torch.Generator().manual_seed(rows))
        params, outputs, prompts = _mixed_batch(rows)
        with CountOps() as ops:
            sample(logits, params, torch.Generator(), prompt_tokens=prompts, output_tokens=outputs)
        counts.append(ops.count)
    assert counts[0] == counts[1]


@pytest.mark.parametrize("width", [1, 127, 128, 300, 32000, 32003])
def test_blocked_argmax_equals_torch_argmax(width):
    """The greedy rows' two-pass argmax gives ``torch.argmax``'s index: first of ties (also
    across blocks and in the short tail block), first NaN, rows of ``-inf``."""
    from mcore_inference.sampler import _argmax_rows

    generator = torch.Generator().manual_seed(width)
    values = torch.randint(-3, 4, (12, width), generator=generator).float()  # many ties
    values[1] = float("-inf")
    values[2, width // 2 :] = 9.0  # the maximum first in a later block, again in every block after it
    values[3, -1] = 9.0  # the maximum in the tail block
    values[4, width // 3] = float("nan")
    values[5, [width // 4, width - 1]] = float("nan")
    values[6] = torch.randn(width, generator=generator)
    expected = values.argmax(dim=-1)
    assert torch.equal(_argmax_rows(values), expected)
    assert torch.equal(_argmax_rows(values.bfloat16()), values.bfloat16().argmax(dim=-1))
