"""mcore-rl tests: a module that loads a model for the engine leaves no default process group
behind (``load_checkpoint_for_inference`` starts a one-process one), so ranks forked later by
``run_distributed`` start clean."""

import pytest
import torch.distributed as dist


@pytest.fixture(autouse=True, scope="module")
def _no_process_group_left_behind():
    had_group = dist.is_available() and dist.is_initialized()
    yield
    if not had_group and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
