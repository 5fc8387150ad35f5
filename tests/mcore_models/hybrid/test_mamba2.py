"""``import_mamba2`` / ``export_mamba2`` against Hugging Face's ``Mamba2ForCausalLM``.

Oracle: a random-weight transformers Mamba2 (fp32; random norms and ``D``; some time steps of
layer 0 below its ``time_step_limit``, so the clamp matters; a sequence that ends inside a scan
chunk; non-default special tokens) saved with ``save_pretrained``. Imported at TP = 1 and 2, our
logits equal its logits within 1e-4; exported, the files hold the tensors ``save_pretrained``
wrote, ``config.json`` its ``time_step_limit``, ``from_pretrained`` loads them with no missing or
unexpected keys and gives the same logits, and re-importing the export gives the first import's
state dict. The same at TP = 1 for a finite upper limit, ``time_step_limit = (0.02, 0.5)``, with
time steps above 0.5 on other heads of layer 0 (without the limit, transformers' logits differ).
Options Mamba2 or ``HybridModel`` cannot represent fail with errors naming them, before anything
is read or written.
"""

from __future__ import annotations

import itertools
import json
import math
import shutil

import pytest
import torch
import transformers  # imported here so forked ranks inherit it
from mcore_models import load_checkpoint_for_inference
from mcore_models.config.transformer_config import TransformerConfig
from mcore_models.data import stdlib_documents, train_bpe_tokenizer
from mcore_models.models.hybrid import HybridModel, export_mamba2, import_mamba2, mamba2_configs
from mcore_models.ssm import MambaConfig
from mcore_parallel import ConfigError
from safetensors.torch import load_file

TOLERANCE = 1e-4
VOCAB = 64
HF_CONFIG = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    num_hidden_layers=3,
    num_heads=8,
    head_dim=8,
    expand=2,
    n_groups=2,
    state_size=16,
    chunk_size=8,
    time_step_limit=(0.02, math.inf),
    bos_token_id=3,
    eos_token_id=4,
    pad_token_id=5,
)


def _hf_model(hf_config: dict) -> transformers.Mamba2ForCausalLM:
    torch.manual_seed(0)
    model = transformers.Mamba2ForCausalLM(transformers.Mamba2Config(**hf_config)).eval()
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if name.endswith(("norm.weight", "norm_f.weight", ".D")):
                tensor.add_(torch.randn_like(tensor) * 0.1)
        # half the heads of layer 0 take time steps below the limit's 0.02, where it clamps them
        model.backbone.layers[0].mixer.dt_bias[::2] = -10.0
        model.backbone.layers[0].mixer.in_proj.weight *= 25.0
    return model


def _saved(model, directory):
    """(``save_pretrained`` directory, input ids [2, 12], HF logits)."""
    model.save_pretrained(directory)
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model(ids).logits
    return directory, ids, logits


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """(``save_pretrained`` directory, input ids [2, 12], HF logits)."""
    return _saved(_hf_model(HF_CONFIG), tmp_path_factory.mktemp("mamba2"))


@pytest.fixture(scope="module")
def bounded_reference(tmp_path_factory):
    """``reference`` with ``time_step_limit = (0.02, 0.5)`` and the other half of layer 0's heads
    taking time steps above 0.5; and transformers' logits of the same weights without the upper
    limit."""
    model = _hf_model(HF_CONFIG | {"time_step_limit": (0.02, 0.5)})
    with torch.no_grad():
        model.backbone.layers[0].mixer.dt_bias[1::2] = 2.0  # softplus(2) = 2.1 before the clamp
    saved = _saved(model, tmp_path_factory.mktemp("mamba2_bounded"))
    for layer in model.backbone.layers:
        layer.mixer.time_step_limit = (0.02, math.inf)
    with torch.no_grad():
        unbounded = model(saved[1]).logits
    return saved, unbounded


def _check_logits_and_round_trip(reference, tp, target, run_distributed, model_parallel):
    """Import ``reference`` at ``tp``, compare logits, export to ``target``, compare files,
    re-import and reload in transformers; returns the imported mixers' ``mamba_dt_clamp_max``."""
    source, ids, expected = reference

    def body():
        import torch.distributed as dist

        groups = model_parallel(tp)
        model = import_mamba2(source, pg_collection=groups)
        assert [layer.layer_type for layer in model.decoder.layers] == ["mamba"] * 3
        assert (model.bos_token_id, model.eos_token_ids, model.pad_token_id) == (3, (4,), 5)
        with torch.no_grad():
            local = model(ids)
        shards = [torch.empty_like(local) for _ in range(tp)]
        dist.all_gather(shards, local, group=groups.tp)
        export_mamba2(model, target)
        again = import_mamba2(target, pg_collection=groups)
        ours, theirs = model.state_dict(), again.state_dict()
        assert ours.keys() == theirs.keys()
        changed = [name for name in ours if not torch.equal(ours[name], theirs[name])]
        return torch.cat(shards, dim=-1), changed, model.decoder.layers[0].mixer.mamba.mamba_dt_clamp_max

    results = run_distributed(body, tp, timeout=120)
    for logits, changed, _ in results:
        assert (logits - expected).abs().max().item() <= TOLERANCE
        assert changed == []

    original, exported = load_file(source / "model.safetensors"), load_file(target / "model.safetensors")
    assert exported.keys() == original.keys()
    assert all(torch.equal(exported[name], original[name]) for name in original)
    config = json.loads((target / "config.json").read_text())
    saved_config = json.loads((source / "config.json").read_text())
    assert (config["model_type"], config["eos_token_id"]) == ("mamba2", 4)
    assert config["time_step_limit"] == saved_config["time_step_limit"]  # as transformers wrote it
    hf, info = transformers.Mamba2ForCausalLM.from_pretrained(target, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    with torch.no_grad():
        assert (hf.eval()(ids).logits - expected).abs().max().item() <= TOLERANCE
    return results[0][2]


@pytest.mark.parametrize("tp", [1, 2])
def test_logits_and_round_trip(tp, reference, tmp_path, run_distributed, model_parallel):
    clamp_max = _check_logits_and_round_trip(
        reference, tp, tmp_path / "export", run_distributed, model_parallel
    )
    assert clamp_max is None
    limit = json.loads((tmp_path / "export" / "config.json").read_text())["time_step_limit"]
    assert limit == [0.02, {"__float__": "Infinity"}]  # as transformers writes infinity


def test_upper_time_step_limit_logits_and_round_trip(
    bounded_reference, tmp_path, run_distributed, model_parallel
):
    reference, unbounded = bounded_reference
    assert (unbounded - reference[2]).abs().max().item() > 100 * TOLERANCE  # the upper limit matters
    clamp_max = _check_logits_and_round_trip(
        reference, 1, tmp_path / "export", run_distributed, model_parallel
    )
    assert clamp_max == 0.5
    assert json.loads((tmp_path / "export" / "config.json").read_text())["time_step_limit"] == [0.02, 0.5]


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ({"use_bias": True}, "use_bias=True"),
        ({"use_conv_bias": False}, "use_conv_bias=False"),
    ],
)
def test_unsupported_options_are_named(changes, match):
    with pytest.raises(NotImplementedError, match=match):
        mamba2_configs(HF_CONFIG | changes)


def test_config_maps_every_size():
    config, mamba, pattern, vocab = mamba2_configs(HF_CONFIG, tensor_model_parallel_size=2)
    assert (pattern.symbols, vocab, config.hidden_size, config.tensor_model_parallel_size) == (
        "MMM",
        64,
        32,
        2,
    )
    assert (mamba.heads(32), mamba.mamba_head_dim, mamba.mamba_num_groups, mamba.mamba_state_dim) == (
        8,
        8,
        2,
        16,
    )
    assert (mamba.mamba_chunk_size, mamba.mamba_dt_clamp_min, mamba.mamba_dt_clamp_max) == (8, 0.02, None)


@pytest.mark.parametrize(
    ("limit", "clamps"), [(None, (0.0, None)), ([0.0, 1.0], (0.0, 1.0)), ((0.02, 0.5), (0.02, 0.5))]
)
def test_time_step_limit_maps_to_the_clamps(limit, clamps):
    _, mamba, _, _ = mamba2_configs(HF_CONFIG | {"time_step_limit": limit})
    assert (mamba.mamba_dt_clamp_min, mamba.mamba_dt_clamp_max) == clamps


def test_an_empty_time_step_limit_is_refused():
    with pytest.raises(ConfigError, match=r"need mamba_dt_clamp_min \(0.5\) < mamba_dt_clamp_max \(0.1\)"):
        mamba2_configs(HF_CONFIG | {"time_step_limit": [0.5, 0.1]})


@pytest.mark.parametrize(
    ("pattern", "config_changes", "match"),
    [
        ("M*", {}, "only Mamba layers"),
        ("MM", {"position_embedding_type": "learned_absolute"}, "position_embedding_type"),
        ("MM", {"normalization": "LayerNorm"}, "normalization='LayerNorm'"),
    ],
)
def test_inexpressible_models_fail_before_writing(
    pattern, config_changes, match, tmp_path, run_distributed, model_parallel
):
    target = tmp_path / "export"

    def body():
        groups = model_parallel(1)
        config = TransformerConfig(
            **(
                dict(
                    num_layers=2,
                    hidden_size=32,
                    num_attention_heads=4,
                    normalization="RMSNorm",
                    position_embedding_type="none",
                )
                | config_changes
            )
        )
        mamba = MambaConfig(mamba_num_heads=8, mamba_head_dim=8, mamba_num_groups=2, mamba_state_dim=16)
        model = HybridModel(config, VOCAB, pattern, mamba, pg_collection=groups)
        with pytest.raises(NotImplementedError, match=match):
            export_mamba2(model, target)

    run_distributed(body, 1, timeout=60)
    assert not target.exists()


def _serve_and_run(directory, ids, dtype):
    loaded = load_checkpoint_for_inference(directory, dtype=dtype)
    with torch.no_grad():
        logits = loaded.model(ids)
    facts = (type(loaded.model).__name__, loaded.source, next(loaded.model.parameters()).dtype)
    return logits.float(), facts, loaded.tokenizer.eod_id


def test_a_mamba2_directory_loads_for_serving(reference, tmp_path, run_distributed):
    """``load_checkpoint_for_inference`` (what ``mcore-serve`` loads with) takes a Hugging Face
    Mamba2 directory as a ``HybridModel``, with its tokenizer's end-of-document token the model's."""
    source, ids, expected = reference
    directory = tmp_path / "served"
    shutil.copytree(source, directory)
    texts = [d.text for d in itertools.islice(stdlib_documents(), 3)]
    tokenizer = train_bpe_tokenizer(texts, vocab_size=300)  # a BPE vocabulary holds at least 262
    tokenizer.save(directory / "tokenizer.json")
    ((logits, facts, eod),) = run_distributed(
        _serve_and_run, 1, directory, ids, torch.float32, init_process_group=False
    )
    assert facts == ("HybridModel", "huggingface", torch.float32) and eod == 4
    assert (logits - expected).abs().max().item() <= TOLERANCE
    ((logits, facts, _),) = run_distributed(
        _serve_and_run, 1, directory, ids, torch.bfloat16, init_process_group=False
    )
    assert facts[2] == torch.bfloat16 and (logits - expected).abs().max().item() <= 0.1
