"""bos/eos/pad ids survive Hugging Face import and export, for every supported family.

Oracle: ``transformers`` itself. What ``AutoConfig`` / ``GenerationConfig.from_pretrained`` read
from the original checkpoint is what the imported model carries and what they read back from
the exported one.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
import transformers
from mcore_models.hf import export_hf_checkpoint, import_hf_checkpoint

_LLAMA_LIKE = dict(
    vocab_size=64,
    hidden_size=16,
    intermediate_size=32,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
)
FAMILIES = {
    "llama": ("LlamaConfig", _LLAMA_LIKE),
    "qwen2": ("Qwen2Config", _LLAMA_LIKE),
    "qwen3": ("Qwen3Config", _LLAMA_LIKE | {"head_dim": 8}),
    "mistral": ("MistralConfig", _LLAMA_LIKE),
    "gpt2": ("GPT2Config", {"vocab_size": 64, "n_embd": 16, "n_layer": 1, "n_head": 2, "n_positions": 32}),
}
KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")


@pytest.fixture
def groups():
    from mcore_parallel import ProcessGroupCollection

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield ProcessGroupCollection(tp=dist.new_group([0]))
    dist.destroy_process_group()


def _save_hf(family, directory, **ids):
    config_class, kwargs = FAMILIES[family]
    config = getattr(transformers, config_class)(**kwargs, **ids)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(directory)


def _hf_ids(directory, source):
    loaded = source.from_pretrained(directory)
    return tuple(getattr(loaded, key) for key in KEYS)


def _model_ids(model):
    eos = list(model.eos_token_ids)
    return model.bos_token_id, eos[0] if len(eos) == 1 else eos or None, model.pad_token_id


@pytest.mark.parametrize("eos", [7, [7, 11]], ids=["one-eos", "eos-list"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_special_tokens_round_trip(family, eos, groups, tmp_path):
    _save_hf(family, tmp_path / "hf", bos_token_id=5, eos_token_id=eos, pad_token_id=9)
    expected = (5, eos, 9)
    assert _hf_ids(tmp_path / "hf", transformers.AutoConfig) == expected
    model = import_hf_checkpoint(tmp_path / "hf", pg_collection=groups)
    assert _model_ids(model) == expected
    export_hf_checkpoint(model, tmp_path / "exported")
    for source in (transformers.AutoConfig, transformers.GenerationConfig):
        assert _hf_ids(tmp_path / "exported", source) == expected
    assert _model_ids(import_hf_checkpoint(tmp_path / "exported", pg_collection=groups)) == expected


def test_exported_llama_reloads_in_transformers_with_its_ids(groups, tmp_path):
    _save_hf("llama", tmp_path / "hf", bos_token_id=5, eos_token_id=7, pad_token_id=9)
    export_hf_checkpoint(import_hf_checkpoint(tmp_path / "hf", pg_collection=groups), tmp_path / "exported")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "exported")
    assert isinstance(reloaded, transformers.LlamaForCausalLM)
    for config in (reloaded.config, reloaded.generation_config):
        assert tuple(getattr(config, key) for key in KEYS) == (5, 7, 9)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_ids_missing_from_config_are_the_family_defaults(family, groups, tmp_path):
    _save_hf(family, tmp_path)
    (tmp_path / "generation_config.json").unlink()
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k not in KEYS}))
    model = import_hf_checkpoint(tmp_path, pg_collection=groups)
    assert _model_ids(model) == _hf_ids(tmp_path, transformers.AutoConfig)


def test_generation_config_wins_over_config(groups, tmp_path):
    _save_hf("llama", tmp_path, bos_token_id=5, eos_token_id=7, pad_token_id=9)
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"eos_token_id": [7, 12], "pad_token_id": None})
    )
    model = import_hf_checkpoint(tmp_path, pg_collection=groups)
    generation = transformers.GenerationConfig.from_pretrained(tmp_path)
    assert _model_ids(model) == (5, generation.eos_token_id, generation.pad_token_id) == (5, [7, 12], None)


def test_no_special_tokens_are_written_as_none(groups, tmp_path):
    from mcore_models import GPTModel, TransformerConfig

    config = TransformerConfig(
        num_layers=1,
        hidden_size=16,
        num_attention_heads=2,
        ffn_hidden_size=32,
        normalization="RMSNorm",
        activation="swiglu",
        position_embedding_type="rope",
    )
    export_hf_checkpoint(GPTModel(config, 64, pg_collection=groups), tmp_path, model_type="llama")
    for source in (transformers.AutoConfig, transformers.GenerationConfig):
        assert _hf_ids(tmp_path, source) == (None, None, None)


@pytest.mark.parametrize(
    "file, value",
    [
        ("config.json", "7"),
        ("config.json", -1),
        ("config.json", True),
        ("generation_config.json", [7, None]),
        ("generation_config.json", 7.0),
    ],
)
def test_invalid_ids_are_refused_naming_file_and_key(file, value, groups, tmp_path):
    _save_hf("llama", tmp_path)
    if file == "config.json":  # else generation_config.json's valid id would win
        (tmp_path / "generation_config.json").unlink()
    contents = json.loads((tmp_path / file).read_text())
    (tmp_path / file).write_text(json.dumps(contents | {"eos_token_id": value}))
    with pytest.raises(ValueError, match=f"{file} eos_token_id must be"):
        import_hf_checkpoint(tmp_path, pg_collection=groups)
