"""A paged KV cache of one layer and steps of chunks laid out over it, for the tests of the
engine's attention paths, and their naive oracle: per query, in float32, ``softmax(q k^T * scale +
mask) v`` over the request's cached keys, with windows, sinks and GQA."""

import itertools

import torch
from mcore_inference import DynamicInferenceContext, Request, SamplingParams, ScheduledChunk

GROUPS, DIM, BLOCK = 2, 8, 4
SCALE = 0.35
_ids = itertools.count()


def paged_context(dtype=torch.float32, device="cpu"):
    """A one-layer context of 40 blocks of ``BLOCK`` tokens, its cache filled with random values."""
    per_block = 2 * BLOCK * GROUPS * DIM * torch.empty((), dtype=dtype).element_size()
    context = DynamicInferenceContext(
        num_layers=1,
        num_kv_heads=GROUPS,
        head_dim=DIM,
        block_size=BLOCK,
        dtype=dtype,
        kv_cache_memory=40 * per_block,
        max_requests=16,
        max_tokens=256,
        device=device,
    )
    filled = torch.randn(context.kv_cache.shape, generator=torch.Generator().manual_seed(1))
    context.kv_cache.copy_(filled)
    return context


def step_chunks(context, spans):
    """One chunk per ``(start, length)``: a request of ``start + length`` tokens on shuffled blocks."""
    free = torch.randperm(context.num_blocks, generator=torch.Generator().manual_seed(2)).tolist()
    chunks = []
    for start, length in spans:
        request = Request(next(_ids), list(range(start + length)), SamplingParams())
        request.block_ids = [free.pop() for _ in range(context.blocks_needed(start + length))]
        chunks.append(ScheduledChunk(request, start, length))
    return chunks


def attention_oracle(context, chunks, query, scale, window, sinks):
    """Each query alone, in float32 on the CPU, over its request's keys read slot by slot from the cache."""
    keys, values = context.kv_cache[0, 0].float().cpu(), context.kv_cache[0, 1].float().cpu()
    query, sinks = query.cpu(), None if sinks is None else sinks.cpu()
    heads = query.shape[1]
    per_group = heads // GROUPS
    rows = []
    for chunk in chunks:
        blocks = chunk.request.block_ids
        for position in range(chunk.start, chunk.end):
            slots = torch.tensor([blocks[j // BLOCK] * BLOCK + j % BLOCK for j in range(position + 1)])
            distance = position - torch.arange(position + 1)
            allowed = distance < (window if window is not None else 1 << 30)
            q = query[len(rows)].float()
            out = []
            for head in range(heads):
                k, v = keys[slots, head // per_group], values[slots, head // per_group]
                scores = (k @ q[head]) * scale
                scores = scores.masked_fill(~allowed, float("-inf"))
                if sinks is not None:
                    scores = torch.cat((scores, sinks[head].view(1)))
                probs = torch.softmax(scores, 0)[: position + 1]
                out.append(probs @ v)
            rows.append(torch.cat(out))
    return torch.stack(rows)


def attend_one_layer(context, query, window, sinks):
    """``context.attend`` of the step laid out, with new keys and values drawn from a fixed seed."""
    tokens = query.shape[0]
    gen = torch.Generator().manual_seed(3)
    key = torch.randn(tokens, GROUPS, DIM, generator=gen).to(query.device, context.dtype)
    value = torch.randn(tokens, GROUPS, DIM, generator=gen).to(query.device, context.dtype)
    return context.attend(1, query, key, value, scale=SCALE, window_size=window, sink_logits=sinks)


STEP_SPANS = {
    "decode": [(0, 1), (4, 1), (16, 1), (32, 1), (6, 1)],
    "decode-equal": [(9, 1), (9, 1), (9, 1)],
    "prefill": [(0, 7)],
    "prefill-prefix": [(9, 6)],
    "prefill-aligned-prefix": [(16, 5)],
    "mixed": [(13, 1), (0, 11), (2, 1), (20, 9), (7, 1), (5, 4)],
}
