"""The engine serves an HF model imported at a TP size that neither its vocabulary nor its KV heads
split over: greedy tokens at TP=2 equal TP=1's and Hugging Face ``generate``'s."""

import pytest
import torch
from mcore_inference import RequestStatus, SamplingParams

GREEDY = SamplingParams(temperature=0.0, ignore_eos=True, num_tokens_to_generate=6)
VOCAB = 61  # odd: padded to 62 rows at TP=2


def test_padded_vocab_and_replicated_kv_heads_greedy_tp2_equals_tp1(
    run_distributed, tmp_path, make_engine, prompts_factory, hf_tiny_config
):
    transformers = pytest.importorskip("transformers")
    from mcore_models import import_hf_checkpoint

    config = transformers.LlamaConfig(
        **(hf_tiny_config | dict(vocab_size=VOCAB, num_key_value_heads=1)),
        max_position_embeddings=256,
        eos_token_id=None,  # generate's min_new_tokens and ignore_eos differ at an end-of-sequence id
    )
    torch.manual_seed(0)
    hf_model = transformers.LlamaForCausalLM(config).eval()
    hf_model.save_pretrained(tmp_path)
    prompts = prompts_factory(4, 3, 15, seed=42, vocab=VOCAB)

    def body(tp):
        from mcore_parallel import initialize_model_parallel

        model = import_hf_checkpoint(
            tmp_path, pg_collection=initialize_model_parallel(tensor_model_parallel_size=tp)
        )
        engine = make_engine(model, blocks=24, max_tokens=8)  # chunked prefill
        requests = engine.generate(prompts, GREEDY)
        assert all(r.status is RequestStatus.COMPLETED for r in requests)
        return (
            model.kv_cache_spec.num_kv_heads,
            model.padded_vocab_size,
            [r.generated_tokens for r in requests],
        )

    ((heads1, padded1, tokens1),) = run_distributed(body, 1, 1, timeout=120)
    ranks = run_distributed(body, 2, 2, timeout=120)
    assert (heads1, padded1) == (1, VOCAB)
    for heads, padded, tokens in ranks:
        assert (heads, padded) == (1, 62)  # one replicated KV head per rank, one padded id
        assert tokens == tokens1
    with torch.no_grad():
        for prompt, tokens in zip(prompts, tokens1, strict=True):
            expected = hf_model.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False)
            assert tokens == expected[0, len(prompt) :].tolist()
