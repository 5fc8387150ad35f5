"""``GRPOLoop`` with ``fsdp``: the policy sharded by mcore-fsdp over 2 gloo data-parallel ranks.

Oracles: the same two iterations on one rank with DDP (rollouts, rewards, loss and, within
float32 rounding, the weights gathered from the shards; one iteration under each of the other
sharding strategies too); after an iteration the engine holds exactly the gathered weights and its
log-probabilities equal those of an unsharded ``GPTModel`` loaded with them; a
loop resumed from the checkpoint of iteration 1 (other initial weights) runs iteration 2 exactly
as the uninterrupted one; checkpoints move between DDP and FSDP. The runs use several packed
bins per rank and forward (``no_sync`` accumulation before the last chunk), two optimizer steps
per iteration, a KL reference and the optimizer offload option. Combinations that cannot work
are refused with ``ConfigError`` naming the fields."""

import dataclasses
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from mcore_inference import SamplingParams
from mcore_models import GPTModel, state_tensors
from mcore_parallel import ConfigError, destroy_model_parallel, initialize_model_parallel
from mcore_rl.cli import parse_rl_args
from mcore_rl.loop import CharTokenizer, GRPOLoop, GRPOLoopConfig, load_checkpoint, save_checkpoint
from mcore_testing.distributed import run_distributed

sys.path.insert(0, str(Path(__file__).parent))
from test_loop import FAST, TINY, VariedRewards, build_loop

# bins of 16 tokens hold one or two sums each: several bins per rank, two per forward, so each
# optimizer step accumulates chunks under no_sync before the last one reduces
OPTIONS = dict(
    beta=0.05,
    bin_length=16,
    max_sequence_length=16,
    bins_per_forward=2,
    minibatches=2,
    optimizer_cpu_offload=True,
)
SAME = ("train_reward", "trained_sequences", "trained_tokens", "optimizer_steps", "weight_version")
CLOSE = ("loss", "kl", "grad_norm", "clip_fraction")
PROMPT = "12+34=579"


@pytest.fixture(scope="module")
def needs_fsdp():
    pytest.importorskip("mcore_fsdp", reason="the fsdp extra (mcore-fsdp) is not installed")


def _loop(seed=0, **config):
    return build_loop(agent=VariedRewards(200, 20, max_digits=2), seed=seed, **(OPTIONS | config))


def _record(record):
    return {k: record[k] for k in SAME + CLOSE}


def _engine_and_model_logprobs(engine, model):
    """Prompt log-probabilities of ``PROMPT`` under the engine and under ``model`` (unsharded)."""
    prompt = CharTokenizer().encode(PROMPT)
    params = SamplingParams(temperature=0.0, num_tokens_to_generate=1, prompt_logprobs=True, ignore_eos=True)
    (request,) = engine.generate([prompt], params)
    with torch.no_grad():
        logits = model(torch.tensor([prompt]))[0, :, : model.vocab_size].float()
    expected = torch.log_softmax(logits[:-1], -1).gather(1, torch.tensor(prompt[1:])[:, None]).squeeze(1)
    return torch.tensor(request.prompt_logprobs[1:]), expected


def _counting_no_sync(loop):
    """Count the backwards ``loop``'s sharded policy runs under ``no_sync``."""
    calls, no_sync = [0], loop.model.no_sync

    def counted():
        calls[0] += 1
        return no_sync()

    loop.model.no_sync = counted
    return calls


def _fsdp_run(directory):
    """Two FSDP iterations, a checkpoint after the first; the engine against the gathered
    weights; a fresh loop (other initial weights) resumed from the checkpoint runs the second."""
    loop = _loop(fsdp=True)
    no_sync = _counting_no_sync(loop)
    first = loop.step()
    save_checkpoint(loop, directory)
    second = loop.step()
    weights = loop.policy_state_dict()  # gathered on every rank
    engine_tensors = {name: t.detach().clone() for name, t in state_tensors(loop.engine.model).items()}
    plain = GPTModel(TINY.transformer_config(), CharTokenizer().vocab_size, pg_collection=loop.groups)
    plain.load_state_dict(weights)
    engine_logprobs, model_logprobs = _engine_and_model_logprobs(loop.engine, plain.eval())
    shard_shapes = {tuple(p.shape) for p in loop.policy.parameters()}

    resumed = _loop(seed=7, fsdp=True)
    start = load_checkpoint(resumed, directory)
    again = resumed.step()
    return dict(
        records=[_record(first), _record(second)],
        weights=weights,
        engine_tensors=engine_tensors,
        logprobs=(engine_logprobs, model_logprobs),
        shard_shapes=shard_shapes,
        no_sync=no_sync[0],
        resumed=dict(
            start=start,
            record=_record(again),
            weights=resumed.policy_state_dict(),
            steps=resumed.optimizer.step_count,
            position=resumed.prompts.position,
        ),
    )


def _ddp_run(directory, fsdp_directory):
    """The same two iterations on one rank with DDP, a checkpoint after the first; a DDP loop
    resumed from the FSDP run's checkpoint runs the second."""
    loop = _loop()
    initial = {name: t.clone() for name, t in loop.policy_state_dict().items()}
    first = loop.step()
    save_checkpoint(loop, directory)
    second = loop.step()
    weights = loop.policy_state_dict()
    resumed = _loop(seed=7)
    load_checkpoint(resumed, fsdp_directory)
    again = resumed.step()
    return dict(
        records=[_record(first), _record(second)],
        weights=weights,
        moved=max(float((weights[name] - value).abs().max()) for name, value in initial.items()),
        from_fsdp=dict(record=_record(again), weights=resumed.policy_state_dict()),
    )


def _resume_fsdp_from(directory):
    """An FSDP loop (other initial weights) resumed from a DDP checkpoint runs the next iteration."""
    loop = _loop(seed=7, fsdp=True)
    start = load_checkpoint(loop, directory)
    record = loop.step()
    return dict(start=start, record=_record(record), weights=loop.policy_state_dict())


@pytest.fixture(scope="module")
def runs(needs_fsdp, tmp_path_factory):
    """The FSDP run on 2 ranks, the DDP run on 1 rank, and an FSDP resume from the DDP checkpoint."""
    root = tmp_path_factory.mktemp("fsdp-loop")
    fsdp_dir, ddp_dir = str(root / "fsdp"), str(root / "ddp")
    fsdp = run_distributed(_fsdp_run, 2, fsdp_dir, timeout=180)
    (ddp,) = run_distributed(_ddp_run, 1, ddp_dir, fsdp_dir, timeout=180)
    from_ddp = run_distributed(_resume_fsdp_from, 2, ddp_dir, timeout=120)
    return dict(fsdp=fsdp, ddp=ddp, from_ddp=from_ddp, ddp_dir=ddp_dir)


def assert_same_iteration(got, expected):
    """Two runs of one iteration: the same rollouts (rewards, counts), steps and refits; the
    loss and its metrics within float32 rounding of a sum split over the ranks."""
    for key in SAME:
        assert got[key] == expected[key], key
    for key in CLOSE:
        torch.testing.assert_close(got[key], expected[key], rtol=1e-5, atol=1e-6, msg=key)


def assert_same_weights(got, expected):
    # Adam moves each weight by about lr (1e-2) per step whatever its gradient's size, so float32
    # rounding in gradients near 0 (other reduction orders and matmul shapes on two ranks) shows
    # up as ~1e-6 after the four steps; a wrong gradient (scale, a missed chunk) moves weights by lr
    assert got.keys() == expected.keys()
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.distributed
def test_two_fsdp_ranks_equal_one_ddp_rank(runs):
    ddp = runs["ddp"]
    for rank in runs["fsdp"]:
        assert rank["no_sync"] > 0  # chunks were accumulated locally before the last one reduced
        assert all(len(shape) == 1 for shape in rank["shard_shapes"])  # the policy's parameters are shards
        for got, expected in zip(rank["records"], ddp["records"], strict=True):
            assert expected["trained_sequences"] > 0 and expected["optimizer_steps"] == 2
            assert_same_iteration(got, expected)
        assert_same_weights(rank["weights"], ddp["weights"])
    assert ddp["moved"] > 1e-3  # the weights compared did train


@pytest.mark.distributed
def test_engine_after_an_fsdp_iteration_equals_the_gathered_policy(runs):
    for rank in runs["fsdp"]:
        assert rank["records"][-1]["weight_version"] == 2
        for name, value in rank["weights"].items():
            assert torch.equal(rank["engine_tensors"][name], value), name
        engine, model = rank["logprobs"]
        torch.testing.assert_close(engine, model, atol=1e-5, rtol=1e-5)


@pytest.mark.distributed
def test_fsdp_resume_from_iteration_one_equals_the_uninterrupted_run(runs):
    for rank in runs["fsdp"]:
        resumed = rank["resumed"]
        assert resumed["start"] == 1 and resumed["steps"] == 4 and resumed["position"] == 2 * 4
        # the same ranks, collectives and state: bit for bit
        assert resumed["record"] == rank["records"][1]
        for name, value in rank["weights"].items():
            assert torch.equal(resumed["weights"][name], value), name


def _one_iteration_per_strategy():
    weights = {}
    for strategy in ("no_shard", "optim", "optim_grads"):
        loop = _loop(fsdp=True, fsdp_strategy=strategy)
        loop.step()
        weights[strategy] = loop.policy_state_dict()
    return weights


@pytest.mark.distributed
def test_the_other_sharding_strategies_train_as_ddp(runs):
    # the DDP run's policy after iteration 1, from its checkpoint
    expected = torch.load(Path(runs["ddp_dir"]) / "rl_state.pt", weights_only=False)["policy"]
    for rank in run_distributed(_one_iteration_per_strategy, 2, timeout=120):
        for weights in rank.values():
            assert_same_weights(weights, expected)


@pytest.mark.distributed
def test_checkpoints_move_between_ddp_and_fsdp(runs):
    ddp = runs["ddp"]
    # a DDP loop resumed from the FSDP checkpoint continues as the uninterrupted DDP run
    assert_same_iteration(ddp["from_fsdp"]["record"], ddp["records"][1])
    assert_same_weights(ddp["from_fsdp"]["weights"], ddp["weights"])
    # and 2 FSDP ranks resumed from the DDP checkpoint as well
    for rank in runs["from_ddp"]:
        assert rank["start"] == 1
        assert_same_iteration(rank["record"], ddp["records"][1])
        assert_same_weights(rank["weights"], ddp["weights"])


def test_the_command_line_turns_fsdp_on(needs_fsdp):
    configs = parse_rl_args(["--fsdp", "--fsdp-strategy", "optim"])
    assert configs.grpo.fsdp and configs.grpo.fsdp_strategy == "optim"
    assert not parse_rl_args([]).grpo.fsdp


def test_fsdp_with_the_distributed_optimizer_is_refused():
    with pytest.raises(
        ConfigError, match="fsdp, distributed_optimizer: fsdp shards the optimizer state"
    ) as error:
        GRPOLoopConfig(**FAST, fsdp=True, distributed_optimizer=True)
    assert error.value.fields == ("fsdp", "distributed_optimizer")


def test_fsdp_without_mcore_fsdp_is_refused(monkeypatch):
    monkeypatch.setitem(sys.modules, "mcore_fsdp", None)  # import mcore_fsdp now fails
    with pytest.raises(ConfigError, match=r"pip install 'mcore-rl\[fsdp\]'") as error:
        GRPOLoopConfig(**FAST, fsdp=True)
    assert error.value.fields == ("fsdp",)
    GRPOLoopConfig(**FAST)  # without fsdp nothing imports it


def _tensor_parallel_policy():
    destroy_model_parallel()
    groups = initialize_model_parallel(tensor_model_parallel_size=2)
    config = dataclasses.replace(TINY.transformer_config(), tensor_model_parallel_size=2)
    policy = GPTModel(config, CharTokenizer().vocab_size, pg_collection=groups)
    try:
        GRPOLoop(policy, VariedRewards(200, 20), CharTokenizer(), GRPOLoopConfig(**FAST, fsdp=True), groups)
    except ConfigError as error:
        return error.fields, str(error), dist.get_world_size(groups.tp)
    return None


@pytest.mark.distributed
def test_fsdp_with_tensor_parallelism_is_refused(needs_fsdp):
    for fields, message, tp in run_distributed(_tensor_parallel_policy, 2, timeout=60):
        assert tp == 2
        assert fields == ("fsdp", "tensor_model_parallel_size")
        assert "tensor_model_parallel_size=2" in message
