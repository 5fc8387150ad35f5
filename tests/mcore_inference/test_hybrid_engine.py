"""The engine serving a hybrid (Mamba + attention + MLP + MoE) model: a transformers NemotronH
(random weights, fp32, ``mcore_testing.nemotron_h``'s tiny config) imported with
``import_nemotron_h``. Oracle: transformers' greedy ``generate``, token for token, under batching,
chunked prefill mixed with decodes (and a step holding a decode, a whole prompt and a prompt
chunk at once), preemption, suspend/resume, abort and tensor parallelism; each request's Mamba
state lives in a slot of the context that it takes when laid out and frees when it leaves."""

import pytest
import torch
from mcore_inference import DynamicInferenceContext, DynamicInferenceEngine, RequestEventType, SamplingParams
from mcore_models import MambaInferenceStateConfig, MambaStepLayout, mamba_state_config_of
from mcore_testing.nemotron_h import TINY_NEMOTRON_H

transformers = pytest.importorskip("transformers")

VOCAB, NEW_TOKENS = 64, 6
GREEDY = SamplingParams(temperature=0.0, ignore_eos=True, num_tokens_to_generate=NEW_TOKENS)
HF_CONFIG = TINY_NEMOTRON_H | dict(vocab_size=VOCAB, hybrid_override_pattern="M*-EM", eos_token_id=None)
# lengths 3 .. 19: one scan chunk or several, prompts cut into chunks by small token budgets
PROMPTS = [
    torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (3, 11, 19, 7)
]


@pytest.fixture(scope="module")
def nemotron_h(tmp_path_factory):
    """(checkpoint directory, HF greedy tokens of each prompt)."""
    torch.manual_seed(0)
    model = transformers.NemotronHForCausalLM(transformers.NemotronHConfig(**HF_CONFIG)).eval()
    directory = tmp_path_factory.mktemp("nemotron_h")
    model.save_pretrained(directory)
    expected = [
        model.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, do_sample=False)[0, len(p) :].tolist()
        for p in PROMPTS
    ]
    return directory, expected


@pytest.fixture
def hybrid(nemotron_h, groups):
    from mcore_models.models.hybrid import import_nemotron_h

    return import_nemotron_h(nemotron_h[0], pg_collection=groups).eval()


def _engine(model, blocks=64, block_size=4, max_requests=8, **kwargs):
    """An engine whose cache holds exactly ``blocks`` blocks beside ``max_requests`` Mamba slots."""
    spec, states = model.kv_cache_spec, model.mamba_state_config
    attention = len(states.layers_of_type("attention"))  # the only layers with keys and values
    per_block = 2 * attention * block_size * spec.num_kv_heads * spec.head_dim * 4
    memory = blocks * per_block + max_requests * states.state_bytes()
    return DynamicInferenceEngine(
        model, kv_cache_memory=memory, block_size=block_size, max_requests=max_requests, **kwargs
    )


def _run(engine, prompts=PROMPTS):
    """Step ``prompts`` to the end; the requests and each step's Mamba layout."""
    requests = [engine.add_request(p, GREEDY) for p in prompts]
    layouts = []
    while engine.has_unfinished_requests():
        engine.step()
        layouts.append(engine.context.mamba_layout)
    return requests, layouts


def test_batched_requests_match_hf_generate(hybrid, nemotron_h):
    config = hybrid.mamba_state_config
    assert config == mamba_state_config_of(hybrid)
    assert config.layer_types == ("mamba", "attention", "mlp", "moe", "mamba")
    assert config.layers_of_type("mamba") == (1, 5) and config.layers_of_type("attention") == (2,)
    # conv channels [x; B; C] = 64 + 2 * 2 * 16, kernel 4; heads 8 x head_dim 8 x state 16
    assert (config.conv_state_shape, config.ssm_state_shape) == ((128, 3), (8, 8, 16))
    engine = _engine(hybrid)
    requests, _ = _run(engine, [*PROMPTS, PROMPTS[2]])  # the same prompt twice: no prefix cache hit
    assert [r.generated_tokens for r in requests] == [*nemotron_h[1], nemotron_h[1][2]]
    assert engine.cache_stats()["prefix_cache_hit_tokens"] == 0
    assert not engine.context.allocator.enable_prefix_caching  # off for hybrid models
    assert engine.context.num_cache_layers == 1  # keys and values of the attention layer alone
    assert len(engine.context.mamba_slots) == 0  # every slot freed


def test_chunked_prefill_mixed_with_decodes_matches_hf_generate(hybrid, nemotron_h):
    requests, layouts = _run(_engine(hybrid, max_tokens=5))
    assert [r.generated_tokens for r in requests] == nemotron_h[1]
    mixed = [lay for lay in layouts if lay.decode_rows.numel() and lay.prefills]
    assert mixed, "no step mixed decode rows with a prefill chunk"


def test_a_step_mixes_decodes_whole_prompts_and_prompt_chunks(hybrid, nemotron_h):
    """A budget of 16 tokens makes a step that decodes a request, prefills a whole prompt and a
    chunk of a longer one, each Mamba state continuing its own slot; greedy output equals HF's."""
    engine = _engine(hybrid, max_tokens=16)
    schedule, steps = engine.scheduler.schedule, []

    def recording_schedule():
        chunks = schedule()
        prompts = [len(c.request.prompt_tokens) for c in chunks]
        steps.append([(c.start, c.end, prompt) for c, prompt in zip(chunks, prompts, strict=True)])
        return chunks

    engine.scheduler.schedule = recording_schedule
    requests, _ = _run(engine)
    assert [r.generated_tokens for r in requests] == nemotron_h[1]

    def kinds(step):
        found = set()
        for start, end, prompt in step:
            if end - start == 1 and start >= prompt:
                found.add("decode")
            elif start == 0 and end == prompt:
                found.add("whole prompt")
            elif end <= prompt and (start > 0 or end < prompt):
                found.add("prompt chunk")
        return found

    assert any(kinds(step) == {"decode", "whole prompt", "prompt chunk"} for step in steps), steps


def test_preempted_requests_restart_their_state(hybrid, nemotron_h):
    requests, _ = _run(_engine(hybrid, blocks=9, max_tokens=16))  # 36 cache tokens for 4 requests
    assert any(RequestEventType.EVICT in [e.type for e in r.events] for r in requests)
    assert [r.generated_tokens for r in requests] == nemotron_h[1]


def test_suspend_and_resume_mid_generation(hybrid, nemotron_h):
    engine = _engine(hybrid, max_tokens=8)
    requests = [engine.add_request(p, GREEDY) for p in PROMPTS]
    for _ in range(5):
        engine.step()
    assert any(r.generated_tokens for r in requests) and not all(r.finished for r in requests)
    assert engine.suspend() == engine.context.memory_bytes
    assert engine.context.mamba_slots.conv is None  # the states are freed with the cache
    engine.resume()
    while engine.has_unfinished_requests():
        engine.step()
    assert [r.generated_tokens for r in requests] == nemotron_h[1]


def test_abort_frees_the_slot_for_a_new_request(hybrid, nemotron_h):
    engine = _engine(hybrid, max_requests=2)
    first, second = (engine.add_request(p, GREEDY) for p in PROMPTS[:2])
    engine.step()
    engine.step()
    assert len(engine.context.mamba_slots) == 2
    engine.abort(first.request_id)
    assert len(engine.context.mamba_slots) == 1
    late = engine.add_request(PROMPTS[2], GREEDY)  # takes the aborted request's slot
    while engine.has_unfinished_requests():
        engine.step()
    assert [second.generated_tokens, late.generated_tokens] == nemotron_h[1][1:3]


def _tensor_parallel_body(directory):
    from mcore_models.models.hybrid import import_nemotron_h
    from mcore_parallel import initialize_model_parallel

    model = import_nemotron_h(directory, pg_collection=initialize_model_parallel(2)).eval()
    requests, _ = _run(_engine(model, max_tokens=8))
    config = model.mamba_state_config
    return [r.generated_tokens for r in requests], config.conv_state_shape, config.ssm_state_shape


def test_tensor_parallel_ranks_hold_their_heads_states(run_distributed, nemotron_h):
    directory, expected = nemotron_h
    for tokens, conv, ssm in run_distributed(_tensor_parallel_body, 2, directory, timeout=120):
        assert (conv, ssm) == ((64, 3), (4, 8, 16))  # half the channels and heads of one process
        assert tokens == expected


def test_hybrid_engine_refuses_bad_setups(hybrid):
    with pytest.raises(ValueError, match=r"must exceed the .* bytes of Mamba states"):
        DynamicInferenceEngine(hybrid, kv_cache_memory=1024)
    with pytest.raises(NotImplementedError, match="cuda_graphs with Mamba layers"):
        _engine(hybrid, cuda_graphs=True)
    context = DynamicInferenceContext(num_layers=1, num_kv_heads=2, head_dim=8, kv_cache_memory=1 << 16)
    with pytest.raises(ValueError, match="keeps no Mamba states"):
        context.mamba_states(1)


def test_a_mamba_layer_needs_a_context_with_states(hybrid):
    class KeysValuesOnly:  # an InferenceContext of an engine that knows no Mamba states
        logits_indices = None

        def attend(self, layer_number, query, key, value, **kwargs):
            return torch.zeros(query.shape[0], query.shape[1] * query.shape[2])

    ids = torch.tensor([[1, 2, 3]])
    with pytest.raises(TypeError, match=r"MambaInferenceContext.*KeysValuesOnly"), torch.no_grad():
        hybrid.inference_forward(ids, torch.arange(3).view(1, 3), KeysValuesOnly())


def test_state_config_and_lookup_errors():
    good = dict(
        layer_numbers=range(1, 3),
        layer_types=("mamba", "attention"),
        conv_state_shape=(4, 3),
        ssm_state_shape=(2, 4, 8),
        conv_dtype=torch.float32,
        ssm_dtype=torch.float32,
    )
    assert MambaInferenceStateConfig(**good).state_bytes() == 4 * (
        4 * 3 + 2 * 4 * 8
    )  # float32, one Mamba layer
    for change, field in (
        ({"layer_types": ("mamba",)}, "layer_types"),
        ({"layer_types": ("attention", "mlp")}, "layer_types"),
        ({"conv_state_shape": (4,)}, "conv_state_shape"),
        ({"ssm_state_shape": (2, -1, 8)}, "ssm_state_shape"),
    ):
        with pytest.raises(ValueError, match=field):
            MambaInferenceStateConfig(**(good | change))

    class Odd:
        mamba_state_config = "mamba"

    assert mamba_state_config_of(object()) is None
    with pytest.raises(TypeError, match="mamba_state_config must be a MambaInferenceStateConfig"):
        mamba_state_config_of(Odd())
    layout = MambaStepLayout(torch.tensor([0]), torch.tensor([1]))
    assert layout.prefills == ()


def test_state_slots_are_zeroed_reused_and_bounded():
    from mcore_inference.mamba_states import MambaStateSlots

    config = MambaInferenceStateConfig(
        range(3, 5), ("attention", "mamba"), (2, 1), (1, 1, 2), *[torch.float32] * 2
    )
    slots = MambaStateSlots(config, 2, torch.device("cpu"))
    slots.allocate()
    assert (slots.take(10, fresh=True), slots.take(11, fresh=True)) == (0, 1)
    conv, ssm = slots.states(4)
    conv.fill_(1.0)
    ssm.fill_(1.0)
    assert slots.take(10, fresh=False) == 0 and ssm[0].sum() == 2  # continued, not zeroed
    with pytest.raises(RuntimeError, match="all 2 Mamba state slots are taken"):
        slots.take(12, fresh=True)
    slots.drop(10)
    assert slots.take(12, fresh=True) == 0  # the freed slot, started from zeros
    assert (conv[0].sum(), ssm[0].sum(), conv[1].sum(), ssm[1].sum()) == (0, 0, 2, 2)
    with pytest.raises(ValueError, match=r"layer 3 is not a Mamba layer of this context \[4\]"):
        slots.states(3)
