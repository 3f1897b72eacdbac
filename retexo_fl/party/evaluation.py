"""A client's evaluation of a state on one of its splits: accuracy and summed loss, read in one
transfer from the device."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from retexo_fl.records import EvalResult, StateDict


class Evaluation:
    """The evaluation seam of :class:`~retexo_fl.party.client.Client` (a mixin over its model,
    split rows and labels)."""

    # The client's own (:class:`~retexo_fl.party.client.Client`):
    y: Tensor
    loaded_model: Callable[[StateDict], torch.nn.Module]
    split_rows: Callable[[str], Tensor]
    forward: Callable[..., Tensor]

    @torch.no_grad()
    def evaluate(self, state: StateDict, split: str) -> EvalResult:
        """``state``'s accuracy and summed loss on this client's ``split`` nodes."""
        rows = self.split_rows(split)
        count = rows.numel()
        if count == 0:  # nothing to evaluate: the state is not even loaded (most clients at node level)
            return EvalResult(0, 0, 0.0)
        model = self.loaded_model(state)
        model.eval()
        logits = self.forward(model, rows)
        y = self.y.index_select(0, rows)
        loss = torch.nn.functional.cross_entropy(logits, y, reduction="sum")
        correct = (logits.argmax(1) == y).sum()
        # One read for both (exact: a float32 loss and a count below 2^53 are float64 values).
        got_correct, got_loss = torch.stack([correct.double(), loss.double()]).tolist()
        return EvalResult(int(got_correct), count, got_loss)
