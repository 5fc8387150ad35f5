"""``StragglerDetectionConfig``: finding ranks whose steps are slower than the rest."""

from __future__ import annotations

from dataclasses import dataclass

from .fields import ConfigError, config_field, validate_fields


@dataclass
class StragglerDetectionConfig:
    """Straggler detection: compare per-rank step times and report the slow ranks."""

    enabled: bool = config_field(
        False, flag="--straggler-detection", help="Measure and compare per-rank step times."
    )
    report_time_interval: float = config_field(
        300.0, flag="--straggler-report-time-interval", help="Seconds between straggler reports."
    )
    calc_relative_stddev: bool = config_field(
        True,
        flag="--straggler-calc-relative-stddev",
        help="Flag stragglers by the relative standard deviation of step times across ranks.",
    )
    threshold_relative_stddev: float = config_field(
        0.1,
        flag="--straggler-threshold-relative-stddev",
        help="Relative standard deviation of step times above which slow ranks are reported.",
    )

    def __post_init__(self) -> None:
        validate_fields(self)
        if not self.report_time_interval > 0:
            raise ConfigError(
                ["report_time_interval"], f"must be > 0 seconds, got {self.report_time_interval}"
            )
        if not self.threshold_relative_stddev > 0:
            raise ConfigError(
                ["threshold_relative_stddev"], f"must be > 0, got {self.threshold_relative_stddev}"
            )
