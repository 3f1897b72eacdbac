"""Self-training labels: a client's own confident predictions on its unlabeled nodes."""

from __future__ import annotations

import torch
from torch import Tensor


def pseudo_labels(
    logits: Tensor,
    y: Tensor,
    train_mask: Tensor,
    val_mask: Tensor,
    threshold: float,
    per_class: int = 0,
) -> tuple[Tensor, Tensor]:
    """Labels and training mask extended by predictions made with at least ``threshold`` confidence.

    Validation nodes are never labeled, so that model selection stays honest; every other
    node outside the training set is a candidate (its true label, if any, is not read).
    With ``per_class`` > 0 at most that many candidates are taken per predicted class, the
    most confident first (Li et al., 2018): a class the model over-predicts then cannot
    crowd the others out of the new training set.

    Args:
        logits: ``[n, C]`` predictions for the owned nodes.
        y: ``[n]`` labels; only the training nodes' are kept.
        train_mask: ``[n]`` the given training nodes.
        val_mask: ``[n]`` validation nodes, never labeled.
        threshold: softmax probability a prediction needs, in ``[0, 1]``; 0 with ``per_class``
            takes the most confident ``per_class`` of each class, however confident.
        per_class: the most nodes labeled per predicted class; 0 (default) means no cap.

    Returns:
        ``(labels, mask)``: ``[n]`` labels (given ones on training nodes, predicted ones on the
        selected nodes) and ``[n]`` the new training mask.
    """
    conf, pred = torch.softmax(logits.float(), dim=1).max(dim=1)
    chosen = ~train_mask & ~val_mask & (conf >= threshold)
    if per_class > 0:
        capped = torch.zeros_like(chosen)
        for c in pred[chosen].unique():
            idx = torch.nonzero(chosen & (pred == c)).view(-1)
            # Stable, so that ties go to the lower node index on every machine.
            order = torch.argsort(conf[idx], descending=True, stable=True)
            capped[idx[order[:per_class]]] = True
        chosen = capped
    labels = torch.where(train_mask, y, pred.to(y.dtype))
    return labels, train_mask | chosen
