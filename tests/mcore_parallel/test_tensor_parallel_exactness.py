"""Tensor (and sequence) parallel model == the same model on one process, outputs and every gradient.

The model: vocab-parallel embedding, two pre-norm attention + MLP blocks, a column-parallel output
layer and vocab-parallel cross entropy with label smoothing. Every rank builds the single-process
reference from the same seed, copies its slices of the master weights into the parallel model, and
compares its own shards. Tolerance (fp32): rtol 1e-5, atol 1e-6 elementwise, and each gradient's
relative Frobenius error within ``expected_error_bound(float32, depth=4)`` (~3.8e-6; measured up to
~5e-7); only the summation order differs between the two.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from mcore_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    check_gradient,
    reduce_sequence_parallel_grads,
    vocab_parallel_cross_entropy,
)
from torch import nn

SEQ, BATCH, HIDDEN, HEADS, FFN, VOCAB, LAYERS = 8, 2, 16, 4, 32, 32, 2
LABEL_SMOOTHING = 0.1
RTOL, ATOL = 1e-5, 1e-6


def attention(qkv: torch.Tensor, heads: int) -> torch.Tensor:
    """Bidirectional attention over ``[s, b, heads * 3 * d]`` laid out head by head as (q, k, v)."""
    s, b, _ = qkv.shape
    q, k, v = qkv.view(s, b, heads, 3, -1).permute(3, 1, 2, 0, 4)  # each [b, heads, s, d]
    weights = torch.softmax(q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5, dim=-1)
    return (weights @ v).permute(2, 0, 1, 3).reshape(s, b, -1)


class ReferenceBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(HIDDEN), nn.LayerNorm(HIDDEN)
        self.qkv, self.proj = nn.Linear(HIDDEN, 3 * HIDDEN), nn.Linear(HIDDEN, HIDDEN)
        self.fc1, self.fc2 = nn.Linear(HIDDEN, FFN), nn.Linear(FFN, HIDDEN)
        for linear in (self.qkv, self.proj, self.fc1, self.fc2):
            nn.init.normal_(linear.bias, std=0.1)  # non-zero biases, so their gradients are tested too

    def forward(self, x):
        x = x + self.proj(attention(self.qkv(self.ln1(x)), HEADS))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class ReferenceModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, HIDDEN)
        self.blocks = nn.ModuleList(ReferenceBlock() for _ in range(LAYERS))
        self.final_ln = nn.LayerNorm(HIDDEN)
        self.output = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, ids, target):
        x = self.embedding(ids)
        for block in self.blocks:
            x = block(x)
        logits = self.output(self.final_ln(x))
        return F.cross_entropy(logits.flatten(0, 1), target.flatten(), label_smoothing=LABEL_SMOOTHING)


class ParallelBlock(nn.Module):
    def __init__(self, group, sp):
        super().__init__()
        self.heads = HEADS // dist.get_world_size(group)
        self.ln1, self.ln2 = nn.LayerNorm(HIDDEN), nn.LayerNorm(HIDDEN)
        self.qkv = ColumnParallelLinear(HIDDEN, 3 * HIDDEN, tp_group=group, sequence_parallel=sp)
        self.proj = RowParallelLinear(HIDDEN, HIDDEN, tp_group=group, sequence_parallel=sp)
        self.fc1 = ColumnParallelLinear(HIDDEN, FFN, tp_group=group, sequence_parallel=sp)
        self.fc2 = RowParallelLinear(FFN, HIDDEN, tp_group=group, sequence_parallel=sp)
        for p in [*self.ln1.parameters(), *self.ln2.parameters()]:
            p.sequence_parallel = sp

    def forward(self, x):
        x = x + self.proj(attention(self.qkv(self.ln1(x))[0], self.heads))[0]
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))[0]))[0]


class ParallelModel(nn.Module):
    def __init__(self, group, sp):
        super().__init__()
        self.group = group
        self.embedding = VocabParallelEmbedding(VOCAB, HIDDEN, tp_group=group, reduce_scatter_embeddings=sp)
        self.blocks = nn.ModuleList(ParallelBlock(group, sp) for _ in range(LAYERS))
        self.final_ln = nn.LayerNorm(HIDDEN)
        for p in self.final_ln.parameters():
            p.sequence_parallel = sp
        self.output = ColumnParallelLinear(HIDDEN, VOCAB, tp_group=group, bias=False, sequence_parallel=sp)

    def forward(self, ids, target):
        x = self.embedding(ids)
        for block in self.blocks:
            x = block(x)
        logits, _ = self.output(self.final_ln(x))
        losses = vocab_parallel_cross_entropy(logits, target, self.group, label_smoothing=LABEL_SMOOTHING)
        return losses.mean()


def assert_close(actual, expected, name):
    """Elementwise ``|a - e| <= ATOL + RTOL * |e|`` (torch.testing.assert_close would import sympy in every rank)."""
    assert actual.shape == expected.shape, f"{name}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    excess = (actual - expected).abs() - (ATOL + RTOL * expected.abs())
    assert excess.max() <= 0, f"{name}: max abs error {(actual - expected).abs().max():.3e} exceeds tolerance"


def _shard(tensor, parallel_param, rank, tp):
    """The slice of a reference tensor that ``parallel_param`` holds on ``rank``."""
    if not getattr(parallel_param, "tensor_model_parallel", False):
        return tensor
    return tensor.chunk(tp, dim=parallel_param.partition_dim)[rank]


def _compare_with_reference(sp):
    group, rank, tp = dist.group.WORLD, dist.get_rank(), dist.get_world_size()
    torch.manual_seed(1234)
    reference = ReferenceModel()
    ids = torch.randint(0, VOCAB, (SEQ, BATCH))
    target = torch.randint(0, VOCAB, (SEQ, BATCH))

    parallel = ParallelModel(group, sp)
    reference_params = dict(reference.named_parameters())
    with torch.no_grad():
        for name, param in parallel.named_parameters():
            param.copy_(_shard(reference_params[name], param, rank, tp))

    reference_loss = reference(ids, target)
    reference_loss.backward()
    loss = parallel(ids, target)
    loss.backward()
    reduce_sequence_parallel_grads(parallel, group)

    assert_close(loss, reference_loss.detach(), "loss")
    for name, param in parallel.named_parameters():
        expected = _shard(reference_params[name].grad, param, rank, tp)
        assert_close(param.grad, expected, f"gradient of {name}")
        check = check_gradient(param.grad, expected, depth=LAYERS + 2)  # embedding, blocks, output
        assert check.ok, f"gradient of {name}: relative error {check.error:.2e} > bound {check.bound:.2e}"
    return loss.item()


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp+sp"])
@pytest.mark.parametrize("tp", [2, 4])
def test_parallel_model_matches_single_process(run_distributed, tp, sequence_parallel):
    losses = run_distributed(_compare_with_reference, tp, sequence_parallel)
    assert len(set(losses)) == 1  # every rank computed the same loss
