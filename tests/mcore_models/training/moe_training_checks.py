"""What the MoE training tests compare: a run's losses and final weights against an oracle run's."""

import torch

MOE = dict(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=16, moe_aux_loss_coeff=0.01)


def train_losses(report) -> torch.Tensor:
    """The training loss of every iteration of a ``pretrain`` report."""
    return torch.tensor([loss for _, loss in report["history"]["train"]])


def final_checkpoint(report) -> dict[str, torch.Tensor]:
    """Every model tensor of the run's final checkpoint, whole (read on this one process); an
    FSDP checkpoint's nested ``model`` dict is flattened to the same ``model.<name>`` keys."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.format_utils import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    state: dict = {}
    _load_state_dict(
        state,
        storage_reader=FileSystemReader(report["checkpoint"]),
        planner=_EmptyStateDictLoadPlanner(),
        no_dist=True,
    )
    nested = state.pop("model", {})
    state |= {f"model.{name}": value for name, value in nested.items()}
    return {k: v for k, v in state.items() if k.startswith("model.")}


def assert_same_training(report, oracle) -> None:
    """Equal losses (rtol 1e-4) that moved, and equal final weights but for a few rounding-level Adam steps."""
    torch.testing.assert_close(train_losses(report), train_losses(oracle), rtol=1e-4, atol=0)
    assert len(set(train_losses(report).tolist())) == len(report["history"]["train"])  # it did train
    params, expected = final_checkpoint(report), final_checkpoint(oracle)
    assert params.keys() == expected.keys()
    assert any(".local_experts.3." in k or ".experts.weight1" in k for k in params)
    for key in expected:
        # Adam divides by the gradient's size: where a gradient is at rounding level, the other
        # reduction order can move that one weight by a sizeable share of a step (lr 1e-2, 3 steps).
        # A few such weights are allowed; a wrong reduction moves most weights, and the losses.
        diff = (params[key] - expected[key]).abs()
        outside = diff > 1e-5 + 1e-4 * expected[key].abs()
        assert outside.float().mean() <= 0.01, f"{key}: {int(outside.sum())} of {diff.numel()} weights differ"
        assert diff.max() <= 3e-2, f"{key}: a weight moved {float(diff.max())} (more than 3 Adam steps)"
