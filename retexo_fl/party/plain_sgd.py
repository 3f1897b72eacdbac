"""SGD without momentum, as ``torch.optim.SGD`` steps it, without ``torch.optim``.

A client's local steps default to plain SGD. ``torch.optim``'s first optimizer in a process
imports ``torch._dynamo`` (its ``add_param_group`` is wrapped to disable compilation): 2.9 s on
2 cores after the client's own imports, measured in a fresh process (7.4-7.6 s against
4.5-4.7 s). A Flower ClientApp process per message paid it on every message that trains an MLP
stage 0, the one kind that reads no PyG layer (PyG's import brings ``torch._dynamo`` too, so a
GNN stage's message, the default local stage 0's included, gains nothing). This class does the same arithmetic
``torch.optim.SGD(lr=lr, momentum=0, weight_decay=wd)`` does: its one-tensor loop on the CPU,
its ``_foreach`` ops elsewhere (as torch picks them), so a step changes no bit
(``tests/party/test_plain_sgd.py``).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor


class PlainSGD:
    """``p -= lr * (grad + weight_decay * p)`` for each parameter with a gradient.

    Args:
        params (Iterable[Tensor]): the parameters (``model.parameters()``).
        lr (float): the learning rate.
        weight_decay (float, optional): L2 weight decay. (default: :obj:`0.0`)
    """

    def __init__(self, params: Iterable[Tensor], lr: float, weight_decay: float = 0.0) -> None:
        self.params = [p for p in params if p.requires_grad]
        self.lr = float(lr)
        self.weight_decay = float(weight_decay)

    @property
    def param_groups(self) -> list[dict]:
        """One group, keyed as ``torch.optim.SGD``'s are: what code reading an optimizer's
        settings finds."""
        return [{"params": self.params, "lr": self.lr, "weight_decay": self.weight_decay, "momentum": 0.0}]

    def zero_grad(self) -> None:
        """Drop every gradient (``torch.optim``'s default, ``set_to_none=True``)."""
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self) -> None:
        """One step over the parameters that have a gradient."""
        params = [p for p in self.params if p.grad is not None]
        if not params:
            return
        grads = [p.grad for p in params]
        if all(p.device.type == "cpu" for p in params):  # torch.optim.SGD's one-tensor loop
            for p, g in zip(params, grads, strict=True):
                if self.weight_decay != 0:
                    g = g.add(p, alpha=self.weight_decay)
                p.add_(g, alpha=-self.lr)
            return
        # Elsewhere (CUDA) torch.optim.SGD runs its _foreach ops, per device and dtype.
        groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
        for i, p in enumerate(params):
            groups.setdefault((p.device, p.dtype), []).append(i)
        for index in groups.values():
            ps, gs = [params[i] for i in index], [grads[i] for i in index]
            if self.weight_decay != 0:
                gs = torch._foreach_add(gs, ps, alpha=self.weight_decay)
            torch._foreach_add_(ps, gs, alpha=-self.lr)
