"""Many small clients of one process trained in one computation: a round's cohort.

At one node a client (phones, ``--method node``) a round's trainers each hold one training row,
so a client's local steps and update encoding are a few thousand values of work behind a few
milliseconds of module calls, optimizer steps and codec checks; with 1,400 trainers a round
took 10-15 s on 2 cores. In process, a :class:`TrainCohort` runs the local steps of every
member of a train message as one batched computation (each member its own copy of the weights,
stacked), and encodes their updates in one pass per tensor
(:meth:`~retexo_fl.compress.updates.UpdateCodec.encode_many`). Each member still handles its
own message (validation, journal, residual, metrics); what it would have computed alone it takes
from the cohort, after checking that it trains from the state, and encodes the update and
residual, the cohort used.

Equal to training each member alone: the same dropout masks (each member's generator is seeded
and drawn from in the order its own steps draw), the same SGD arithmetic, batched matrix
products in place of one per member (float rounding apart: ``tests/party/test_cohort.py``
bounds it), and update frames equal byte for byte for equal weights. Only what batches exactly
like that joins a cohort: stage 0's MLP (a row-wise stage), SGD without momentum, no drift
correction, secure aggregation or time-based rounds, on the CPU, with few training rows per
member; every other client trains alone as before.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from retexo_fl import protocol as P
from retexo_fl.models.dropout import keep_mask
from retexo_fl.models.stage import StageModel
from retexo_fl.party.model_exchange import UPDATE_TAG
from retexo_fl.records import StateDict
from retexo_fl.seeding import derive_seed, seed_dropout

if TYPE_CHECKING:
    from retexo_fl.party.lazy_client import LazyClient

#: A member trains at most this many rows: the cohort pads every member to the largest.
MAX_MEMBER_ROWS = 16
#: A cohort needs at least this many members; fewer train alone.
MIN_MEMBERS = 8
#: Weights of at most this many members' models are stacked at once (float32 values).
_STACKED_VALUES = 1 << 26
_MLP_KEYS = frozenset({"body.weight", "body.bias", "head.weight", "head.bias"})


def _same_state(a: StateDict, b: StateDict) -> bool:
    if a is b:
        return True
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


class TrainCohort:
    """The members of one train message that train as one batched computation.

    Built by :meth:`gather`; a member's :meth:`~retexo_fl.party.lazy_client.LazyClient.train`
    asks :meth:`trained` and its update encoding :meth:`encoded`. The first call computes every
    member's result, from the state and round it is given; a member whose own call brings
    another state (or, for the encoding, another residual) is answered ``None`` and computes
    alone.

    Args:
        members (dict[int, LazyClient]): by partition id.
    """

    def __init__(self, members: dict[int, LazyClient]) -> None:
        self.members = members
        self.state: StateDict | None = None
        self.round = 0
        self.results: dict[int, tuple[StateDict, float, int]] = {}
        self.frames: dict[int, tuple[dict[str, bytes], StateDict, StateDict | None]] = {}

    @staticmethod
    def eligible(client: LazyClient) -> bool:
        """Whether ``client``'s round batches exactly with others' (see the module)."""
        cfg = client.cfg
        if cfg.mode != "lazy" or cfg.optimizer != "sgd" or cfg.momentum != 0 or cfg.norm != "none":
            return False
        if cfg.drift_correction != "none" or cfg.secure_aggregation or cfg.round_seconds:
            return False
        if client.device.type != "cpu" or client.delay or not client.row_wise:
            return False
        rows = client.num_train
        return 1 <= rows <= MAX_MEMBER_ROWS

    @classmethod
    def gather(
        cls, clients: Mapping[int, LazyClient], requests: Mapping[int, P.Records]
    ) -> TrainCohort | None:
        """The cohort of a train message's requests (``None`` below :data:`MIN_MEMBERS`).

        Args:
            clients (Mapping[int, LazyClient]): the addressed clients, by partition id.
            requests (Mapping[int, Records]): their train requests.
        """
        members = {
            pid: client
            for pid, client in clients.items()
            if not requests[pid][P.CONFIG].get(P.VALIDATE_ONLY) and cls.eligible(client)
        }
        stages = {client.stage for client in members.values()}
        if len(members) < MIN_MEMBERS or len(stages) != 1:
            return None
        return cls(members)

    # -- local steps ------------------------------------------------------------------------
    def trained(
        self, client: LazyClient, state: StateDict, round_: int
    ) -> tuple[StateDict, float, int] | None:
        """``client``'s ``(new state, first step's loss, steps)`` from ``state`` in ``round_``, or
        ``None``: it trains alone."""
        if client.id not in self.members:
            return None
        if self.state is None:
            self.state, self.round = state, round_
            self._train_all(client, state, round_)
        if round_ != self.round or client.id not in self.results or not _same_state(state, self.state):
            return None
        return self.results[client.id]

    def _train_all(self, first: LazyClient, state: StateDict, round_: int) -> None:
        model = first.loaded_model(state)
        if not isinstance(model, StageModel) or model.kind != "mlp" or set(state) != _MLP_KEYS:
            return
        steps, deadline = first.step_budget()
        if deadline is not None or steps < 1:
            return
        lr = float(first.cfg.per_stage("lr", first.layer_index()))
        ids = list(self.members)
        per_member = sum(v.numel() for v in state.values())
        size = max(1, _STACKED_VALUES // max(per_member, 1))
        for start in range(0, len(ids), size):
            chunk = [self.members[pid] for pid in ids[start : start + size]]
            news, losses = _mlp_steps(chunk, state, round_, steps, lr, model)
            for client, new, loss in zip(chunk, news, losses, strict=True):
                self.results[client.id] = (new, loss, steps)

    # -- update encoding --------------------------------------------------------------------
    def encoded(
        self, client: LazyClient, new: StateDict, base: StateDict, residual: StateDict | None
    ) -> tuple[dict[str, bytes], StateDict] | None:
        """``client``'s update frames and next residual, or ``None``: it encodes alone.

        Every member's update is encoded on the first call, from the state the cohort trained
        it to and its residual then; a member whose own call brings another state, base or
        residual (a round sent again restores the residual it began with) encodes alone.
        """
        if client.id not in self.results or client.update_codec is None or self.state is None:
            return None
        if not self.frames:
            self._encode_all(client)
        got = self.frames.get(client.id)
        if got is None:
            return None
        frames, kept, used = got
        if new is not self.results[client.id][0] or base is not self.state or residual is not used:
            return None
        return frames, kept

    def _encode_all(self, first: LazyClient) -> None:
        codec = first.update_codec
        assert codec is not None and self.state is not None
        ids = [pid for pid in self.members if pid in self.results]
        stage = first.seed_stage
        residuals = [None if self.round == 1 else self.members[pid].residual for pid in ids]
        generators = [
            torch.Generator().manual_seed(derive_seed(first.cfg.seed, stage, self.round, UPDATE_TAG, pid))
            for pid in ids
        ]
        news = [self.results[pid][0] for pid in ids]
        wheres = [f"client {pid}, stage {stage} update" for pid in ids]
        try:
            coded = codec.encode_many(news, self.state, residuals, generators, wheres)
        except ValueError:
            return  # each member encodes alone and names its own fault
        for pid, residual, (frames, kept) in zip(ids, residuals, coded, strict=True):
            self.frames[pid] = (frames, kept, residual)


def _mlp_steps(
    members: list[LazyClient], state: StateDict, round_: int, steps: int, lr: float, model: StageModel
) -> tuple[list[StateDict], list[float]]:
    """Every member's local SGD steps on stage 0's MLP, weights stacked ``[members, ...]``.

    A member alone runs ``Linear -> ReLU -> dropout -> Linear`` on its input rows after input
    dropout, the cross-entropy mean over its rows, and ``p -= lr * (grad + wd * p)``; here each
    of those is one batched operation over the members, rows padded to the largest member's
    (padded rows weigh nothing). The masks are drawn per member, seeded as its own round is,
    in its steps' order: input mask, then hidden mask, each step.

    Shapes:
        - **output:** per member a state of ``state``'s shapes (views of one stacked tensor per
          key), and the first step's loss
    """
    cfg = members[0].cfg
    n, width = len(members), max(m.num_train for m in members)
    features, hidden = state["body.weight"].shape[1], state["body.weight"].shape[0]
    x = torch.zeros(n, width, features)
    labels = torch.zeros(n, width, dtype=torch.long)
    weight = torch.zeros(n, width)
    p_in, p_hidden = model.input_dropout.p, model.dropout.p
    masks_in = torch.ones(steps, n, width, features) if p_in > 0 else None
    masks_hidden = torch.ones(steps, n, width, hidden) if p_hidden > 0 else None
    for i, member in enumerate(members):
        rows = member.split_rows("train")
        r = rows.numel()
        x[i, :r] = member.owned.index_select(0, rows)
        labels[i, :r] = member.train_labels()
        weight[i, :r] = 1.0 / r
        seed_dropout(derive_seed(cfg.seed, *member.seed_tags(round_)), member.device)
        for s in range(steps):  # the draws of its own steps, in their order
            if masks_in is not None:
                masks_in[s, i, :r] = _mask((r, features), p_in)
            if masks_hidden is not None:
                masks_hidden[s, i, :r] = _mask((r, hidden), p_hidden)
    params = [state[k].detach().float().unsqueeze(0).repeat(n, *([1] * state[k].dim())) for k in _ORDER]
    w1, b1, w2, b2 = (p.requires_grad_() for p in params)
    decay = cfg.weight_decay
    first: Tensor | None = None
    for s in range(steps):
        inputs = x if masks_in is None else x * masks_in[s]
        h = torch.relu(torch.baddbmm(b1.unsqueeze(1), inputs, w1.transpose(1, 2)))
        if masks_hidden is not None:
            h = h * masks_hidden[s]
        logits = torch.baddbmm(b2.unsqueeze(1), h, w2.transpose(1, 2))
        per_row = torch.nn.functional.cross_entropy(
            logits.reshape(n * width, -1), labels.view(-1), reduction="none"
        ).view(n, width)
        losses = (per_row * weight).sum(dim=1)
        grads = torch.autograd.grad(losses.sum(), [w1, b1, w2, b2])
        if first is None:
            first = losses.detach()
        with torch.no_grad():
            for p, g in zip((w1, b1, w2, b2), grads, strict=True):
                p.add_(g.add(p, alpha=decay) if decay else g, alpha=-lr)
    assert first is not None  # steps >= 1
    stacked = {k: p.detach().to(state[k].dtype) for k, p in zip(_ORDER, (w1, b1, w2, b2), strict=True)}
    news = [{k: stacked[k][i] for k in state} for i in range(n)]
    return news, first.tolist()


_ORDER = ("body.weight", "body.bias", "head.weight", "head.bias")


def _mask(shape: tuple[int, int], p: float) -> Tensor:
    """A member's dropout mask, as :class:`~retexo_fl.models.dropout.Dropout` draws it."""
    if p >= 1.0:
        return torch.zeros(shape)
    return keep_mask(shape, p, dtype=torch.float32, device=torch.device("cpu"))
