"""Knowledge distillation in ``mcore-train``: a teacher trained with ``pretrain`` is loaded frozen and a
narrower, shallower student learns from it.

Oracles: the vocab-parallel KL at TP = 2 against the same logits whole on one process; the
student's held-out KL to the teacher after distillation against its KL at initialization and against
the same student trained as long on the cross entropy alone (same seed); the teacher's weights
before and after; the run at TP = 2 (teacher resharded from TP = 1, vocabulary padded otherwise)
against DP = 2.
"""

import dataclasses
import json

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from mcore_models.training import (
    DistillationConfig,
    SchedulerConfig,
    TrainConfigs,
    TrainingConfig,
    TrainModelConfig,
    TrainOptimizerConfig,
    logit_kl_loss,
    pretrain,
    resolve_configs,
)
from mcore_models.training import loop as loop_module
from mcore_parallel import (
    CheckpointConfig,
    ConfigError,
    destroy_model_parallel,
    initialize_model_parallel,
)
from mcore_testing.distributed import run_distributed as run_ranks
from safetensors.torch import load_file

STUDENT = dict(num_layers=2, hidden_size=16, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=32)


def _configs(data, output, iters, model=None, seed=1234, export_hf=None, **distillation):
    model = model or dict(
        num_layers=4, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=64
    )
    layout = {
        k: distillation.pop(k) for k in list(distillation) if k.endswith("_size") or k == "sequence_parallel"
    }
    return TrainConfigs(
        model=TrainModelConfig(**model, **layout),
        optimizer=TrainOptimizerConfig(lr=1e-2),
        scheduler=SchedulerConfig(lr_warmup_iters=1),
        data=data,
        training=TrainingConfig(
            train_iters=iters,
            micro_batch_size=2,
            global_batch_size=4,
            eval_interval=None,
            eval_iters=2,
            output_dir=str(output),
            sample_tokens=0,
            progress=False,
            seed=seed,
            export_hf=export_hf,
        ),
        checkpoint=CheckpointConfig(save=str(output / "checkpoints")),
        distillation=DistillationConfig(**distillation),
    )


@pytest.fixture(scope="module")
def teacher(tiny_data, tmp_path_factory):
    """The save directory of a 4-layer, 32-wide teacher trained 40 iterations (seed 7)."""
    output = tmp_path_factory.mktemp("teacher")
    run_ranks(pretrain, 2, _configs(tiny_data, output, 40, seed=7), timeout=120)
    return output / "checkpoints"


def _tp2_kl_against_tp1():
    groups = initialize_model_parallel(tensor_model_parallel_size=2)
    try:
        generator = torch.Generator().manual_seed(0)
        student = torch.randn(2, 3, 10, generator=generator) * 2
        teacher = torch.randn(2, 3, 10, generator=generator) * 2
        student[..., -2:] = teacher[..., -2:] = float("-inf")  # padded ids, on rank 1 only
        mask = torch.tensor([[1.0, 0.0, 1.0], [1.0, 1.0, 1.0]])
        rank = dist.get_rank(groups.tp)
        results = []
        for direction, temperature in (("forward", 1.0), ("reverse", 2.0)):
            whole = student.clone().requires_grad_()
            expected = logit_kl_loss(whole, teacher, mask, temperature, direction)
            expected.backward()
            shard = student[..., rank * 5 : (rank + 1) * 5].clone().requires_grad_()
            loss = logit_kl_loss(
                shard, teacher[..., rank * 5 : (rank + 1) * 5], mask, temperature, direction, groups.tp
            )
            loss.backward()
            grad_error = (shard.grad - whole.grad[..., rank * 5 : (rank + 1) * 5]).abs().max().item()
            results.append((loss.item(), expected.item(), grad_error))
        return results
    finally:
        destroy_model_parallel()


def test_vocab_parallel_kl_equals_whole_vocabulary(run_distributed):
    for rank_results in run_distributed(_tp2_kl_against_tp1, 2):
        for loss, expected, grad_error in rank_results:
            assert loss == pytest.approx(expected, rel=1e-6)
            assert grad_error < 1e-7


def _pretrain_watching_teacher(configs):
    """``pretrain``, and whether the teacher's weights stayed bit-identical, frozen and out of the optimizer."""
    seen = {}

    class Watched(loop_module.DistillationRun):
        def __init__(self, configs, model, *args):
            super().__init__(configs, model, *args)
            teacher = self.loss.teacher
            seen["teacher"], seen["before"] = teacher, {n: p.clone() for n, p in teacher.named_parameters()}
            student = {id(p) for p in model.container.parameters()}
            seen["shared"] = any(id(p) in student for p in teacher.parameters())

    original, loop_module.DistillationRun = loop_module.DistillationRun, Watched
    try:
        report = pretrain(configs)
    finally:
        loop_module.DistillationRun = original
    teacher = seen["teacher"]
    frozen = {
        "identical": all(torch.equal(p, seen["before"][n]) for n, p in teacher.named_parameters()),
        "no_grad": all(not p.requires_grad and p.grad is None for p in teacher.parameters()),
        "eval": not teacher.training,
        "shared_with_student": seen["shared"],
    }
    return report, frozen


def _student_checkpoint_keys(save_dir):
    iteration = int((save_dir / "latest_checkpointed_iteration.txt").read_text())
    metadata = dcp.FileSystemReader(save_dir / f"iter_{iteration:07d}").read_metadata().state_dict_metadata
    return {
        key: tuple(getattr(value, "size", ())) for key, value in metadata.items() if key.startswith("model.")
    }


@pytest.mark.slow
def test_distillation_lowers_the_students_kl_to_the_teacher(teacher, tiny_data, tmp_path):
    iters = 30
    kd = _configs(
        tiny_data,
        tmp_path / "kd",
        iters,
        STUDENT,
        teacher_load=str(teacher),
        kd_temperature=2.0,
        kd_hidden_pairs="1:3",
        kd_hidden_projection=True,
        kd_hidden_weight=0.1,
        export_hf=str(tmp_path / "hf"),
    )
    (kd_report, frozen), _ = run_ranks(_pretrain_watching_teacher, 2, kd, timeout=150)
    # the same student trained as long on the cross entropy alone, measured by the same code: the
    # teacher with logit weight 0 and CE weight 1 only watches
    plain = _configs(
        tiny_data,
        tmp_path / "plain",
        iters,
        STUDENT,
        teacher_load=str(teacher),
        kd_logit_weight=0.0,
        kd_ce_weight=1.0,
    )
    plain_report = run_ranks(pretrain, 2, plain, timeout=150)[0]

    before, after = kd_report["kd"]["heldout_kl_before"], kd_report["kd"]["heldout_kl_after"]
    baseline = plain_report["kd"]["heldout_kl_after"]
    print(f"held-out KL(teacher || student): init {before:.4f}, KD {after:.4f}, CE only {baseline:.4f}")
    assert plain_report["kd"]["heldout_kl_before"] == pytest.approx(before, rel=1e-6)  # same initial student
    assert after < 0.8 * before
    assert after < baseline
    assert frozen == {"identical": True, "no_grad": True, "eval": True, "shared_with_student": False}
    assert len(kd_report["kd"]["train_logit_kl"]) == iters
    assert json.loads((tmp_path / "kd" / "report.json").read_text())["kd"]["heldout_kl_after"] == after

    keys = _student_checkpoint_keys(tmp_path / "kd" / "checkpoints")
    assert keys["model.kd_projections.1_3.weight"] == (32, 16)  # student width 16 -> teacher width 32
    del keys["model.kd_projections.1_3.weight"]
    # nothing of the teacher: the same tensors as the plain student's checkpoint
    assert keys == _student_checkpoint_keys(tmp_path / "plain" / "checkpoints")
    # --export-hf writes the student alone: the projection is a training aid
    exported = load_file(tmp_path / "hf" / "model.safetensors")
    assert exported["model.embed_tokens.weight"].shape[1] == 16
    assert not [name for name in exported if "kd" in name or "layers.2." in name]


@pytest.mark.slow
def test_tensor_parallel_distillation_matches_data_parallel(teacher, tiny_data, tmp_path):
    """At TP = 2 (with and without sequence parallelism) the vocabulary pads to 512 rows, the TP = 1
    teacher's to 384: its logits are resharded. The initial student is the same at every layout, so
    is its KL to the teacher."""
    reports = {}
    for tp, sp in ((1, False), (2, False), (2, True)):
        configs = _configs(
            tiny_data,
            tmp_path / f"tp{tp}-sp{sp}",
            2,
            STUDENT,
            teacher_load=str(teacher),
            tensor_model_parallel_size=tp,
            sequence_parallel=sp,
        )
        reports[tp, sp] = run_ranks(pretrain, 2, configs, timeout=120)[0]["kd"]
    for layout in ((2, False), (2, True)):
        assert reports[layout]["heldout_kl_before"] == pytest.approx(
            reports[1, False]["heldout_kl_before"], rel=1e-4
        )
        assert reports[layout]["train_logit_kl"][0][1] == pytest.approx(
            reports[1, False]["train_logit_kl"][0][1], rel=1e-4
        )


@pytest.mark.parametrize("what", ["tokens", "vocab_size"])
def test_another_vocabulary_is_refused(what, teacher, tiny_data, tmp_path):
    """A teacher whose saved tokenizer maps other tokens, or whose config has another vocabulary size."""
    import itertools
    import shutil

    from mcore_models.data.corpus import stdlib_documents
    from mcore_models.data.tokenizer import train_bpe_tokenizer

    copy = shutil.copytree(teacher, tmp_path / "teacher")
    iteration_dir = next(copy.glob("iter_*"))
    options = {}
    if what == "tokens":
        texts = [
            d.text for d in itertools.islice((d for d in stdlib_documents() if d.text.isascii()), 40, 60)
        ]
        train_bpe_tokenizer(texts, vocab_size=300).save(iteration_dir / "tokenizer.json")
    else:
        saved = json.loads((iteration_dir / "model_config.json").read_text())
        saved["vocab_size"] += 1
        (tmp_path / "model_config.json").write_text(json.dumps(saved))
        options["teacher_config"] = str(tmp_path / "model_config.json")
    configs = _configs(tiny_data, tmp_path / "run", 1, STUDENT, teacher_load=str(copy), **options)
    with pytest.raises(Exception, match=r"teacher_load, tokenizer_file: .*same tokenizer"):
        run_ranks(pretrain, 2, configs, timeout=60)


@pytest.mark.parametrize(
    "fields, options",
    [
        (["teacher_load", "kd_temperature"], dict(kd_temperature=2.0)),
        (["teacher_load", "kd_hidden_pairs"], dict(kd_hidden_pairs="0:1")),
        (["kd_temperature"], dict(teacher_load="t", kd_temperature=0.0)),
        (["kd_hidden_pairs"], dict(teacher_load="t", kd_hidden_pairs="0-1")),
        (["kd_hidden_pairs"], dict(teacher_load="t", kd_hidden_pairs="0:x")),
        (["kd_hidden_pairs", "kd_hidden_projection"], dict(teacher_load="t", kd_hidden_projection=True)),
        (["kd_hidden_pairs", "kd_hidden_kind"], dict(teacher_load="t", kd_hidden_kind="mse")),
        (
            ["kd_logit_weight", "kd_ce_weight", "kd_hidden_weight"],
            dict(teacher_load="t", kd_logit_weight=0.0),
        ),
        (["kd_logit_weight"], dict(teacher_load="t", kd_logit_weight=-1.0)),
    ],
)
def test_config_errors(fields, options):
    with pytest.raises(ConfigError) as error:
        DistillationConfig(**options)
    assert list(error.value.fields) == fields


def test_pairs_parse():
    assert DistillationConfig(teacher_load="t", kd_hidden_pairs=" 0:1, 3:7 ").hidden_pairs == [(0, 1), (3, 7)]


@pytest.mark.parametrize(
    "field, change",
    [
        ("pipeline_model_parallel_size", dict(pipeline_model_parallel_size=2)),
        ("context_parallel_size", dict(context_parallel_size=2)),
        ("num_moe_experts", dict(num_moe_experts=2)),
        ("fsdp", dict(fsdp=True)),
        ("kd_hidden_pairs", dict(kd_hidden_pairs="2:0")),  # the student has 2 layers
        ("kd_hidden_pairs", dict(kd_hidden_pairs="0:4")),  # the teacher 4
        ("kd_hidden_projection", dict(kd_hidden_pairs="0:1")),  # widths 16 and 32
        ("sequence_parallel", dict(kd_hidden_pairs="0:1", kd_hidden_projection=True, sp=True)),
        ("teacher_load", dict(teacher_load="missing")),
        ("tensor_model_parallel_size", dict(tp=8)),
    ],
)
def test_refused_before_training(field, change, teacher, tiny_data, tmp_path):
    change = dict(change)
    model = dict(STUDENT)
    for name in ("pipeline_model_parallel_size", "context_parallel_size", "num_moe_experts"):
        if name in change:
            model[name] = change.pop(name)
    if change.pop("sp", False):
        model.update(sequence_parallel=True, tensor_model_parallel_size=2)
    if "tp" in change:
        model.update(tensor_model_parallel_size=change.pop("tp"), num_attention_heads=8, num_query_groups=8)
    fsdp = change.pop("fsdp", False)
    load = change.pop("teacher_load", str(teacher))
    configs = _configs(
        tiny_data,
        tmp_path,
        1,
        model,
        teacher_load=str(tmp_path / load) if load == "missing" else load,
        **change,
    )
    configs.training = dataclasses.replace(configs.training, fsdp=fsdp, global_batch_size=64)
    with pytest.raises(ConfigError) as error:
        resolve_configs(configs, 8)
    assert field in error.value.fields


def test_teacher_config_file_overrides_the_checkpoints(teacher, tiny_data, tmp_path):
    """A teacher config of another depth is what the checks read: pair 0:5 fits its 6 layers."""
    saved = json.loads(next(teacher.glob("iter_*/model_config.json")).read_text())
    saved["transformer_config"]["num_layers"] = 6
    path = tmp_path / "model_config.json"
    path.write_text(json.dumps(saved))
    configs = _configs(
        tiny_data,
        tmp_path,
        1,
        dict(STUDENT, hidden_size=32),
        teacher_load=str(teacher),
        kd_hidden_pairs="0:5",
    )
    with pytest.raises(ConfigError, match="out of range"):
        resolve_configs(configs, 2)
    configs.distillation = dataclasses.replace(configs.distillation, teacher_config=str(path))
    assert resolve_configs(configs, 2).distillation.teacher_config == str(path)


def test_mcore_train_distills_from_the_command_line(teacher, tiny_data, tmp_path):
    from mcore_models.training import main

    output = tmp_path / "cli"
    argv = [
        "--teacher-load", str(teacher), "--kd-temperature", "2", "--kd-ce-weight", "0.5",
        "--kd-hidden-pairs", "0:1", "--kd-hidden-kind", "mse", "--kd-hidden-projection",
        "--train-iters", "3", "--num-layers", "2", "--hidden-size", "16", "--num-attention-heads", "4",
        "--num-query-groups", "2", "--ffn-hidden-size", "32", "--micro-batch-size", "2", "--eval-iters", "1",
        "--sample-tokens", "0", "--no-progress", "--output-dir", str(output), "--nproc-per-node", "2",
        "--seq-length", str(tiny_data.seq_length), "--data-path", tiny_data.data_path,
        "--heldout-data-path", tiny_data.heldout_data_path, "--tokenizer-file", tiny_data.tokenizer_file,
    ]  # fmt: skip
    assert main(argv) == 0
    kd = json.loads((output / "report.json").read_text())["kd"]
    assert kd["temperature"] == 2.0 and kd["weights"]["ce"] == 0.5 and kd["hidden_pairs"] == [[0, 1]]
    assert len(kd["train_logit_kl"]) == 3 and kd["heldout_kl_after"] > 0
