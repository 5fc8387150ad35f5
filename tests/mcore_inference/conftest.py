"""Tiny GPT models in a one-process group or split over ranks, the full-recompute greedy oracle,
and ``mcore-serve`` called in process for the ways it refuses to start."""

import signal

import pytest
import torch
import torch.distributed as dist

VOCAB = 128
VARIANTS = {
    # GQA, RoPE, RMSNorm, swiglu, qk-norm, learned sinks, a window on the first layer
    "llama-like": dict(
        num_query_groups=2,
        normalization="RMSNorm",
        activation="swiglu",
        position_embedding_type="rope",
        add_bias_linear=False,
        qk_layernorm=True,
        softmax_type="learnable",
        window_size=5,
        window_attn_skip_freq=[1, 0],
    ),
    # learned absolute positions, LayerNorm with biases, off-by-one softmax
    "gpt-like": dict(softmax_type="off-by-one", max_position_embeddings=256),
}

# llama-like without qk-norm: the layers mcore-models' lean inference forward computes
VARIANTS["plain-llama"] = {k: v for k, v in VARIANTS["llama-like"].items() if k != "qk_layernorm"}


def build_model(variant="llama-like", groups=None, seed=0, tp=1, **stage):
    """``stage``: ``pre_process`` / ``post_process`` of a pipeline stage."""
    from mcore_models import GPTModel, TransformerConfig

    config = TransformerConfig(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        ffn_hidden_size=96,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        tensor_model_parallel_size=tp,
        **VARIANTS[variant],
    )
    torch.manual_seed(seed)
    model = GPTModel(config, VOCAB, pg_collection=groups, **stage).eval()
    with torch.no_grad():  # non-zero sinks, so they matter
        for name, p in model.named_parameters():
            if name.endswith("softmax_offset"):
                p.copy_(torch.linspace(-1.0, 1.0, p.numel()))
    return model


def build_split_model(variant="llama-like", tp=1, pp=1, seed=0):
    """This rank's stage of a ``tp x pp`` model (groups from ``initialize_model_parallel``) and, in
    this process, the whole model whose weights it holds (collective over the world)."""
    from mcore_models.hf.sharding import load_full_state_dict
    from mcore_parallel import ProcessGroupCollection, initialize_model_parallel

    singles = [dist.new_group([r]) for r in range(dist.get_world_size())]
    whole = build_model(variant, ProcessGroupCollection(tp=singles[dist.get_rank()]), seed)
    groups = initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    stage, last = dist.get_rank(groups.pp), dist.get_world_size(groups.pp) - 1
    model = build_model(variant, groups, seed, tp, pre_process=stage == 0, post_process=stage == last)
    full = whole.state_dict()
    numbers = [layer.layer_number for layer in model.decoder.layers]  # 1-based, global
    local = {}
    for name in model.state_dict():
        parts = name.split(".")
        if parts[:2] == ["decoder", "layers"]:
            parts[2] = str(numbers[int(parts[2])] - 1)
        local[name] = full[".".join(parts)]
    load_full_state_dict(model, local, groups.tp)
    return model, whole


def greedy_oracle(model, prompt, num_tokens):
    """Full-recompute greedy decode: the whole sequence through ``model`` for every new token."""
    tokens = list(prompt)
    parallel_output, model.parallel_output = model.parallel_output, False
    with torch.no_grad():
        for _ in range(num_tokens):
            input_ids = torch.tensor([tokens], device=next(model.parameters()).device)
            tokens.append(int(model(input_ids)[0, -1].argmax()))
    model.parallel_output = parallel_output
    return tokens[len(prompt) :]


def random_prompts(count, low, high, seed, vocab=VOCAB):
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(low, high + 1, (count,), generator=generator).tolist()
    return [torch.randint(0, vocab, (n,), generator=generator).tolist() for n in lengths]


@pytest.fixture
def groups():
    """A one-process gloo world (torn down after the test, so forked ranks start clean)."""
    from mcore_parallel import ProcessGroupCollection

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield ProcessGroupCollection(tp=dist.new_group([0]))
    dist.destroy_process_group()


@pytest.fixture
def make_model(groups):
    return lambda variant="llama-like", seed=0: build_model(variant, groups, seed)


@pytest.fixture
def oracle():
    return greedy_oracle


@pytest.fixture
def prompts_factory():
    return random_prompts


@pytest.fixture
def hf_tiny_config():
    """Keyword arguments of a tiny Hugging Face Llama-family config (GQA 4/2, two layers)."""
    return dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )


def build_engine(model, blocks=64, block_size=4, **kwargs):
    """An engine whose cache holds exactly ``blocks`` blocks (fp32 cache of this rank's heads)."""
    from mcore_inference import DynamicInferenceEngine

    spec = model.kv_cache_spec
    per_block = 2 * len(spec.layer_numbers) * block_size * spec.num_kv_heads * spec.head_dim * 4
    return DynamicInferenceEngine(model, kv_cache_memory=blocks * per_block, block_size=block_size, **kwargs)


@pytest.fixture
def make_engine():
    return build_engine


@pytest.fixture
def model_builder():
    """``build_model(variant, groups, seed, tp)`` for bodies that set up their own groups."""
    return build_model


@pytest.fixture
def split_model_builder():
    """``build_split_model(variant, tp, pp, seed) -> (stage, whole)`` for distributed bodies."""
    return build_split_model


class FlakyModel:
    """Wraps a model; its ``inference_forward`` raises for the first ``failures`` calls."""

    def __init__(self, model, failures):
        self.model, self.failures = model, failures

    def __getattr__(self, name):
        return getattr(self.model, name)

    def inference_forward(self, *args, **kwargs):
        if self.failures:
            self.failures -= 1
            raise RuntimeError("device hiccup")
        return self.model.inference_forward(*args, **kwargs)


@pytest.fixture
def flaky_model():
    return FlakyModel


class RecordingModel:
    """Forwards reads to ``model`` and records their names in ``read``; refuses every write."""

    def __init__(self, model):
        object.__setattr__(self, "_model", model)
        object.__setattr__(self, "read", set())

    def __getattr__(self, name):
        self.read.add(name)
        return getattr(self._model, name)

    def __setattr__(self, name, value):
        raise AssertionError(f"the engine set model.{name}")

    def __delattr__(self, name):
        raise AssertionError(f"the engine deleted model.{name}")


@pytest.fixture
def recording_model():
    return RecordingModel


@pytest.fixture(scope="module")
def expected():
    """``expected(prompt, n, **sampling)``: the tokens the in-process engine over the coordinator
    engines' model (``coordinator_engine.py``) generates for ``prompt``: ``n`` greedy tokens,
    ignoring EOS, unless ``sampling`` changes that; ``expected.request(prompt, params)`` is the
    whole finished ``Request``, and ``expected.prime(prompts, n)`` computes many in one batch."""
    from mcore_inference import SamplingParams
    from mcore_parallel import ProcessGroupCollection

    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    engine = build_engine(
        build_model("llama-like", ProcessGroupCollection(tp=dist.new_group([0])), seed=0), blocks=256
    )
    cache = {}

    def params(n, sampling):
        return SamplingParams(
            **{"temperature": 0, "num_tokens_to_generate": n, "ignore_eos": True, **sampling}
        )

    def prime(prompts, n, **sampling):  # one batched run for many prompts
        key = tuple(sorted(sampling.items()))
        todo = [p for p in prompts if (tuple(p), n, key) not in cache]
        for prompt, request in zip(
            todo, engine.generate(todo, params(n, sampling)) if todo else [], strict=True
        ):
            cache[(tuple(prompt), n, key)] = request

    def request(prompt, n, **sampling):
        prime([prompt], n, **sampling)
        return cache[(tuple(prompt), n, tuple(sorted(sampling.items())))]

    def tokens(prompt, n, **sampling):
        return request(prompt, n, **sampling).generated_tokens

    tokens.prime = prime
    tokens.request = request
    tokens.engine = engine
    yield tokens
    if owned:
        dist.destroy_process_group()


@pytest.fixture
def refused(tmp_path, monkeypatch, capsys):
    """Call ``mcore-serve ARGS`` in this process, in ``tmp_path``, for a refusal (which starts no
    engine, though it may load the model as the front end does): its exit status, stdout and
    stderr. What the call leaves in this process is undone: the signal handlers it installs, and
    the one-process group that loading a model initializes. (The console script's own exit
    status: ``test_a_port_in_use_is_refused``.)"""
    from mcore_inference.serve_cli.cli import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")

    def call(args: list[str]) -> tuple[int, str, str]:
        handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
        had_group = dist.is_initialized()
        try:
            status = main(args)
        except SystemExit as exit_:
            status = exit_.code
        finally:
            for sig, handler in handlers.items():
                signal.signal(sig, handler)
            if dist.is_initialized() and not had_group:
                dist.destroy_process_group()
        out, err = capsys.readouterr()
        return status, out, err

    return call
