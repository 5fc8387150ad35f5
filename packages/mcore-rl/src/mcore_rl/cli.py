"""``mcore-rl``: the command line, generated from the loop's config dataclasses, and its entry point.

With no arguments it runs the embedded default (no download): a small GPT learns multi-digit
addition by a short supervised run, then GRPO trains it on the task's rewards; it writes
``mcore-rl-output/`` (``reward.png``, ``report.json``, ``checkpoint/``).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from mcore_parallel import ConfigError, add_dataclass_arguments, dataclass_from_args

from .loop.checkpoint import CheckpointError
from .loop.config import CONFIG_CLASSES, RLConfigs
from .loop.default_run import run_default

DESCRIPTION = (
    "GRPO post-training of an mcore GPT with rollouts from the in-process mcore inference engine. "
    "With no arguments: a small model learns multi-digit addition (embedded task, character "
    "tokenizer, no download) by a short supervised run, then GRPO trains it on the task's rewards; "
    "prints reward and accuracy before and after and writes reward.png, report.json and "
    "checkpoint/ to ./mcore-rl-output/. --load DIR resumes a run from its checkpoint."
)


def build_parser() -> argparse.ArgumentParser:
    """The parser: one option group per config class."""
    parser = argparse.ArgumentParser(prog="mcore-rl", description=DESCRIPTION)
    for config_class in CONFIG_CLASSES:
        add_dataclass_arguments(parser, config_class)
    return parser


def parse_rl_args(
    argv: Sequence[str] | None = None, parser: argparse.ArgumentParser | None = None
) -> RLConfigs:
    """The ``RLConfigs`` of ``argv`` (default ``sys.argv[1:]``); ``ConfigError`` names a bad field."""
    parser = parser if parser is not None else build_parser()
    namespace = parser.parse_args(argv)
    return RLConfigs(*(dataclass_from_args(c, namespace) for c in CONFIG_CLASSES))


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``mcore-rl``; returns the exit status."""
    parser = build_parser()
    try:
        configs = parse_rl_args(argv, parser)
        print(f"mcore-rl: output in {os.path.abspath(configs.run.output_dir)}", flush=True)
        run_default(configs)
    except (ConfigError, CheckpointError) as error:
        parser.error(str(error))
    return 0


if __name__ == "__main__":
    sys.exit(main())
