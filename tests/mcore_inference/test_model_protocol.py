"""The engine reaches a model only through ``mcore_models.InferenceModel``: ``GPTModel`` implements
it, a model of another kind does too (without the optional members), a model lacking a member is refused naming it, and the
engine leaves the caller's model exactly as it found it."""

import pytest
import torch
import torch.nn.functional as F
from mcore_inference import DynamicInferenceEngine, RequestStatus, SamplingParams
from mcore_models import OPTIONAL_INFERENCE_MEMBERS, InferenceModel, KVCacheSpec, missing_inference_members

GREEDY = SamplingParams(temperature=0.0, ignore_eos=True, num_tokens_to_generate=6)
MEMBERS = [
    "vocab_size",
    "hidden_size",
    "max_sequence_length",
    "eos_token_ids",
    "pre_process",
    "post_process",
    "tp_group",
    "training",
    "kv_cache_spec",
    "inference_forward",
]


class OneHeadModel(torch.nn.Module):
    """Not a ``GPTModel``: one single-head causal attention over token + learned position embeddings."""

    vocab_size, hidden_size, max_sequence_length = 32, 16, 64
    eos_token_ids = ()
    pre_process = post_process = True
    tp_group = None

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.tokens = torch.nn.Embedding(self.vocab_size, self.hidden_size)
        self.positions = torch.nn.Embedding(self.max_sequence_length, self.hidden_size)
        self.qkv = torch.nn.Linear(self.hidden_size, 3 * self.hidden_size)
        self.output = torch.nn.Linear(self.hidden_size, self.vocab_size)

    @property
    def kv_cache_spec(self):
        return KVCacheSpec(range(1, 2), 1, self.hidden_size, torch.float32, torch.device("cpu"))

    def _qkv(self, ids, positions):
        return self.qkv(self.tokens(ids) + self.positions(positions)).chunk(3, -1)

    def forward(self, ids):
        """Full recompute: logits ``[s, vocab]`` of the token ids ``[s]``."""
        q, k, v = (t.unsqueeze(0) for t in self._qkv(ids, torch.arange(len(ids))))
        return self.output(F.scaled_dot_product_attention(q, k, v, is_causal=True)[0])

    def inference_forward(self, input_ids, position_ids, inference_context, hidden_states=None):
        q, k, v = (t.unsqueeze(1) for t in self._qkv(input_ids[0], position_ids[0]))
        attended = inference_context.attend(
            1, q, k, v, scale=self.hidden_size**-0.5, window_size=None, sink_logits=None
        )
        return self.output(attended[inference_context.logits_indices])


def _one_head_oracle(model, prompt, count):
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(count):
            tokens.append(int(model(torch.tensor(tokens))[-1].argmax()))
    return tokens[len(prompt) :]


def test_gpt_model_implements_the_protocol(make_model):
    model = make_model()
    assert isinstance(model, InferenceModel) and missing_inference_members(model) == []
    assert sorted(MEMBERS) == sorted(missing_inference_members(object()))
    config = model.config
    assert model.kv_cache_spec == KVCacheSpec(
        range(1, config.num_layers + 1),
        config.num_query_groups,
        config.kv_channels,
        torch.float32,
        torch.device("cpu"),
    )
    assert (model.hidden_size, model.max_sequence_length) == (config.hidden_size, None)
    assert make_model("gpt-like").max_sequence_length == 256


def test_a_model_of_another_kind_matches_its_full_recompute(prompts_factory):
    model = OneHeadModel().eval()
    assert isinstance(model, InferenceModel)
    prompts = prompts_factory(4, 2, 12, seed=60, vocab=model.vocab_size)
    engine = DynamicInferenceEngine(model, kv_cache_memory=1 << 16, block_size=4, max_tokens=8)
    requests = engine.generate(prompts, GREEDY)
    assert all(r.status is RequestStatus.COMPLETED for r in requests)
    assert [r.generated_tokens for r in requests] == [_one_head_oracle(model, p, 6) for p in prompts]


class _Without:
    """``model`` without the member ``missing``."""

    def __init__(self, model, missing):
        self._model, self._missing = model, missing

    def __getattr__(self, name):
        if name == self._missing:
            raise AttributeError(name)
        return getattr(self._model, name)


@pytest.mark.parametrize("missing", MEMBERS)
def test_a_model_lacking_a_member_is_refused_naming_it(make_model, missing):
    model = _Without(make_model(), missing)
    assert not isinstance(model, InferenceModel)
    with pytest.raises(TypeError, match=f"InferenceModel; _Without lacks {missing}$"):
        DynamicInferenceEngine(model, kv_cache_memory=1 << 20)


def test_a_model_in_training_mode_is_refused_not_switched(make_model, make_engine):
    model = make_model().train()
    with pytest.raises(ValueError, match=r"training mode: call model.eval\(\)"):
        make_engine(model)
    assert model.training
    model.eval()
    engine = make_engine(model)
    model.decoder.layers[1].train()  # after the engine was built: its forwards refuse to run
    (request,) = engine.generate([[1, 2, 3]], GREEDY)
    assert request.status is RequestStatus.FAILED
    assert "decoder.layers.1 is in training mode" in request.error
    assert model.decoder.layers[1].training and not model.training


def _snapshot(model):
    """Every module's mode and plain attributes, and every tensor's values and identity."""
    modules = {
        name: {key: value for key, value in vars(module).items() if key not in ("_parameters", "_buffers")}
        for name, module in model.named_modules()
    }
    tensors = {
        name: (tensor.data_ptr(), tensor.requires_grad, tensor.detach().clone())
        for name, tensor in model.state_dict(keep_vars=True).items()
    }
    return modules, tensors


def _assert_same(before, after):
    (modules, tensors), (modules_after, tensors_after) = before, after
    assert modules.keys() == modules_after.keys()
    for name, attributes in modules.items():
        assert attributes.keys() == modules_after[name].keys(), name
        for key, value in attributes.items():
            assert modules_after[name][key] is value or modules_after[name][key] == value, (name, key)
    assert tensors.keys() == tensors_after.keys()
    for name, (pointer, requires_grad, values) in tensors.items():
        pointer_after, requires_grad_after, values_after = tensors_after[name]
        assert (pointer, requires_grad) == (pointer_after, requires_grad_after), name
        assert torch.equal(values, values_after), name


@pytest.mark.filterwarnings("ignore:cuda_graphs needs a CUDA model")
@pytest.mark.parametrize("cuda_graphs", [False, True], ids=["eager", "padded-decode"])
def test_the_engine_leaves_the_callers_model_unchanged(
    make_model, make_engine, prompts_factory, recording_model, cuda_graphs
):
    """... and reads nothing of it but protocol members (through a proxy that refuses writes)."""
    model = make_model()
    assert model.parallel_output and not model.training
    before = _snapshot(model)
    recording = recording_model(model)
    engine = make_engine(recording, blocks=12, max_tokens=8, cuda_graphs=cuda_graphs)  # preemption
    _assert_same(before, _snapshot(model))
    prompts = prompts_factory(4, 2, 14, seed=61)
    requests = [engine.add_request(p, SamplingParams(temperature=0.8, seed=1)) for p in prompts]
    engine.step()
    engine.suspend()
    engine.resume()
    while engine.has_unfinished_requests():
        engine.step()
    assert all(r.status is RequestStatus.COMPLETED for r in requests)
    _assert_same(before, _snapshot(model))
    assert "inference_forward" in recording.read and recording.read <= {*MEMBERS, *OPTIONAL_INFERENCE_MEMBERS}


def test_inference_forward_checks_hidden_states_against_its_stage(groups, model_builder, make_engine):
    first = model_builder(groups=groups)
    context = make_engine(first).context
    ids = torch.tensor([[1, 2, 3]])
    with pytest.raises(ValueError, match="hidden_states must be given exactly when pre_process is False"):
        first.inference_forward(ids, ids, context, torch.zeros(3, 1, first.hidden_size))
    later = model_builder(groups=groups, pre_process=False)
    with pytest.raises(ValueError, match=r"exactly when pre_process is False \(pre_process=False\)"):
        later.inference_forward(ids, ids, context)


@pytest.mark.parametrize(
    "arguments, message",
    [
        (dict(layer_numbers=range(0, 2)), "layer_numbers"),
        (dict(layer_numbers=range(1, 1)), "layer_numbers"),
        (dict(layer_numbers=range(1, 5, 2)), "layer_numbers"),
        (dict(layer_numbers=[1, 2]), "layer_numbers"),
        (dict(num_kv_heads=0), "num_kv_heads"),
        (dict(head_dim=True), "head_dim"),
    ],
)
def test_kv_cache_spec_refuses_bad_geometry(arguments, message):
    valid = dict(layer_numbers=range(1, 3), num_kv_heads=2, head_dim=8, dtype=torch.float32, device="cpu")
    with pytest.raises(ValueError, match=message):
        KVCacheSpec(**(valid | arguments))


@pytest.mark.parametrize(
    "arguments, field",
    [
        (dict(eos_token_ids=[-1]), "eos_token_ids"),
        (dict(eos_token_ids=[3, None]), "eos_token_ids"),
        (dict(bos_token_id="1"), "bos_token_id"),
        (dict(pad_token_id=True), "pad_token_id"),
    ],
)
def test_gpt_model_refuses_bad_special_token_ids(groups, model_builder, arguments, field):
    with pytest.raises(ValueError, match=f"{field} must be"):
        model_builder(groups=groups, **arguments)


def test_stages_that_do_not_form_one_model_are_refused_on_every_rank(run_distributed, model_builder):
    def body():
        import torch.distributed as dist
        from mcore_parallel import initialize_model_parallel

        groups = initialize_model_parallel(pipeline_model_parallel_size=2)
        # Stage 1 without the output layer, as chunk 0 of a virtual pipeline would be built.
        model = model_builder(groups=groups, pre_process=dist.get_rank() == 0, post_process=False)
        with pytest.raises(ValueError, match=r"stage 1 of 2 has pre_process=False, post_process=False"):
            DynamicInferenceEngine(model, kv_cache_memory=1 << 20)
        return True

    assert run_distributed(body, 2, timeout=60) == [True, True]
