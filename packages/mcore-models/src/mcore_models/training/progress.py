"""What rank 0 shows while training: a tqdm bar with step, loss, tokens/s and ETA."""

from __future__ import annotations

import sys

from tqdm import tqdm


class TrainingProgress:
    """A progress bar over iterations on the rank that ``enabled`` it; a no-op elsewhere."""

    def __init__(self, total: int, initial: int, tokens_per_iteration: int, enabled: bool):
        self.tokens_per_iteration = tokens_per_iteration
        self.bar = (
            tqdm(
                total=total,
                initial=initial,
                desc="step 0",
                unit="it",
                dynamic_ncols=True,
                file=sys.stdout,
                bar_format="{percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}] {desc}",
            )
            if enabled
            else None
        )

    def update(self, iteration: int, loss: float, seconds_per_iteration: float, lr: float) -> None:
        if self.bar is None:
            return
        tokens_per_second = self.tokens_per_iteration / max(seconds_per_iteration, 1e-9)
        self.bar.set_description_str(
            f"step {iteration} loss {loss:.3f} lr {lr:.2e} {tokens_per_second:,.0f} tok/s", refresh=False
        )
        self.bar.update(1)

    def write(self, message: str) -> None:
        """Print a line above the bar (rank 0 only)."""
        if self.bar is not None:
            self.bar.write(message, file=sys.stdout)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
