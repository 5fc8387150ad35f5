"""The hybrid layer pattern: one symbol per layer (``M`` Mamba, ``*`` attention, ``-`` MLP, ``E``
MoE), with ``|`` between pipeline stages where the user places the splits, as in Megatron-LM's
``--hybrid-layer-pattern`` (``"M*E-E*-"``, ``"MM*-|MM*-"``)."""

from __future__ import annotations

from dataclasses import dataclass

from mcore_api import experimental_api
from mcore_parallel import ConfigError

LAYER_SYMBOLS = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}
STAGE_SEPARATOR = "|"
_FIELD = "hybrid_layer_pattern"


@experimental_api
@dataclass(frozen=True)
class HybridLayerPattern:
    """A parsed pattern: ``symbols`` (the layers in order, separators removed) and, where the
    pattern had ``|``, the symbols of each pipeline stage (``stages``; ``None`` otherwise).
    Build it with ``parse``."""

    symbols: str
    stages: tuple[str, ...] | None = None

    @classmethod
    def parse(cls, pattern: str) -> HybridLayerPattern:
        """The pattern of ``pattern``; ``ConfigError`` (naming ``hybrid_layer_pattern``) for a
        non-string, an empty pattern, an unknown symbol or an empty pipeline stage."""
        if not isinstance(pattern, str):
            raise ConfigError([_FIELD], f"must be a string, got {type(pattern).__name__}")
        if not pattern:
            raise ConfigError([_FIELD], f"is empty; give one symbol per layer from {_symbols_help()}")
        for position, symbol in enumerate(pattern):
            if symbol not in LAYER_SYMBOLS and symbol != STAGE_SEPARATOR:
                raise ConfigError(
                    [_FIELD],
                    f"unknown symbol {symbol!r} at position {position} of {pattern!r}; "
                    f"symbols are {_symbols_help()}, and {STAGE_SEPARATOR!r} between pipeline stages",
                )
        if STAGE_SEPARATOR not in pattern:
            return cls(pattern)
        stages = tuple(pattern.split(STAGE_SEPARATOR))
        if any(not stage for stage in stages):
            raise ConfigError(
                [_FIELD], f"{pattern!r} has an empty pipeline stage (a leading, trailing or doubled '|')"
            )
        return cls("".join(stages), stages)

    @property
    def num_layers(self) -> int:
        return len(self.symbols)

    def layer_types(self) -> list[str]:
        """The type of each layer, in order (``"mamba"``, ``"attention"``, ``"mlp"``, ``"moe"``)."""
        return [LAYER_SYMBOLS[symbol] for symbol in self.symbols]

    def layer_map(self) -> dict[str, list[int]]:
        """For each layer type, the 0-based indices of its layers (every type present, maybe empty)."""
        layers: dict[str, list[int]] = {kind: [] for kind in LAYER_SYMBOLS.values()}
        for index, kind in enumerate(self.layer_types()):
            layers[kind].append(index)
        return layers

    def stage_layers(self, pipeline_size: int) -> list[range]:
        """The global layer indices of each of ``pipeline_size`` stages: the pattern's ``|``
        stages, which must number ``pipeline_size``; without ``|``, equal contiguous shares
        (``ConfigError`` when the layers do not divide evenly)."""
        if isinstance(pipeline_size, bool) or not isinstance(pipeline_size, int) or pipeline_size < 1:
            raise ConfigError(
                ["pipeline_model_parallel_size"], f"must be a positive int, got {pipeline_size!r}"
            )
        if self.stages is not None:
            if len(self.stages) != pipeline_size:
                raise ConfigError(
                    [_FIELD, "pipeline_model_parallel_size"],
                    f"the pattern has {len(self.stages)} pipeline stages ('|' splits) but the pipeline "
                    f"size is {pipeline_size}",
                )
            sizes = [len(stage) for stage in self.stages]
        else:
            if self.num_layers % pipeline_size:
                raise ConfigError(
                    [_FIELD, "pipeline_model_parallel_size"],
                    f"{self.num_layers} layers do not split evenly over {pipeline_size} pipeline stages; "
                    f"place the splits with '|'",
                )
            sizes = [self.num_layers // pipeline_size] * pipeline_size
        starts = [sum(sizes[:stage]) for stage in range(len(sizes))]
        return [range(start, start + size) for start, size in zip(starts, sizes, strict=True)]

    def check_model(self, config) -> None:
        """Refuse a ``TransformerConfig`` the pattern cannot build: ``ConfigError`` when
        ``num_layers`` differs from the pattern's layers, or the pattern has MoE layers (``E``)
        but ``num_moe_experts`` is unset."""
        if config.num_layers != self.num_layers:
            raise ConfigError(
                ["num_layers", _FIELD],
                f"num_layers ({config.num_layers}) differs from the {self.num_layers} layers "
                f"of the pattern {self.symbols!r}",
            )
        if "E" in self.symbols and config.num_moe_experts is None:
            raise ConfigError(
                ["num_moe_experts", _FIELD], "the pattern has MoE layers ('E'); set num_moe_experts"
            )


def _symbols_help() -> str:
    return ", ".join(f"{symbol!r} ({kind})" for symbol, kind in LAYER_SYMBOLS.items())
