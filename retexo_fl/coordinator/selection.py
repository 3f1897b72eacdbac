"""Best-validation selection (within a stage, and of the stage a run delivers) and early stopping."""

from __future__ import annotations

import math
from typing import Any

from retexo_fl.records import StateDict

#: What early stopping may count as progress (see :class:`StageTracker`).
STOP_METRICS = ("accuracy", "accuracy-or-loss")
#: The relative fall of the validation loss that counts as progress with ``accuracy-or-loss``.
LOSS_GAIN = 0.002
#: How far past ``first-stage-race-margin`` a raced training must trail to be stopped: float
#: rounding only (the accuracies compared are ratios of node counts).
PACE_TOLERANCE = 1e-9


class StageTracker:
    """Records each round's validation accuracy and keeps the best state of the stage.

    The states passed in must not be modified afterwards (the server optimizer returns fresh
    tensors every round), so no copy is made.

    Args:
        stage (int): the stage index (for the figures).
        patience (int, optional): stop after this many rounds without a validation gain; :obj:`0`
            never stops. (default: :obj:`0`)
        min_rounds (int, optional): rounds recorded before early stopping may end the stage.
            (default: :obj:`0`)
        stop_metric (str, optional): what counts as progress for early stopping: ``"accuracy"``,
            a higher validation accuracy; ``"accuracy-or-loss"``, that or a validation loss at
            least :data:`LOSS_GAIN` below the lowest so far, so that a stage still learning on a
            plateau of its accuracy (every node predicted as the majority class for several
            rounds, then the minority learned) is not ended there. The state kept is always the
            best-accuracy one. (default: :obj:`"accuracy"`)
    """

    #: ``first-stage auto``'s second training of stage 0 races the first (:meth:`race`): the
    #: first's validation accuracy by round, the round from which the second stops once it
    #: trails, and by how much it may trail. Class defaults: a checkpoint of older code has none.
    pace: list[float] | None = None
    pace_after: int = 0
    pace_margin: float = 0.0

    def __init__(
        self,
        stage: int,
        patience: int = 0,
        min_rounds: int = 0,
        stop_metric: str = "accuracy",
        name: str | None = None,
    ) -> None:
        if stop_metric not in STOP_METRICS:
            raise ValueError(f"stop-metric must be one of {STOP_METRICS}, got {stop_metric!r}")
        self.stage = stage
        self.name = name or f"stage {stage}"  # how progress lines call it
        self.patience = patience
        self.min_rounds = min_rounds
        self.stop_metric = stop_metric
        self.best_loss = float("inf")
        self.history: list[dict[str, Any]] = []
        self.best_state: StateDict | None = None
        self.best_val = -1.0
        self.best_val_loss: float | None = None  # the kept round's validation loss, if measured
        self.best_round = 0
        self.stale = 0
        self.model_bytes = 0
        self.said_round = 0  # the last round a progress line gave
        self.bytes_offset = 0  # bytes sent before this round's model traffic: earlier stages, boundary

    def record(self, round_: int, state: StateDict, val_accuracy: float, **extra: float) -> None:
        """Keep ``state`` if it is the best so far; history rows carry the run's bytes so far.

        Args:
            round_ (int): the round the accuracy belongs to.
            state (StateDict): the global state that was validated.
            val_accuracy (float): its validation accuracy.
            **extra (float, optional): more figures for the history row (e.g. ``train_loss``).
        """
        since = round_ - self.last_round  # 1 a round; more when rounds are validated every few
        row = {"round": round_, "val_accuracy": val_accuracy, **extra}
        row["bytes_total"] = self.bytes_offset + self.model_bytes
        self.history.append(row)
        loss = extra.get("val_loss")
        lower_loss = loss is not None and loss < self.best_loss * (1 - LOSS_GAIN)
        if loss is not None:
            self.best_loss = min(self.best_loss, loss)
        if val_accuracy > self.best_val:
            self.best_state, self.best_val, self.best_round, self.stale = state, val_accuracy, round_, 0
            self.best_val_loss = loss
        elif lower_loss and self.stop_metric == "accuracy-or-loss":
            self.stale = 0
        else:
            self.stale += max(1, since)

    @property
    def last_round(self) -> int:
        """The last round recorded (0: none yet)."""
        return int(self.history[-1]["round"]) if self.history else 0

    def race(self, pace: list[float], after: int, margin: float) -> None:
        """Stop as soon as this stage, ``after`` rounds or more in, validates more than ``margin``
        below the best that another training of it reached in as many rounds.

        Args:
            pace (list[float]): the other training's validation accuracy, round by round (from
                round 1; see :func:`pace_by_round`).
            after (int): the first round at which the comparison may stop this one (0: never).
            margin (float): how far below it this one may be (accuracy, not points).
        """
        self.pace, self.pace_after, self.pace_margin = list(pace), after, margin

    @property
    def behind_pace(self) -> bool:
        """Whether :meth:`race`'s rule stops this stage now."""
        n = self.last_round
        if not self.pace or not self.pace_after or n < self.pace_after:
            return False
        # Accuracies are ratios of counts: a gap of exactly the margin, as floats compute it,
        # can come out a hair above it (0.20 - 0.18 > 0.02), and is not "more than" the margin.
        return max(self.pace[:n]) - self.best_val > self.pace_margin + PACE_TOLERANCE

    @property
    def should_stop(self) -> bool:
        """Whether ``patience`` rounds have passed without a validation gain, and at least
        ``min_rounds`` rounds were recorded (never when ``patience`` is 0); or whether the stage
        trails the training it races (:meth:`race`). Rounds, not records: a run that validates
        every few rounds (``validate-every``) stops after as many rounds."""
        rounds = self.last_round
        patience = bool(self.patience) and self.stale >= self.patience and rounds >= self.min_rounds
        return patience or self.behind_pace

    def stop_reason(self) -> str:
        """Why :attr:`should_stop` holds, for the progress line."""
        if self.behind_pace:
            n = self.last_round
            return (
                f"best val {self.best_val:.4f} after {n} rounds, below the {max(self.pace[:n]):.4f} "
                "the other stage 0 reached by then, stopping"
            )
        return f"no validation gain for {self.patience} rounds, stopping"

    def progress_line(self, round_: int, rounds: int, last: bool = False) -> str | None:
        """A progress line for about five rounds a stage, ``None`` for the others.

        The rounds with a line are the first recorded, the last (or ``last``: the stage stops
        there) and the first recorded in each stretch of ``rounds // 5`` (every ``rounds // 5``-th where
        every round is validated; with ``validate-every`` the first validated in it).

        Args:
            round_ (int): the round just recorded.
            rounds (int): the stage's number of rounds.
            last (bool, optional): the stage ends with this round. (default: :obj:`False`)

        Returns:
            The line (stage, round, last train loss and validation accuracy, best so far), or
            ``None`` (also before the stage's first validation).
        """
        every = max(1, rounds // 5)
        said = getattr(self, "said_round", 0)  # a tracker of an older checkpoint lacks it
        shown = last or said == 0 or round_ == rounds or round_ // every > said // every
        if self.history and shown:
            self.said_round = round_
            row = self.history[-1]  # nothing to say before the first validation
            loss = f"loss {row['train_loss']:.4f}  " if "train_loss" in row else ""
            best = f"best {self.best_val:.4f}@{self.best_round}"
            return f"{self.name} round {round_:4d}/{rounds}  {loss}val {row['val_accuracy']:.4f}  {best}"
        return None

    def figures(self, seconds: float) -> dict[str, Any]:
        """The stage's figures for the run summary: best round and accuracy, model bytes, history.

        Args:
            seconds (float): the stage's wall-clock time.
        """
        return {
            "stage": self.stage,
            "rounds_run": self.last_round,  # rounds, not validations (validate-every)
            "best_round": self.best_round,
            "val_accuracy": self.best_val,
            "val_loss": self.best_val_loss,
            "bytes_model": self.model_bytes,
            "history": self.history,
            "seconds": seconds,
            **({"behind_pace": self.behind_pace} if self.pace else {}),
        }


def pace_by_round(history: list[dict[str, Any]]) -> list[float]:
    """A stage's validation accuracy at each round from 1 to its last recorded one: a round that
    was not validated (``validate-every``) carries the last validated figure on (0 before any)."""
    pace: list[float] = []
    for row in history:
        last = pace[-1] if pace else 0.0
        pace.extend([last] * (int(row["round"]) - 1 - len(pace)))
        pace.append(float(row["val_accuracy"]))
    return pace


def same_clients(result: dict[str, Any], last: dict[str, Any]) -> bool:
    """Whether two results were measured on the same clients: their ``members`` (the clients
    whose figures were summed, per-client rows or not), else their per-client rows (results with
    neither: one graph)."""
    if "members" in result and "members" in last:
        return list(result["members"]) == list(last["members"])
    if "clients" not in result or "clients" not in last:
        return True
    return [c["client"] for c in result["clients"]] == [c["client"] for c in last["clients"]]


def keep_best_stage(results: list[dict[str, Any]]) -> dict[str, Any]:
    """The model a run delivers: the best validation accuracy, then the lowest validation loss.

    The candidates are a lazy run's stages (every stage of every self-training pass, stage 0's
    MLP included: a later stage can validate worse than an earlier one on a graph whose
    neighbourhoods say little about a node) or a centralized run's passes. Only candidates
    measured on the same live clients as the last one compete: a validation accuracy is over
    the clients alive when it was measured, and losing a client whose nodes are hard would
    otherwise make a later candidate look better (or worse) than it is. The choice reads
    validation figures only; test accuracy is reported, never compared.

    Equal accuracies are common on small validation sets (a fifth of the default sweep's runs
    had two stages tied): the validation loss, a finer reading of the same nodes, breaks the
    tie. Where a tied candidate has no finite loss (a checkpoint of older code), losses are not
    compared; a full tie goes to the later candidate, which has trained on more.

    Args:
        results (list[dict]): one per candidate in order, each with ``val_accuracy``, optionally
            ``val_loss``, and, in a federated run, ``clients`` (the per-client rows, ``client``
            ids); the last is the run's last.
    """
    last = results[-1]
    eligible = [r for r in results if same_clients(r, last)]
    best = max(r["val_accuracy"] for r in eligible)
    tied = [r for r in eligible if r["val_accuracy"] == best]
    losses = [r.get("val_loss") for r in tied]
    if all(loss is not None and math.isfinite(loss) for loss in losses):  # every tied one measured it
        lowest = min(losses)
        tied = [r for r, loss in zip(tied, losses, strict=True) if loss == lowest]
    return tied[-1]
