"""Backends without fused collectives: the fallbacks give the same training as the native path."""

import copy

import torch
import torch.distributed as dist
from mcore_fsdp import MixedPrecision, count_collectives, fully_shard


def _refuse(*args, **kwargs):
    raise RuntimeError("this collective is not supported by the backend")


def test_fallbacks_match_native_collectives(run_distributed, tiny):
    def body():
        rank, world = dist.get_rank(), dist.get_world_size()
        torch.manual_seed(0)
        base = tiny.Net()

        def train(accumulate_fp32: bool):
            precision = MixedPrecision(
                reduce_dtype=torch.bfloat16, fp32_accumulate_reduce_scatter=accumulate_fp32
            )
            model = fully_shard(copy.deepcopy(base), unit_classes=(tiny.Block,), precision=precision)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            with count_collectives() as counter:
                for step in range(2):
                    inputs, targets = tiny.batch(step, world)
                    tiny.loss(
                        model(tiny.local(inputs, rank, world)), tiny.local(targets, rank, world)
                    ).backward()
                    optimizer.step()
                    optimizer.zero_grad()
            return model.full_state_dict(), dict(counter)

        native = [train(False), train(True)]
        dist.all_gather_into_tensor = dist.reduce_scatter_tensor = dist.all_to_all_single = _refuse
        fallback = [train(False), train(True)]
        for (native_params, native_counts), (fallback_params, fallback_counts) in zip(
            native, fallback, strict=True
        ):
            assert native_counts == fallback_counts
            for key, value in native_params.items():
                torch.testing.assert_close(fallback_params[key], value, rtol=0, atol=0)
        return native[1][1]

    counts = run_distributed(body, 2)[0]
    assert counts["all_to_all"] == 2 * 4  # the FP32-accumulating path: one per unit and step
