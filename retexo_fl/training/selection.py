"""Best-validation selection and early stopping within one stage, shared by every engine."""

from __future__ import annotations

from typing import Any

from retexo_fl.training.aggregate import StateDict


class StageTracker:
    """Records each round's validation accuracy and keeps the best state of the stage.

    Args:
        stage: the stage index (for the figures).
        patience: stop after this many rounds without a validation gain (0: never).

    The states passed in must not be modified afterwards (the server optimizer returns fresh
    tensors every round), so no copy is made.
    """

    def __init__(self, stage: int, patience: int = 0) -> None:
        self.stage = stage
        self.patience = patience
        self.history: list[dict[str, Any]] = []
        self.best_state: StateDict | None = None
        self.best_val = -1.0
        self.best_round = 0
        self.stale = 0
        self.model_bytes = 0
        self.bytes_offset = 0  # bytes sent before this round's model traffic: earlier stages, boundary

    def record(self, round_: int, state: StateDict, val_accuracy: float, **extra: float) -> None:
        """Keep ``state`` if it is the best so far; history rows carry the run's bytes so far."""
        row = {"round": round_, "val_accuracy": val_accuracy, **extra}
        row["bytes_total"] = self.bytes_offset + self.model_bytes
        self.history.append(row)
        if val_accuracy > self.best_val:
            self.best_state, self.best_val, self.best_round, self.stale = state, val_accuracy, round_, 0
        else:
            self.stale += 1

    @property
    def should_stop(self) -> bool:
        return bool(self.patience) and self.stale >= self.patience

    def progress_line(self, round_: int, rounds: int) -> str | None:
        """A progress line for about five rounds a stage (first, every fifth, last)."""
        if round_ == 1 or round_ == rounds or round_ % max(1, rounds // 5) == 0:
            last = self.history[-1] if self.history else {}
            loss = f"loss {last['train_loss']:.4f}  " if "train_loss" in last else ""
            val = f"val {last['val_accuracy']:.4f}  " if last else ""
            best = f"best {max(self.best_val, 0):.4f}@{self.best_round}"
            return f"stage {self.stage} round {round_:4d}/{rounds}  {loss}{val}{best}"
        return None

    def figures(self, seconds: float) -> dict[str, Any]:
        return {
            "stage": self.stage,
            "rounds_run": len(self.history),
            "best_round": self.best_round,
            "val_accuracy": self.best_val,
            "bytes_model": self.model_bytes,
            "history": self.history,
            "seconds": seconds,
        }
