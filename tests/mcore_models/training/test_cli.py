"""``mcore-train`` end to end with a tiny config, and its command line."""

import importlib.util
import json
import sys

import pytest
from mcore_models.training import (
    SchedulerConfig,
    TrainModelConfig,
    main,
    parse_train_args,
    resolve_configs,
)
from mcore_parallel import ConfigError


def test_mcore_train_writes_checkpoint_plot_report_and_sample(tiny_data, tmp_path, capfd):
    output = tmp_path / "run"
    argv = [
        "--train-iters", "4", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--ffn-hidden-size", "64", "--micro-batch-size", "2", "--eval-iters", "1", "--sample-tokens", "6",
        "--no-progress", "--output-dir", str(output), "--nproc-per-node", "2",
        "--seq-length", str(tiny_data.seq_length), "--data-path", tiny_data.data_path,
        "--heldout-data-path", tiny_data.heldout_data_path, "--tokenizer-file", tiny_data.tokenizer_file,
    ]  # fmt: skip
    assert main(argv) == 0
    report = json.loads((output / "report.json").read_text())
    assert report["iterations_run"] == 4 and report["world_size"] == 2 and "DP=2" in report["layout"]
    assert report["tokens_seen"] == 4 * 4 * 32
    assert (output / "checkpoints" / "latest_checkpointed_iteration.txt").read_text() == "4"
    assert any((output / "checkpoints" / "iter_0000004").glob("*.distcp"))
    assert (output / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    sample = (output / "sample.txt").read_text()
    assert sample.startswith("def ") and sample == report["sample"] + "\n"
    out = capfd.readouterr().out
    assert "held-out loss" in out and "unigram baseline" in out and str(output) in out


def test_defaults_and_checkpoint_directory():
    configs = parse_train_args([])
    assert configs.model.num_layers == 4 and configs.model.hidden_size == 128
    assert configs.model.ffn_hidden_size == 344 and configs.training.train_iters == 360
    assert configs.training.sample_repetition_penalty == 1.3
    # the config classes keep their released defaults; only the command's differ
    assert TrainModelConfig().hidden_size == 256 and SchedulerConfig().lr_decay_style == "cosine"
    assert configs.data.vocab_size == 4096 and configs.data.seq_length == 256
    assert configs.checkpoint.save.endswith("mcore-train-output/checkpoints")
    assert configs.scheduler.lr_decay_style == "WSD"
    resolved = resolve_configs(configs, 2)
    assert resolved.training.global_batch_size == 2 * configs.training.micro_batch_size


def test_bad_layouts_name_the_fields():
    configs = parse_train_args(["--global-batch-size", "6", "--micro-batch-size", "4"])
    with pytest.raises(ConfigError, match="global_batch_size"):
        resolve_configs(configs, 2)
    with pytest.raises(ConfigError, match="must divide the number of ranks"):
        resolve_configs(parse_train_args(["--tensor-model-parallel-size", "4"]), 2)
    with pytest.raises(SystemExit):
        main(["--lr-decay-style", "exponential"])


def test_fsdp_errors_name_the_flag(capsys, monkeypatch):
    with pytest.raises(SystemExit):
        vpp = ["--pipeline-model-parallel-size", "2", "--virtual-pipeline-model-parallel-size", "2"]
        main(["--fsdp", *vpp, "--global-batch-size", "8", "--micro-batch-size", "1"])
    # without mcore-fsdp (a standalone mcore-models) --fsdp is refused first, for that
    installed = importlib.util.find_spec("mcore_fsdp") is not None
    expected = "fsdp, virtual_pipeline_model_parallel_size" if installed else "mcore-models[fsdp]"
    assert expected in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "mcore_fsdp", None)  # not installed
    with pytest.raises(SystemExit):
        main(["--fsdp"])
    assert "mcore-models[fsdp]" in capsys.readouterr().err
