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
        logits (Tensor): predictions for the owned nodes.
        y (Tensor): labels; only the training nodes' are kept.
        train_mask (Tensor): the given training nodes.
        val_mask (Tensor): validation nodes, never labeled.
        threshold (float): softmax probability a prediction needs, in ``[0, 1]``; 0 with
            ``per_class`` takes the most confident ``per_class`` of each class, however confident.
        per_class (int, optional): the most nodes labeled per predicted class; :obj:`0` means no
            cap. (default: :obj:`0`)

    Shapes:
        - **input:** ``logits`` ``[n, C]``; ``y``, ``train_mask``, ``val_mask`` ``[n]``
        - **output:** ``labels`` ``[n]`` (``y``'s dtype), ``mask`` ``[n]`` (bool)

    Returns:
        ``(labels, mask)``: the given labels on training nodes and the predicted class on every
        other node (only the new mask's nodes are meant to be read), and the new training mask
        (the given one plus the selected nodes).
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
