"""Train a Hugging Face ``transformers`` Llama (random weights, tiny config) with mcore-fsdp in a
plain PyTorch loop; no other mcore package is involved.

    torchrun --nproc-per-node 2 packages/mcore-fsdp/examples/train_hf_llama.py

Runs on CPU (gloo) or on GPUs (NCCL), whichever the machine has.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from mcore_fsdp import MixedPrecision, fully_shard
from transformers import LlamaConfig, LlamaForCausalLM

CONFIG = dict(
    vocab_size=128,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    tie_word_embeddings=True,
)


def build_model(seed: int = 0) -> LlamaForCausalLM:
    """The tiny Llama with random weights drawn from ``seed`` (the same on every rank)."""
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**CONFIG, attn_implementation="eager"))


def token_batch(step: int, batch_size: int, seq_len: int = 16) -> torch.Tensor:
    """The global batch of random token ids for ``step``."""
    generator = torch.Generator().manual_seed(step)
    return torch.randint(0, CONFIG["vocab_size"], (batch_size, seq_len), generator=generator)


def train(steps: int = 3, per_rank_batch: int = 2, precision: MixedPrecision | None = None):
    """Shard the model over all ranks and train; return the sharded model and per-step losses."""
    rank, world = dist.get_rank(), dist.get_world_size()
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if dist.get_backend() == "nccl"
        else torch.device("cpu")
    )
    model = build_model()
    for layer in model.model.layers:  # each decoder layer a unit, then the root (FSDP2's idiom)
        fully_shard(layer, precision=precision)
    fully_shard(model, precision=precision)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for step in range(steps):
        tokens = token_batch(step, per_rank_batch * world).chunk(world)[rank].to(device)
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        model.clip_grad_norm_(1.0)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return model, losses


def main() -> None:
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(backend)
    model, losses = train(steps=10)
    if dist.get_rank() == 0:
        print("losses:", " ".join(f"{loss:.4f}" for loss in losses))
    exported = model.full_state_dict()  # plain tensors, loadable into LlamaForCausalLM
    if dist.get_rank() == 0:
        print(f"exported {len(exported)} tensors")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
