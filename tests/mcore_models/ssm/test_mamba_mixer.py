"""MambaMixer against Hugging Face's Mamba2Mixer (TP 1 and 2), tensor-parallel exactness against the
single-process layer, prefill-then-step and an inference engine's paged steps against one full
forward (with and without an upper time-step clamp), its initialisation against seeded draws of
the same initialisers, and its errors."""

import dataclasses
import math

import pytest
import torch
import torch.distributed as dist
import transformers  # noqa: F401  (imported here so forked ranks inherit it)
from mcore_models.config.transformer_config import TransformerConfig
from mcore_models.ssm import MambaConfig, MambaMixer, blockwise_shard, blockwise_unshard
from mcore_models.transformer.inference_context import MambaStepLayout
from mcore_parallel import ConfigError, parse_dataclasses
from transformers.models.mamba2.configuration_mamba2 import Mamba2Config
from transformers.models.mamba2.modeling_mamba2 import Mamba2Mixer

HIDDEN, HEAD_DIM, STATE, GROUPS, CHUNK, KERNEL = 32, 8, 8, 2, 4, 4
HEADS = 2 * HIDDEN // HEAD_DIM  # mamba_expand 2
SEQ, BATCH = 11, 2
# Time steps clamped to [0.01, 0.03] (the default init draws them log-uniform in [0.001, 0.1]),
# with weights large enough for the scan, not the D skip, to dominate the output.
CLAMPED = {"mamba_dt_clamp_min": 0.01, "mamba_dt_clamp_max": 0.03, "init_method_std": 0.3}


MAMBA_FIELDS = {field.name for field in dataclasses.fields(MambaConfig)}


def _configs(**overrides) -> tuple[TransformerConfig, MambaConfig]:
    """The test's model and Mamba configs, each taking the ``overrides`` that are its fields."""
    model = {"num_layers": 2, "hidden_size": HIDDEN, "num_attention_heads": 4}
    mamba = {
        "mamba_head_dim": HEAD_DIM,
        "mamba_state_dim": STATE,
        "mamba_num_groups": GROUPS,
        "mamba_chunk_size": CHUNK,
        "mamba_conv_kernel": KERNEL,
    }
    for name, value in overrides.items():
        (mamba if name in MAMBA_FIELDS else model)[name] = value
    return TransformerConfig(**model), MambaConfig(**mamba)


def _mixer(tp_group: dist.ProcessGroup, **overrides) -> MambaMixer:
    config, mamba = _configs(**overrides)
    return MambaMixer(config, mamba, tp_group=tp_group)


def _shard(param: torch.Tensor, full: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """This rank's shard of ``full``, the TP=1 tensor of the local parameter ``param``."""
    if not getattr(param, "tensor_model_parallel", False):
        return full
    if hasattr(param, "partition_blocks"):
        return blockwise_shard(full, param.partition_blocks, rank, world_size)
    return full.chunk(world_size, param.partition_dim)[rank]


def _gather(param: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """The TP=1 tensor of ``local``, a shard laid out like ``param``, over the world (collective)."""
    if not getattr(param, "tensor_model_parallel", False):
        return local
    pieces = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(pieces, local.contiguous())
    if hasattr(param, "partition_blocks"):
        return blockwise_unshard(pieces, param.partition_blocks)
    return torch.cat(pieces, param.partition_dim)


def _hf_mixer(seed: int = 0) -> Mamba2Mixer:
    """A small HF Mamba2Mixer with every parameter random (D and the norm weight too)."""
    torch.manual_seed(seed)
    config = Mamba2Config(
        hidden_size=HIDDEN,
        num_heads=HEADS,
        head_dim=HEAD_DIM,
        expand=2,
        n_groups=GROUPS,
        state_size=STATE,
        conv_kernel=KERNEL,
        chunk_size=CHUNK,
        num_hidden_layers=1,
        layer_norm_epsilon=1e-5,
        use_bias=False,
        use_conv_bias=True,
    )
    mixer = Mamba2Mixer(config, layer_idx=0).eval()
    with torch.no_grad():
        for name in ("D", "norm.weight", "conv1d.bias"):
            mixer.get_parameter(name).copy_(1.0 + 0.5 * torch.randn_like(mixer.get_parameter(name)))
        mixer.A_log.add_(0.3 * torch.randn_like(mixer.A_log))
    return mixer


def _hf_parity():
    """HF's full weights, sharded into our mixer on each rank, give HF's output and input gradient."""
    hf = _hf_mixer()
    ours = _mixer(dist.group.WORLD)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    hf_state = hf.state_dict()
    params = dict(ours.named_parameters())
    assert sorted(params) == sorted(hf_state)  # the same names and full shapes
    with torch.no_grad():
        for name, param in params.items():
            param.copy_(_shard(param, hf_state[name], rank, world_size))
    x = torch.randn(BATCH, SEQ, HIDDEN, generator=torch.Generator().manual_seed(1))
    weights = torch.randn(BATCH, SEQ, HIDDEN, generator=torch.Generator().manual_seed(2))
    x_hf = x.clone().requires_grad_()
    expected = hf(x_hf)
    (expected * weights).sum().backward()
    x_ours = x.transpose(0, 1).clone().requires_grad_()  # ours is [s, b, h]
    actual = ours(x_ours)
    (actual * weights.transpose(0, 1)).sum().backward()
    torch.testing.assert_close(actual.transpose(0, 1), expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(x_ours.grad.transpose(0, 1), x_hf.grad, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("world_size", [1, 2])
def test_matches_hugging_face_mamba2_mixer(run_distributed, world_size):
    run_distributed(_hf_parity, world_size)


def _tensor_parallel_equals_single_process(sequence_parallel: bool, overrides: dict):
    rank = dist.get_rank()
    singles = [dist.new_group([r]) for r in range(dist.get_world_size())]
    torch.manual_seed(5)
    reference = _mixer(singles[rank], **overrides)
    torch.manual_seed(5)
    parallel = _mixer(
        dist.group.WORLD, tensor_model_parallel_size=2, sequence_parallel=sequence_parallel, **overrides
    )
    full_params = dict(reference.named_parameters())
    for name, param in parallel.named_parameters():
        assert param.tensor_model_parallel and param.partition_dim == (name == "out_proj.weight"), name
        assert torch.equal(param, _shard(param, full_params[name], rank, 2)), name
    seq = 12  # even, for sequence parallelism
    x = torch.randn(seq, BATCH, HIDDEN, generator=torch.Generator().manual_seed(3))
    weights = torch.randn(seq, BATCH, HIDDEN, generator=torch.Generator().manual_seed(4))
    x_ref = x.clone().requires_grad_()
    expected = reference(x_ref)
    (expected * weights).sum().backward()
    local = slice(rank * seq // 2, (rank + 1) * seq // 2) if sequence_parallel else slice(None)
    x_par = x[local].clone().requires_grad_()
    actual = parallel(x_par)
    (actual * weights[local]).sum().backward()
    torch.testing.assert_close(actual, expected[local], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(x_par.grad, x_ref.grad[local], atol=1e-6, rtol=1e-6)
    for name, param in parallel.named_parameters():
        torch.testing.assert_close(
            _gather(param, param.grad), full_params[name].grad, atol=1e-6, rtol=1e-6, msg=name
        )


@pytest.mark.parametrize(
    ("sequence_parallel", "overrides"),
    [(False, {}), (True, {}), (False, {"mamba_conv_init": 0.1, **CLAMPED})],
    ids=["plain", "sequence_parallel", "conv_init_and_clamps"],
)
def test_tensor_parallel_equals_single_process(run_distributed, sequence_parallel, overrides):
    """Each rank's parameters are its slices of the one-process layer's (the conv weight drawn by
    ``mamba_conv_init`` too), and the outputs and gradients agree."""
    run_distributed(_tensor_parallel_equals_single_process, 2, sequence_parallel, overrides)


def _prefill_then_step_equals_full_forward(**overrides):
    torch.manual_seed(0)
    mixer = _mixer(dist.group.WORLD, **overrides)
    x = torch.randn(SEQ, BATCH, HIDDEN, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = mixer(x)
        prompt = 5
        out, conv_state, ssm_state = mixer.prefill(x[:prompt])
        assert (tuple(conv_state.shape), tuple(ssm_state.shape)) == mixer.state_shapes(BATCH)
        outputs = [out]
        for t in range(prompt, SEQ):
            token = x[t] if t % 2 else x[t : t + 1]  # [b, h] and [1, b, h] both work
            out, conv_state, ssm_state = mixer.step(token, conv_state, ssm_state)
            assert out.shape == token.shape
            outputs.append(out.view(1, BATCH, HIDDEN))
        torch.testing.assert_close(torch.cat(outputs), full, atol=1e-5, rtol=1e-5)
        # prefill continues from given states: two halves equal the whole
        first, conv_state, ssm_state = mixer.prefill(x[:6])
        second, *_ = mixer.prefill(x[6:], conv_state, ssm_state)
        torch.testing.assert_close(torch.cat([first, second]), full, atol=1e-5, rtol=1e-5)
        zero_conv, zero_ssm = (torch.zeros(s) for s in mixer.state_shapes(BATCH))
        out, *_ = mixer.step(x[0], zero_conv, zero_ssm)
        torch.testing.assert_close(out, full[0], atol=1e-5, rtol=1e-5)


def _paged_forward_continues_each_slot(**overrides):
    """Two engine steps over three requests, their rows mixed (decodes not adjacent, a prompt cut
    in two), equal ``prefill`` of each request's whole sequence; unlisted slots stay untouched."""
    torch.manual_seed(0)
    mixer = _mixer(dist.group.WORLD, **overrides)
    x = torch.randn(3, 9, HIDDEN, generator=torch.Generator().manual_seed(1))  # request, token, h
    conv_shape, ssm_shape = mixer.state_shapes(4)
    conv_states, ssm_states = torch.zeros(conv_shape), torch.randn(ssm_shape)
    untouched = ssm_states[3].clone()
    steps = [  # per step: (request, slot, first token, tokens), in row order
        [(0, 2, 0, 5), (1, 0, 0, 3), (2, 1, 0, 1)],
        [(0, 2, 5, 1), (2, 1, 1, 1), (1, 0, 3, 6)],
    ]
    outputs = [[] for _ in range(3)]
    with torch.no_grad():
        for step in steps:
            ssm_states[[slot for _, slot, first, _ in step if first == 0]] = 0.0  # fresh requests
            row = torch.cat([x[r, first : first + n] for r, _, first, n in step]).unsqueeze(1)
            starts = [0, *torch.tensor([n for *_, n in step]).cumsum(0).tolist()]
            decodes = [i for i, (*_, n) in enumerate(step) if n == 1]
            layout = MambaStepLayout(
                torch.tensor([starts[i] for i in decodes]),
                torch.tensor([step[i][1] for i in decodes]),
                tuple((slice(starts[i], starts[i + 1]), step[i][1]) for i in range(3) if step[i][3] > 1),
            )
            out = mixer.paged_forward(row, conv_states, ssm_states, layout)
            for i, (request, *_) in enumerate(step):
                outputs[request].append(out[starts[i] : starts[i + 1]])
        for request, length in enumerate((6, 9, 2)):
            expected = mixer(x[request, :length].unsqueeze(1))
            torch.testing.assert_close(torch.cat(outputs[request]), expected, atol=1e-5, rtol=1e-5)
        assert torch.equal(ssm_states[3], untouched)
        with pytest.raises(ValueError, match=r"one flattened row \[t, 1, h\]"):
            mixer.paged_forward(x[:, :2].transpose(0, 1), conv_states, ssm_states, layout)


def _decoding_paths_equal_full_forward():
    for overrides in ({}, CLAMPED):  # the clamps apply in the scan, prefill, step and paged paths
        _prefill_then_step_equals_full_forward(**overrides)
        _paged_forward_continues_each_slot(**overrides)
    x = torch.randn(SEQ, BATCH, HIDDEN, generator=torch.Generator().manual_seed(1))
    outputs = []
    lower_only = {name: value for name, value in CLAMPED.items() if name != "mamba_dt_clamp_max"}
    for overrides in ({"init_method_std": CLAMPED["init_method_std"]}, lower_only, CLAMPED):
        torch.manual_seed(0)
        with torch.no_grad():
            outputs.append(_mixer(dist.group.WORLD, **overrides)(x))
    # the clamps change the output, the upper one on its own too: the checks above are not vacuous
    assert (outputs[1] - outputs[0]).abs().max() > 1e-2 and (outputs[2] - outputs[1]).abs().max() > 1e-2


def test_prefill_step_and_paged_forward_equal_full_forward(run_distributed):
    run_distributed(_decoding_paths_equal_full_forward, 1)


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"mamba_head_dim": 12}, r"mamba_expand, hidden_size, mamba_head_dim: .*\(64\).*\(12\)"),
        ({"mamba_num_heads": 5}, r"mamba_num_heads, mamba_num_groups: .*\(5\).*\(2\)"),
        ({"mamba_num_groups": 3}, r"mamba_num_heads, mamba_num_groups: .*\(8\).*\(3\)"),
    ],
)
def test_mamba_shape_errors_name_the_fields(overrides, match):
    with pytest.raises(ConfigError, match=match):
        _configs(**overrides)[1].heads(HIDDEN)


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"mamba_dt_min": 0.2}, r"mamba_dt_min, mamba_dt_max: need 0 < mamba_dt_min \(0.2\) <= mamba_dt_max"),
        ({"mamba_dt_min": 0.0}, r"mamba_dt_min, mamba_dt_max"),
        ({"mamba_a_init_min": 20.0}, r"mamba_a_init_min, mamba_a_init_max: need 0 <"),
        ({"mamba_state_dim": 0}, r"mamba_state_dim: must be >= 1"),
        ({"mamba_conv_init": 0.0}, r"mamba_conv_init: must be a finite number > 0 or None, got 0.0"),
        ({"mamba_conv_init": -0.1}, r"mamba_conv_init: must be a finite number > 0 or None, got -0.1"),
        ({"mamba_conv_init": math.inf}, r"mamba_conv_init: .* got inf"),
        ({"mamba_conv_init": "0.1"}, r"mamba_conv_init: .* got '0.1'"),
        ({"mamba_dt_clamp_max": math.nan}, r"mamba_dt_clamp_max: .* got nan"),
        ({"mamba_dt_clamp_max": math.inf}, r"mamba_dt_clamp_max: .* got inf"),
        ({"mamba_dt_clamp_max": 0.0}, r"mamba_dt_clamp_max: .* got 0.0"),
        (
            {"mamba_dt_clamp_min": 0.05, "mamba_dt_clamp_max": 0.05},
            r"mamba_dt_clamp_min, mamba_dt_clamp_max: need mamba_dt_clamp_min \(0.05\) < mamba_dt_clamp_max",
        ),
    ],
)
def test_mamba_config_errors_name_the_fields(overrides, match):
    with pytest.raises(ConfigError, match=match):
        _configs(**overrides)


def test_heads_come_from_num_heads_or_from_expand():
    with pytest.raises(ConfigError, match="mamba_head_dim"):
        MambaConfig().heads(24)  # the default inner width 48 does not split into heads of 64
    assert _configs()[1].heads(HIDDEN) == HEADS
    assert _configs(mamba_num_heads=4)[1].heads(HIDDEN) == 4


def _errors():
    world = dist.group.WORLD
    with pytest.raises(
        ValueError, match=r"the Mamba heads \(3\) must be divisible by the tensor-parallel size \(2\)"
    ):
        _mixer(world, mamba_num_heads=3, mamba_num_groups=1)
    with pytest.raises(
        ValueError, match=r"mamba_num_groups \(1\) must be divisible by the tensor-parallel size \(2\)"
    ):
        _mixer(world, mamba_num_groups=1)
    with pytest.raises(ConfigError, match="mamba_num_heads, mamba_num_groups"):
        _mixer(world, mamba_num_groups=3)
    mixer = _mixer(world)
    conv, ssm = (torch.zeros(s) for s in mixer.state_shapes(BATCH))
    with pytest.raises(
        ValueError, match=r"hidden_states must have shape \[s, b, h\] with h = hidden_size \(32\)"
    ):
        mixer(torch.zeros(SEQ, BATCH, HIDDEN + 1))
    with pytest.raises(ValueError, match=r"hidden_states must have shape \[b, h\] or \[1, b, h\]"):
        mixer.step(torch.zeros(2, BATCH, HIDDEN), conv, ssm)
    with pytest.raises(ValueError, match="conv_state must have shape"):
        mixer.step(torch.zeros(BATCH, HIDDEN), conv[:1], ssm)
    sp_mixer = _mixer(world, tensor_model_parallel_size=2, sequence_parallel=True)
    with pytest.raises(ValueError, match="step needs sequence_parallel off"):
        sp_mixer.step(torch.zeros(BATCH, HIDDEN), conv, ssm)


def test_tensor_parallel_and_input_errors(run_distributed):
    run_distributed(_errors, 2)


def _seeded_conv_draws(seed: int, conv_init: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The conv weight and bias a TP = 1 mixer built right after ``torch.manual_seed(seed)`` holds,
    drawn here in the mixer's order from the default generator: ``in_proj``'s master
    ``[z; x; B; C; dt]`` (normal, ``init_method_std``), then the conv weight ``[x; B; C]``
    (``torch.nn.Conv1d``'s ``kaiming_uniform_(a=sqrt(5))``, or uniform in ``±conv_init``), then
    the conv bias (``torch.nn.Conv1d``'s, uniform in ``±1/sqrt(kernel)``, either way)."""
    config, _ = _configs()
    inner, bc = HEADS * HEAD_DIM, GROUPS * STATE
    torch.manual_seed(seed)
    torch.nn.init.normal_(torch.empty(2 * inner + 2 * bc + HEADS, HIDDEN), std=config.init_method_std)
    weight = torch.empty(inner + 2 * bc, 1, KERNEL)
    if conv_init is None:
        torch.nn.init.kaiming_uniform_(weight, a=math.sqrt(5))
    else:
        torch.nn.init.uniform_(weight, -conv_init, conv_init)
    bias = torch.empty(inner + 2 * bc).uniform_(-1 / math.sqrt(KERNEL), 1 / math.sqrt(KERNEL))
    return weight, bias


def _initialisation_follows_the_config():
    for conv_init in (None, 0.1):
        torch.manual_seed(7)
        mixer = _mixer(dist.group.WORLD, mamba_conv_init=conv_init)
        weight, bias = _seeded_conv_draws(7, conv_init)
        assert torch.equal(mixer.conv1d.weight.detach(), weight), f"conv weight, mamba_conv_init={conv_init}"
        assert torch.equal(mixer.conv1d.bias.detach(), bias), f"conv bias, mamba_conv_init={conv_init}"
    assert 0.09 < weight.abs().max() <= 0.1  # inside ±conv_init, not kaiming's ±1/sqrt(4) = ±0.5
    mixer = _mixer(
        dist.group.WORLD, mamba_dt_min=0.01, mamba_dt_max=0.05, mamba_a_init_min=2.0, mamba_a_init_max=3.0
    )
    dt = torch.nn.functional.softplus(mixer.dt_bias.detach())
    assert dt.min() >= 0.01 * (1 - 1e-5) and dt.max() <= 0.05 * (1 + 1e-5)
    a = mixer.A_log.detach().exp()
    assert a.min() >= 2.0 and a.max() <= 3.0
    assert torch.equal(mixer.D, torch.ones(HEADS)) and torch.equal(mixer.norm.weight, torch.ones(2 * HIDDEN))
    floored = _mixer(dist.group.WORLD, mamba_dt_min=1e-6, mamba_dt_max=2e-6)
    default_floor = 1e-4
    torch.testing.assert_close(
        torch.nn.functional.softplus(floored.dt_bias.detach()), torch.full((HEADS,), default_floor)
    )


def test_initialisation_follows_the_config(run_distributed):
    run_distributed(_initialisation_follows_the_config, 1)


def test_blockwise_shard_takes_each_blocks_slice_and_unshard_inverts_it():
    full = torch.arange(12).view(12, 1)  # blocks [0..5], [6, 7], [8..11]
    shards = [blockwise_shard(full, (6, 2, 4), rank, 2) for rank in range(2)]
    assert shards[0].flatten().tolist() == [0, 1, 2, 6, 8, 9]
    assert shards[1].flatten().tolist() == [3, 4, 5, 7, 10, 11]
    assert torch.equal(blockwise_unshard(shards, (6, 2, 4)), full)
    with pytest.raises(
        ValueError,
        match=r"block sizes \[6, 3, 3\] must add up .* divisible by the tensor-parallel size \(2\)",
    ):
        blockwise_shard(full, (6, 3, 3), 0, 2)


def test_mamba_config_fields_are_command_line_options():
    args = [
        "--num-layers",
        "1",
        "--hidden-size",
        "32",
        "--num-attention-heads",
        "4",
        "--mamba-num-heads",
        "4",
    ]
    args += ["--mamba-head-dim", "16", "--mamba-num-groups", "2", "--mamba-dt-max", "0.2"]
    config, mamba = parse_dataclasses([TransformerConfig, MambaConfig], args)
    assert (mamba.heads(config.hidden_size), mamba.mamba_head_dim, mamba.mamba_dt_max) == (4, 16, 0.2)
    assert (mamba.mamba_conv_init, mamba.mamba_dt_clamp_max) == (None, None)
    args += ["--mamba-conv-init", "0.05", "--mamba-dt-clamp-max", "0.5"]
    _, mamba = parse_dataclasses([TransformerConfig, MambaConfig], args)
    assert (mamba.mamba_conv_init, mamba.mamba_dt_clamp_max) == (0.05, 0.5)
    with pytest.raises(ConfigError, match="mamba_conv_init: must be a finite number > 0"):
        parse_dataclasses([TransformerConfig, MambaConfig], [*args, "--mamba-conv-init", "0"])
