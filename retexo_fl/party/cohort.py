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

Equal, bit for bit, to training each member alone: the same dropout masks (each member's
generator is seeded and drawn from in the order its own steps draw), each member's own
``Linear`` calls (a batched product sums dot products in another order), the same loss and SGD
arithmetic batched element by element, and update frames equal byte for byte
(``tests/training/test_cohort.py``). Only what batches exactly like that joins a cohort: stage
0's MLP or a GCN stage, SGD without momentum, no drift correction, secure aggregation or
time-based rounds, on the CPU, with few training rows per member or a small stage input (a
partition of a small graph: there a round's fixed costs are most of it); every other client
trains alone as before. ``--cohorts false`` trains every client alone.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from retexo_fl import protocol as P
from retexo_fl.models.adjacency import csr_tensor
from retexo_fl.models.dropout import keep_mask
from retexo_fl.models.stage import StageModel
from retexo_fl.party.model_exchange import UPDATE_TAG
from retexo_fl.records import StateDict, same_bits
from retexo_fl.seeding import derive_seed, dropout_stream

if TYPE_CHECKING:
    from retexo_fl.party.lazy_client import LazyClient

#: A member joins when it trains at most this many rows (the cohort pads every member to the
#: largest) ...
MAX_MEMBER_ROWS = 16
#: ... or when the input its dropout covers (:func:`covered_values`) holds at most this many
#: values. With 10 random clients at the default width of 32, the cohort made whole runs 4-23%
#: faster where a member's GCN-stage input held up to 21,500 to 52,600 values (Chameleon,
#: squirrel, Twitch PTBR; Chameleon's stage-0 MLP, up to 114,000, joined too), no faster or
#: slower beyond noise at 120,500 (Twitch ENGB's GCN stages), and 53% slower at 313,000
#: (Tolokers' GCN stages: their input masks are drawn whole) and 37% slower at 1.45 million
#: (Twitch ENGB's stage 0).
MAX_MEMBER_VALUES = 1 << 17
#: A cohort needs at least this many members; fewer train alone.
MIN_MEMBERS = 8
#: Members are trained and encoded in chunks of about this many weights (float32 values), so
#: that a chunk's stacked weights, gradients and codes stay in the cache across its steps: one
#: chunk of all 1,625 trainers of a Cora round (75 million weights) made every step a pass over
#: memory, 2.1 ms a member's steps against 1.1 ms in chunks of 11 (cProfile, 5 rounds).
_CHUNK_VALUES = 1 << 19
#: ... and of at most this many input values (:func:`covered_values`) together: a chunk draws
#: every step's input masks before its first step, 16 MB a step at this size, where 400 members
#: at :data:`MAX_MEMBER_VALUES` each would have drawn 210 MB a step.
_CHUNK_INPUT_VALUES = 1 << 22


class TrainCohort:
    """The members of one train message that train as one batched computation.

    Built by :meth:`gather`; a member's :meth:`~retexo_fl.party.lazy_client.LazyClient.train`
    asks :meth:`trained` and its update encoding :meth:`encoded`. The first call computes every
    member's result, from the state and round it is given; a member whose own call brings
    another state (or, for the encoding, another residual) is answered ``None`` and computes
    alone.

    Args:
        members (dict[int, LazyClient]): by partition id (:attr:`~retexo_fl.party.client.Client.id`).
    """

    def __init__(self, members: dict[int, LazyClient]) -> None:
        self.members = members
        self.state: StateDict | None = None
        self.round = 0
        self.results: dict[int, tuple[StateDict, float, int]] = {}
        self.sources: dict[int, Tensor] = {}  # the stage input each result was trained on
        self.frames: dict[int, tuple[dict[str, bytes], StateDict, StateDict | None]] = {}

    @staticmethod
    def eligible(client: LazyClient) -> bool:
        """Whether ``client``'s round batches exactly with others' (see the module)."""
        cfg = client.cfg
        if not cfg.cohorts or cfg.mode != "lazy":
            return False
        if cfg.optimizer != "sgd" or cfg.momentum != 0 or cfg.norm != "none":
            return False
        if cfg.drift_correction != "none" or cfg.secure_aggregation or cfg.round_seconds:
            return False
        if client.device.type != "cpu" or client.delay:
            return False
        if not client.row_wise and (cfg.model != "gcn" or cfg.chunk_rows or cfg.precompute):
            return False
        rows = client.num_train
        if rows < 1:
            return False
        return rows <= MAX_MEMBER_ROWS or covered_values(client) <= MAX_MEMBER_VALUES

    @classmethod
    def gather(
        cls, clients: Mapping[int, LazyClient], requests: Mapping[int, P.Records]
    ) -> TrainCohort | None:
        """The cohort of a train message's requests (``None`` below :data:`MIN_MEMBERS`).

        Args:
            clients (Mapping[int, LazyClient]): the addressed clients, by address.
            requests (Mapping[int, Records]): their train requests, by the same addresses.
        """
        for address, client in clients.items():  # what a layer-0 stage is, before it is read
            if P.FIRST_STAGE in requests[address][P.CONFIG]:
                client.set_first_stage(requests[address][P.CONFIG][P.FIRST_STAGE])
        members = {  # by the client's own id, whatever the transport addresses it by
            client.id: client
            for address, client in clients.items()
            if not requests[address][P.CONFIG].get(P.VALIDATE_ONLY) and cls.eligible(client)
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
        if round_ != self.round or client.id not in self.results or not same_bits(state, self.state):
            return None
        if client.stage_input() is not self.sources[client.id]:  # its input changed since
            return None
        return self.results[client.id]

    def _train_all(self, first: LazyClient, state: StateDict, round_: int) -> None:
        model = first.loaded_model(state)
        if not isinstance(model, StageModel) or model.root is not None:
            return
        if model.kind == "mlp":
            keys = _MLP_KEYS
        elif model.kind == "gcn" and model.body.in_channels <= model.body.out_channels:
            keys = _GCN_KEYS  # run_conv's (A x) W: what the batched step computes
        else:
            return
        if set(state) != set(keys):
            return
        steps, deadline = first.step_budget()
        if deadline is not None or steps < 1:
            return
        lr = float(first.cfg.per_stage("lr", first.layer_index()))
        # A conv stage's first round brings the halo rows: the members whose message has not
        # been handled yet have none, and train alone when their turn comes.
        ids = [pid for pid, member in self.members.items() if _ready(member)]
        for chunk in _input_chunks([self.members[pid] for pid in ids], _chunk(state)):
            news, losses = _stage_steps(chunk, state, round_, steps, lr, model)
            for client, new, loss in zip(chunk, news, losses, strict=True):
                self.results[client.id] = (new, loss, steps)
                self.sources[client.id] = client.stage_input()

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
        # Each member's residual as its own round will find it (begin_round): none in round 1,
        # and none where it last encoded in another stage or training (a member sampled out of
        # this stage's first rounds still holds the last stage's, of another model's shapes).
        trial = [int(stage), int(first.round_trial)]

        def residual(member: LazyClient) -> StateDict | None:
            journal = member.journal
            if self.round == 1 or journal is None or journal[0][:2] != trial:
                return None
            return member.residual

        residuals = [residual(self.members[pid]) for pid in ids]
        generators = [
            torch.Generator().manual_seed(derive_seed(first.cfg.seed, stage, self.round, UPDATE_TAG, pid))
            for pid in ids
        ]
        news = [self.results[pid][0] for pid in ids]
        wheres = [f"client {pid}, stage {stage} update" for pid in ids]
        size = _chunk(self.state)
        for lo in range(0, len(ids), size):
            part = slice(lo, lo + size)
            try:
                coded = codec.encode_many(
                    news[part], self.state, residuals[part], generators[part], wheres[part]
                )
            except (ValueError, RuntimeError):
                continue  # each member encodes alone and names its own fault
            for pid, residual, (frames, kept) in zip(ids[part], residuals[part], coded, strict=True):
                self.frames[pid] = (frames, kept, residual)


def _stage_steps(
    members: list[LazyClient], state: StateDict, round_: int, steps: int, lr: float, model: StageModel
) -> tuple[list[StateDict], list[float]]:
    """Every member's local SGD steps on one stage, weights stacked ``[members, ...]``.

    A member alone runs, each step, input dropout on its stage input, the stage's linear map
    (stage 0's MLP on its training rows; a GCN stage on ``A x`` of its training rows, ``A`` the
    rows' in-edges, as :func:`~retexo_fl.models.adjacency.run_conv` computes a layer that does
    not narrow), ReLU, dropout, the head, the cross-entropy mean over its rows, and ``p -= lr *
    (grad + wd * p)``. Here each of those but the linear maps is one batched operation over the
    members (the GCN aggregation one block-diagonal product, whose rows are the members' own in
    order; the linear maps one call per member, :func:`_linear_each`), rows padded to the
    largest member's (padded rows are never read). The masks are drawn per member,
    seeded as its own round is, in its steps' order: input mask, then hidden mask, each step.

    Shapes:
        - **output:** per member a state of ``state``'s shapes (views of one stacked tensor per
          key), and the first step's loss
    """
    cfg = members[0].cfg
    conv = model.kind != "mlp"
    keys = _GCN_KEYS if conv else _MLP_KEYS
    n, width = len(members), max(m.num_train for m in members)
    hidden, features = state[keys[0]].shape
    labels = torch.zeros(n, width, dtype=torch.long)
    p_in, p_hidden = model.input_dropout.p, model.dropout.p
    inputs: list[Tensor] = []  # the stage input each member's input dropout covers
    graphs: list[Tensor] = []  # a GCN member's training rows' in-edges (CSR over its input)
    masks_in: list[list[Tensor | None]] = [[] for _ in range(steps)]
    masks_hidden = torch.ones(steps, n, width, hidden) if p_hidden > 0 else None
    for i, member in enumerate(members):
        rows = member.split_rows("train")
        r = rows.numel()
        labels[i, :r] = member.train_labels()
        if conv:
            inputs.append(member.stage_input())
            graphs.append(member.step_graph(model, rows, member.train_labels()))
            targets = member.graph.num_owned  # a conv stage's hidden mask covers every owned row
        else:
            inputs.append(member.owned.index_select(0, rows))
            targets = r
        with dropout_stream(derive_seed(cfg.seed, *member.seed_tags(round_)), member.device):
            for s in range(steps):  # the draws of its own steps, in their order
                masks_in[s].append(_mask(tuple(inputs[i].shape), p_in) if p_in > 0 else None)
                if masks_hidden is not None:
                    mask = _mask((targets, hidden), p_hidden)
                    masks_hidden[s, i, :r] = mask[rows] if conv else mask
    stacked_inputs = torch.cat(inputs)
    block = _block_diagonal(graphs, [t.shape[0] for t in inputs]) if conv else None
    slots = torch.cat([torch.arange(m.num_train) + i * width for i, m in enumerate(members)])
    params = [state[k].detach().float().unsqueeze(0).repeat(n, *([1] * state[k].dim())) for k in keys]
    w1, b1, w2, b2 = (p.requires_grad_() for p in params)
    decay = members[0].weight_decay()
    counts = [m.num_train for m in members]
    first: Tensor | None = None
    for s in range(steps):
        x = stacked_inputs
        if p_in > 0:
            x = x * torch.cat([m for m in masks_in[s] if m is not None])
        if block is not None:
            x = torch.sparse.mm(block, x)  # each member's training rows, as its own product
        rows_in = torch.zeros(n * width, features)
        rows_in[slots] = x
        # A GCN stage alone adds its bias after the map (run_conv: conv.lin(A x) + bias); a
        # Linear with the bias folded in rounds otherwise once the rows are 256 wide or more.
        h = torch.relu(_linear_each(rows_in.view(n, width, features), w1, b1, counts, bias_after=conv))
        if masks_hidden is not None:
            h = h * masks_hidden[s]
        logits = _linear_each(h, w2, b2, counts)
        # Each member's own mean over its rows: the sum divided by the count, as it computes it.
        losses = torch.stack(
            [torch.nn.functional.cross_entropy(logits[i, :r], labels[i, :r]) for i, r in enumerate(counts)]
        )
        grads = torch.autograd.grad(losses.sum(), [w1, b1, w2, b2])
        if first is None:
            first = losses.detach()
        with torch.no_grad():
            for p, g in zip((w1, b1, w2, b2), grads, strict=True):
                p.add_(g.add(p, alpha=decay) if decay else g, alpha=-lr)
    assert first is not None  # steps >= 1
    trained = {k: p.detach().to(state[k].dtype) for k, p in zip(keys, (w1, b1, w2, b2), strict=True)}
    news = [{k: trained[k][i] for k in state} for i in range(n)]
    return news, first.tolist()


def _linear_each(
    x: Tensor, weight: Tensor, bias: Tensor, counts: list[int], bias_after: bool = False
) -> Tensor:
    """Member ``i``'s ``Linear`` on its own ``counts[i]`` rows of ``x[i]``, padded back to
    ``x``'s rows with zeros.

    One call per member, not one batched product: a batched product sums each dot product in
    another order than the member's own ``Linear`` over its rows (on Cora's 1,433 features, 45
    of 64 members' weights differed by up to 1.3e-6 after one round), and 8-bit updates turn
    such differences into another run. With ``bias_after`` the bias is added after the product,
    as a GCN layer adds it; else it is folded into it, as ``nn.Linear`` does. The two round
    differently once the rows are 256 wide or more.

    Shapes:
        - **input:** ``x`` ``[n, width, in]``, ``weight`` ``[n, out, in]``, ``bias`` ``[n, out]``
        - **output:** ``[n, width, out]``
    """
    width = x.shape[1]
    if bias_after:  # the map, then the bias added: as a GCN layer computes it (run_conv)
        rows = [torch.nn.functional.linear(x[i, :r], weight[i]) + bias[i] for i, r in enumerate(counts)]
    else:
        rows = [torch.nn.functional.linear(x[i, :r], weight[i], bias[i]) for i, r in enumerate(counts)]
    if all(r == width for r in counts):
        return torch.stack(rows)
    return torch.stack([torch.nn.functional.pad(t, (0, 0, 0, width - t.shape[0])) for t in rows])


def covered_values(client: LazyClient) -> int:
    """The values of the input a member's dropout covers in a step: its training rows for an
    MLP stage, its owned rows for a local stage 0 (its own edges' messages), its owned and halo
    rows for a later conv stage; times their width."""
    if client.row_wise:
        rows = client.num_train
    elif client.layer == 0:  # a local stage 0 reads its owned rows alone
        rows = client.graph.num_owned
    else:
        rows = client.graph.num_owned + client.graph.num_halo
    return rows * client.owned.shape[1]


def _input_chunks(members: list[LazyClient], size: int) -> list[list[LazyClient]]:
    """``members`` in order, in chunks of at most ``size`` (:func:`_chunk`) whose covered inputs
    sum to at most :data:`_CHUNK_INPUT_VALUES` (a member over it alone): a chunk draws every
    step's input masks up front."""
    chunks: list[list[LazyClient]] = []
    current: list[LazyClient] = []
    total = 0
    for member in members:
        values = covered_values(member)
        if current and (len(current) >= size or total + values > _CHUNK_INPUT_VALUES):
            chunks.append(current)
            current, total = [], 0
        current.append(member)
        total += values
    if current:
        chunks.append(current)
    return chunks


def _chunk(state: StateDict) -> int:
    """Members per chunk for a model of ``state``'s size (at least 2)."""
    return max(2, _CHUNK_VALUES // max(1, sum(v.numel() for v in state.values())))


def _ready(member: LazyClient) -> bool:
    """Whether ``member`` holds its stage input (a conv stage's halo rows arrive with its own
    first train message of the stage)."""
    try:
        member.stage_input()
    except RuntimeError:
        return False
    return True


def _block_diagonal(graphs: list[Tensor], sources: list[int]) -> Tensor:
    """One CSR matrix whose rows are each graph's, in order, and whose columns are each graph's
    sources shifted past the earlier graphs': a product with it gives each graph's product."""
    crows, cols, values = [torch.zeros(1, dtype=torch.int64)], [], []
    entries = columns = 0
    for graph, width in zip(graphs, sources, strict=True):
        crows.append(graph.crow_indices()[1:].to(torch.int64) + entries)
        cols.append(graph.col_indices().to(torch.int64) + columns)
        values.append(graph.values())
        entries += graph.values().numel()
        columns += width
    rows = sum(g.shape[0] for g in graphs)
    return csr_tensor(torch.cat(crows), torch.cat(cols), torch.cat(values), (rows, columns))


#: The weights of stage 0's MLP and of a GCN stage, in the order the steps take them.
_MLP_KEYS = ("body.weight", "body.bias", "head.weight", "head.bias")
_GCN_KEYS = ("body.lin.weight", "body.bias", "head.weight", "head.bias")


def _mask(shape: tuple[int, int], p: float) -> Tensor:
    """A member's dropout mask, as :class:`~retexo_fl.models.dropout.Dropout` draws it."""
    if p >= 1.0:
        return torch.zeros(shape)
    return keep_mask(shape, p, dtype=torch.float32, device=torch.device("cpu"))
