"""``mcore-serve``'s check of ``--tensor-parallel-size`` against an mcore-train model (the Hugging
Face rules are tested through the command): it must divide the KV heads (no replication for
mcore-train checkpoints, as ``load_checkpoint_for_inference`` loads them) and the vocabulary rows;
the error names ``tensor_parallel_size`` and the model's field at fault."""

from pathlib import Path

import pytest
from mcore_models import InferenceCheckpoint
from mcore_parallel import ConfigError


@pytest.mark.parametrize(
    "tp, fault",
    [
        (1, None),
        (2, None),
        (4, "num_query_groups"),
        (3, "vocabulary: 128 embedding rows do not split evenly"),
    ],
)
def test_mcore_train_model_tensor_parallel_sizes(make_model, tp, fault):
    from mcore_inference.serve_cli.startup import check_tensor_parallel_size

    model = make_model()  # 4 heads, 2 query groups, 128 vocabulary rows
    assert (model.config.num_query_groups, model.padded_vocab_size) == (2, 128)
    loaded = InferenceCheckpoint(model, model.config, None, "mcore-train", Path("ckpt"))
    if fault is None:
        check_tensor_parallel_size(loaded, tp)
        return
    with pytest.raises(
        ConfigError, match=rf"^tensor_parallel_size: {tp} ranks cannot split the model of ckpt: .*{fault}"
    ):
        check_tensor_parallel_size(loaded, tp)
