"""``--wandb-project``: a tiny run logged to Weights & Biases offline, read back from its run file."""

import json
import struct
import sys

import pytest
from mcore_models.training import main, pretrain
from mcore_parallel import LoggerConfig

_BLOCK, _HEADER = 32768, 7  # wandb's run file: a LevelDB-style log of protobuf records


def _run_records(path):
    """The ``Record`` messages of a ``run-*.wandb`` file, in order."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    ident, magic, _version = struct.unpack("<4sHB", data[:_HEADER])
    assert (ident, magic) == (b":W&B", 0xBEE1), "not a wandb run file"
    position, pending = _HEADER, b""
    while position + _HEADER <= len(data):
        left_in_block = _BLOCK - position % _BLOCK
        if left_in_block < _HEADER:  # block trailer
            position += left_in_block
            continue
        _checksum, length, kind = struct.unpack("<IHB", data[position : position + _HEADER])
        if kind == 0:  # zero padding up to the end of the block
            position += left_in_block
            continue
        chunk = data[position + _HEADER : position + _HEADER + length]
        position += _HEADER + length
        pending += chunk
        if kind in (1, 4):  # full record, or last fragment of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            yield record
            pending = b""


def _read_offline_run(run_dir):
    """``(run, history, summary)``: the run record, the logged rows by step, the final summary."""
    (run_file,) = run_dir.glob("run-*.wandb")
    run, history, summary = None, {}, {}
    for record in _run_records(run_file):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run = record.run
        elif kind == "history":
            row = {
                item.key or "/".join(item.nested_key): json.loads(item.value_json)
                for item in record.history.item
            }
            history[row["_step"]] = row
        elif kind == "summary":
            summary.update(
                {
                    item.key or "/".join(item.nested_key): json.loads(item.value_json)
                    for item in record.summary.update
                }
            )
    return run, history, summary


def test_offline_run_logs_training_metrics_and_final_summary(
    run_distributed, tiny_configs, tmp_path, monkeypatch
):
    pytest.importorskip("wandb", reason="needs the wandb extra: pip install 'mcore-models[wandb]'")
    monkeypatch.setenv("WANDB_MODE", "offline")  # the ranks inherit it: no network, no account
    configs = tiny_configs(tmp_path / "run", 4)
    configs.training.eval_interval = 2
    configs.logger = LoggerConfig(log_interval=2, wandb_project="mcore-tests", wandb_exp_name="tiny")
    (report,) = [r for r in run_distributed(pretrain, 2, configs, timeout=120) if r is not None]

    # one run, written by rank 0 under the output directory (the default wandb_save_dir)
    (run_dir,) = (tmp_path / "run" / "wandb").glob("offline-run-*")
    run, history, summary = _read_offline_run(run_dir)
    assert run.project == "mcore-tests" and run.display_name == "tiny"
    config = {item.key: json.loads(item.value_json) for item in run.config.update}
    assert config["training"]["train_iters"] == 4

    # every log_interval: loss and lr as in the report's history, grad norm, throughput;
    # held-out loss and perplexity at the evaluation of iteration 2 and at the end
    assert sorted(history) == [2, 4]
    train_loss, lrs = dict(report["history"]["train"]), dict(report["history"]["lr"])
    heldout = dict(report["history"]["heldout"])
    for step, row in history.items():
        assert row["train/loss"] == pytest.approx(train_loss[step])
        assert row["train/lr"] == pytest.approx(lrs[step])
        assert row["train/grad_norm"] > 0 and row["train/tokens_per_second"] > 0
        assert row["heldout/loss"] == pytest.approx(heldout[step])
        assert row["heldout/perplexity"] > 1
    assert summary["final/heldout_loss"] == pytest.approx(report["final_heldout"]["loss"])
    assert summary["final/train_loss"] == pytest.approx(report["final_train_loss"])
    assert summary["final/tokens_seen"] == report["tokens_seen"]
    assert summary["parameters"] == report["parameters"]


def test_wandb_project_without_the_extra_is_a_clear_error(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # not installed
    with pytest.raises(SystemExit):
        main(["--wandb-project", "mcore-tests"])
    assert "mcore-models[wandb]" in capsys.readouterr().err
