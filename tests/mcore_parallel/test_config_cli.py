"""Config dataclasses -> argparse -> dataclasses, and the validation of values and combinations."""

import argparse
from dataclasses import dataclass
from typing import Literal

import pytest
import torch
from mcore_parallel import (
    CheckpointConfig,
    ConfigError,
    LoggerConfig,
    ModelParallelConfig,
    StragglerDetectionConfig,
    add_dataclass_arguments,
    config_field,
    parse_dataclasses,
)


@dataclass
class Example:
    """An example config.

    Used only by these tests.
    """

    name: str = config_field(help="Required: has no default.")
    steps: int = config_field(10, minimum=1, help="How many steps.")
    rate: float | None = config_field(None, help="Optional rate.")
    mode: Literal["fast", "slow"] = config_field("fast", help="Speed.")
    level: Literal[0, 1, 2] = config_field(1, help="Integer choices.")
    sizes: list[int] = config_field(default_factory=lambda: [1, 2], help="A list of sizes.")  # noqa: RUF009
    verbose: bool = config_field(True, help="Talk a lot.")
    no_color: bool = config_field(False, help="Plain output.")
    weird: bool = config_field(False, flag="--use-weird", help="Custom flag name.")


def test_round_trip_of_every_kind_of_field():
    (example,) = parse_dataclasses(
        [Example],
        [
            "--name",
            "x",
            "--steps",
            "3",
            "--rate",
            "0.5",
            "--mode",
            "slow",
            "--level",
            "2",
            "--sizes",
            "4",
            "5",
            "6",
            "--no-verbose",
            "--no-color",
            "--use-weird",
        ],
    )
    assert example == Example("x", 3, 0.5, "slow", 2, [4, 5, 6], False, True, True)


def test_defaults_come_from_the_dataclass():
    (example,) = parse_dataclasses([Example], ["--name", "y"])
    assert example == Example(name="y")
    assert example.sizes == [1, 2] and example.rate is None and example.verbose is True


def test_help_text_groups_and_choices_come_from_the_fields():
    parser = argparse.ArgumentParser(prog="train")
    group = add_dataclass_arguments(parser, Example)
    assert group.title == "Example" and group.description == "An example config."
    text = parser.format_help()
    for fragment in (
        "How many steps.",
        "--verbose, --no-verbose",
        "--no-color",
        "{fast,slow}",
        "{0,1,2}",
        "--use-weird",
    ):
        assert fragment in text
    assert "--no-no-color" not in text


@pytest.mark.parametrize(
    "argv",
    [
        ["--steps", "3"],
        ["--name", "x", "--mode", "medium"],
        ["--name", "x", "--level", "3"],
        ["--name", "x", "--steps", "a"],
    ],
    ids=["missing-required", "bad-literal", "bad-int-literal", "not-an-int"],
)
def test_argparse_rejects_bad_command_lines(argv, capsys):
    with pytest.raises(SystemExit):
        parse_dataclasses([Example], argv)


def test_values_below_the_minimum_name_the_field():
    with pytest.raises(ConfigError, match=r"steps: must be >= 1, got 0") as raised:
        parse_dataclasses([Example], ["--name", "x", "--steps", "0"])
    assert raised.value.fields == ("steps",)


def test_generator_demands_help_and_supported_types():
    @dataclass
    class NoHelp:
        value: int = 1

    @dataclass
    class Unsupported:
        value: dict = config_field(default_factory=dict, help="nope")  # noqa: RUF009

    with pytest.raises(TypeError, match="'value' needs help text"):
        add_dataclass_arguments(argparse.ArgumentParser(), NoHelp)
    with pytest.raises(TypeError, match="field 'value': unsupported annotation"):
        add_dataclass_arguments(argparse.ArgumentParser(), Unsupported)


def test_duplicate_field_names_across_classes_are_rejected():
    with pytest.raises(ValueError, match="'name' is declared by both Example and Example"):
        parse_dataclasses([Example, Example], [])


def test_subclasses_inherit_the_cli():
    @dataclass
    class Extended(ModelParallelConfig):
        """A model config on top of the parallel one."""

        hidden_size: int = config_field(64, minimum=1, help="Width of the model.")

    (config,) = parse_dataclasses([Extended], ["--tensor-model-parallel-size", "2", "--hidden-size", "8"])
    assert config.tensor_model_parallel_size == 2 and config.hidden_size == 8


def test_all_first_user_configs_parse_together():
    model, ckpt, logger, straggler = parse_dataclasses(
        [ModelParallelConfig, CheckpointConfig, LoggerConfig, StragglerDetectionConfig],
        [
            "--tensor-model-parallel-size",
            "2",
            "--sequence-parallel",
            "--bf16",
            "--save",
            "/tmp/ck",
            "--save-interval",
            "100",
            "--no-save-optim",
            "--ckpt-format",
            "fsdp_dtensor",
            "--tensorboard-dir",
            "/tmp/tb",
            "--log-timers-to-tensorboard",
            "--wandb-project",
            "p",
            "--straggler-detection",
            "--straggler-threshold-relative-stddev",
            "0.2",
        ],
    )
    assert (
        model.tensor_model_parallel_size == 2
        and model.sequence_parallel
        and model.params_dtype == torch.bfloat16
    )
    assert (
        ckpt.save == "/tmp/ck" and ckpt.save_interval == 100 and ckpt.no_save_optim and not ckpt.no_save_rng
    )
    assert ckpt.ckpt_format == "fsdp_dtensor"
    assert (
        logger.log_timers_to_tensorboard
        and logger.tensorboard_queue_size == 1000
        and logger.wandb_project == "p"
    )
    assert straggler.enabled and straggler.threshold_relative_stddev == 0.2 and straggler.calc_relative_stddev


@pytest.mark.parametrize(
    ("make", "fields"),
    [
        (
            lambda: ModelParallelConfig(sequence_parallel=True),
            ("sequence_parallel", "tensor_model_parallel_size"),
        ),
        (lambda: ModelParallelConfig(fp16=True, bf16=True), ("fp16", "bf16")),
        (
            lambda: ModelParallelConfig(virtual_pipeline_model_parallel_size=2),
            ("virtual_pipeline_model_parallel_size", "pipeline_model_parallel_size"),
        ),
        (lambda: ModelParallelConfig(context_parallel_size=0), ("context_parallel_size",)),
        (lambda: ModelParallelConfig(parallel_order="tp-dp"), ("parallel_order",)),
        (lambda: CheckpointConfig(save_interval=10), ("save_interval", "save")),
        (
            lambda: CheckpointConfig(save="d", async_save=True, ckpt_format="fsdp_dtensor"),
            ("async_save", "ckpt_format"),
        ),
        (lambda: CheckpointConfig(async_save=True), ("async_save", "save")),
        (lambda: CheckpointConfig(ckpt_format="zarr"), ("ckpt_format",)),
        (
            lambda: LoggerConfig(log_memory_to_tensorboard=True),
            ("log_memory_to_tensorboard", "tensorboard_dir"),
        ),
        (lambda: LoggerConfig(wandb_exp_name="run"), ("wandb_exp_name", "wandb_save_dir", "wandb_project")),
        (lambda: LoggerConfig(log_interval=0), ("log_interval",)),
        (lambda: StragglerDetectionConfig(threshold_relative_stddev=0.0), ("threshold_relative_stddev",)),
        (lambda: StragglerDetectionConfig(report_time_interval=-1.0), ("report_time_interval",)),
    ],
)
def test_invalid_values_and_combinations_name_the_fields(make, fields):
    with pytest.raises(ConfigError) as raised:
        make()
    assert raised.value.fields == fields
    assert all(name in str(raised.value) for name in fields)


def test_params_dtype_follows_the_precision_switches():
    assert ModelParallelConfig().params_dtype == torch.float32
    assert ModelParallelConfig(fp16=True).params_dtype == torch.float16
