"""RoPE settings to and from Hugging Face configs: partial rotation (``partial_rotary_factor`` <->
``rotary_percent``) maps only for families whose transformers model reads it; the others refuse
it rather than load or write a rotation transformers would ignore."""

import pytest
from mcore_models import TransformerConfig
from mcore_models.hf.rope_config import rope_from_hf, rope_to_hf

SHAPE = {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "position_embedding_type": "rope"}


@pytest.mark.parametrize(
    "hf",
    [
        {"partial_rotary_factor": 0.5},
        {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}},
    ],
)
def test_partial_rotation_is_read_where_the_family_reads_it(hf):
    assert rope_from_hf(hf, partial_rotary=True)["rotary_percent"] == 0.5
    with pytest.raises(NotImplementedError, match=r"partial_rotary_factor=0\.5"):
        rope_from_hf(hf)


def test_partial_rotation_is_written_where_the_family_reads_it():
    config = TransformerConfig(**SHAPE, rotary_percent=0.5)
    assert rope_to_hf(config, partial_rotary=True)["rope_parameters"]["partial_rotary_factor"] == 0.5
    with pytest.raises(ValueError, match=r"rotary_percent=0\.5 has no equivalent"):
        rope_to_hf(config)
    assert "partial_rotary_factor" not in rope_to_hf(TransformerConfig(**SHAPE))["rope_parameters"]
