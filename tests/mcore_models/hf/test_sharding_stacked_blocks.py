"""``hf.sharding`` on a Mamba mixer, whose ``in_proj`` and conv parameters stack blocks of unequal
sizes (``partition_blocks``): the gathered TP=2 state dict is the one-process mixer's, and loading
it into a fresh TP=2 mixer gives back each rank's shards."""

import torch
import torch.distributed as dist
from mcore_models.config.transformer_config import TransformerConfig
from mcore_models.hf.sharding import gather_full_state_dict, load_full_state_dict
from mcore_models.ssm import MambaConfig, MambaMixer


def _mixer(tp_group, tp_size: int) -> MambaMixer:
    config = TransformerConfig(
        num_layers=1, hidden_size=16, num_attention_heads=2, tensor_model_parallel_size=tp_size
    )
    mamba = MambaConfig(mamba_head_dim=8, mamba_state_dim=4, mamba_num_groups=2, mamba_chunk_size=4)
    return MambaMixer(config, mamba, tp_group=tp_group)


def _gather_and_load():
    single = dist.new_group([dist.get_rank()])
    torch.manual_seed(3)
    whole = _mixer(single, 1)
    torch.manual_seed(3)
    parallel = _mixer(dist.group.WORLD, 2)
    assert hasattr(parallel.in_proj.weight, "partition_blocks")
    full = gather_full_state_dict(parallel, dist.group.WORLD)
    expected = whole.state_dict()
    assert sorted(full) == sorted(expected)
    for name, tensor in expected.items():
        assert torch.equal(full[name], tensor), name
    torch.manual_seed(9)  # other weights, overwritten by the load
    fresh = _mixer(dist.group.WORLD, 2)
    load_full_state_dict(fresh, full, dist.group.WORLD)
    for (name, loaded), original in zip(
        fresh.state_dict().items(), parallel.state_dict().values(), strict=True
    ):
        assert torch.equal(loaded, original), name


def test_stacked_blocks_gather_and_load_across_tensor_parallel_sizes(run_distributed):
    run_distributed(_gather_and_load, 2)
