"""``mcore-train --load DIR`` of a self-describing checkpoint: the saved run's configs are the
defaults (flags given explicitly win), so a resume needs no repeated command line; model-shape
flags that contradict the checkpoint are refused, naming the fields.

Oracle: the same resume with every flag repeated (the configs ``tiny_configs`` builds); losses equal
exactly.
"""

import dataclasses
import itertools
import shutil

import pytest
from mcore_models.data import stdlib_documents, train_bpe_tokenizer
from mcore_models.training import main, parse_train_args, pretrain, resolve_configs
from mcore_parallel import ConfigError
from mcore_testing.distributed import DistributedTestError


def _losses(run_distributed, configs):
    (report,) = [r for r in run_distributed(pretrain, 2, configs, timeout=120) if r is not None]
    return report["history"]["train"], report


def test_resume_without_flags_repeats_the_resume_with_them(run_distributed, tiny_configs, tmp_path):
    first = tiny_configs(tmp_path / "first", 2, dropout=0.1)
    run_distributed(pretrain, 2, first, timeout=120)
    load = str(tmp_path / "first" / "checkpoints")

    bare = parse_train_args(["--load", load, "--train-iters", "4", "--output-dir", str(tmp_path / "bare")])
    full = tiny_configs(tmp_path / "full", 4, load=load, dropout=0.1)
    assert bare.model == full.model and bare.data == full.data and bare.optimizer == full.optimizer
    assert bare.checkpoint.save == str(tmp_path / "bare" / "checkpoints")  # follows --output-dir
    assert bare.checkpoint.load == load
    assert dataclasses.replace(bare.training, output_dir="x") == dataclasses.replace(
        full.training, output_dir="x"
    )

    bare_losses, report = _losses(run_distributed, bare)
    full_losses, _ = _losses(run_distributed, full)
    assert report["resumed_from"] == 2 and [i for i, _ in bare_losses] == [1, 2, 3, 4]
    assert bare_losses == full_losses


def test_contradicting_model_flags_are_refused(run_distributed, tiny_configs, tmp_path, capsys):
    first = tiny_configs(tmp_path / "first", 1)
    run_distributed(pretrain, 2, first, timeout=120)
    load = str(tmp_path / "first" / "checkpoints")

    # mcore-train exits with the message (usage error), as for any bad flag
    with pytest.raises(SystemExit) as exited:
        main(["--load", load, "--num-attention-heads", "2"])
    assert exited.value.code == 2
    assert "num_attention_heads: the checkpoint in" in capsys.readouterr().err
    # a run config of an unknown schema version is refused by name
    newer = tmp_path / "newer"
    shutil.copytree(load, newer)
    (newer / "iter_0000001" / "train_config.json").write_text('{"schema_version": 2, "configs": {}}')
    with pytest.raises(SystemExit):
        main(["--load", str(newer)])
    assert "schema_version 2, this mcore-models reads schema_version 1" in capsys.readouterr().err

    with pytest.raises(ConfigError, match=r"hidden_size=64 \(checkpoint: 32\).*num_layers=2") as raised:
        parse_train_args(["--load", load, "--hidden-size", "64", "--num-layers", "2"])
    assert raised.value.fields == ("hidden_size", "num_layers")
    # the checkpoint's own values, another layout and dropout are no contradiction
    configs = parse_train_args(
        [
            "--load",
            load,
            "--hidden-size",
            "32",
            "--tensor-model-parallel-size",
            "2",
            "--hidden-dropout",
            "0.2",
        ]
    )
    assert (configs.model.hidden_size, configs.model.tensor_model_parallel_size) == (32, 2)
    assert configs.model.num_layers == 4 and configs.model.hidden_dropout == 0.2
    # nor is a flag the run left at its default and the checkpoint holds (the saved value is used)
    assert parse_train_args(["--load", load]).training.micro_batch_size == 2

    # configs built in code are checked when resolved, before any rank trains
    wider = dataclasses.replace(
        first,
        model=dataclasses.replace(first.model, ffn_hidden_size=128),
        checkpoint=dataclasses.replace(first.checkpoint, load=load),
    )
    with pytest.raises(ConfigError, match=r"ffn_hidden_size=128 \(checkpoint: 64\)"):
        resolve_configs(wider, 2)

    # another tokenizer: refused on the ranks before training, naming both vocabulary sizes
    texts = [d.text for d in itertools.islice(stdlib_documents(), 3)]
    train_bpe_tokenizer(texts, vocab_size=320).save(tmp_path / "other-tokenizer.json")
    other = dataclasses.replace(
        first,
        data=dataclasses.replace(first.data, tokenizer_file=str(tmp_path / "other-tokenizer.json")),
        checkpoint=dataclasses.replace(first.checkpoint, load=load),
    )
    with pytest.raises(
        DistributedTestError,
        match=r"tokenizer_file, vocab_size: the tokenizer has 320 ids, .* trained with 300",
    ):
        run_distributed(pretrain, 2, other, timeout=120)
