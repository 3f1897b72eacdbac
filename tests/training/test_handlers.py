"""The client handlers both engines call: each message type does one thing, and says when the
node must save."""

from __future__ import annotations

import re

import pytest
import torch

from retexo_fl import protocol as P
from retexo_fl.config import TrainConfig
from retexo_fl.coordinator.federation import FederationView
from retexo_fl.data.partitioners import partition_graph
from retexo_fl.metrics import RunRecorder
from retexo_fl.party.eager_client import EagerClient
from retexo_fl.party.handlers import handle
from retexo_fl.party.lazy_client import LazyClient
from retexo_fl.training.inprocess import InProcessTransport


def _lazy(sbm, **kw):
    cfg = TrainConfig.resolve(profile="exact", clients=3, stages=2, hidden=8, **kw)
    clients = [LazyClient(p, cfg) for p in partition_graph(sbm, 3, "random", seed=0)]
    fed = FederationView(InProcessTransport(clients), cfg, RunRecorder(None, stream=None))
    return cfg, clients, fed


def test_train_validates_trains_and_reports(sbm):
    _, clients, fed = _lazy(sbm)
    fed.setup()
    state = clients[0].make_model().state_dict()
    first = handle(clients[0], P.TRAIN, fed.content(state, **{P.ROUND: 1, P.VALIDATE: False}))
    m = first.records[P.METRICS]
    assert m[P.VAL_COUNT] == 0 and m[P.NUM_EXAMPLES] == clients[0].num_train and m[P.LOCAL_STEPS] == 1
    assert set(first.records[P.ARRAYS]) == set(state) and not first.changed  # nothing node-local moved
    second = handle(clients[0], P.TRAIN, fed.content(state, **{P.ROUND: 2, P.VALIDATE: True}))
    assert second.records[P.METRICS][P.VAL_COUNT] == int(clients[0].masks["val"].sum()) > 0
    # The same state, round and seed train to the same update: the handler is a pure step.
    again = handle(clients[0], P.TRAIN, fed.content(state, **{P.ROUND: 2, P.VALIDATE: True}))
    assert all(torch.equal(again.records[P.ARRAYS][k], second.records[P.ARRAYS][k]) for k in state)


def test_deliveries_and_embeddings_change_what_the_node_keeps(sbm):
    _, clients, fed = _lazy(sbm)
    degrees = fed.setup()
    state = clients[1].make_model().state_dict()
    reply = handle(clients[1], P.EMBED, fed.content(state, **{P.STAGE: 0}))
    assert reply.changed and clients[1].stage == 1
    sent = reply.records[P.PAYLOADS]
    assert sorted(P.parse_outgoing_key(k) for k in sent) == sorted(clients[1].plan.send)
    # Asked again (a resumed server): the same sealed frames, nothing recomputed.
    assert handle(clients[1], P.EMBED, fed.content(state, **{P.STAGE: 0})).records[P.PAYLOADS] == sent
    # Stage 1's first message brings the peers' rows and the degrees: the node must keep them.
    outgoing = {1: sent}
    for c in clients[::2]:
        outgoing[c.id] = handle(c, P.EMBED, fed.content(state, **{P.STAGE: 0})).records[P.PAYLOADS]
    deliveries = fed.route(outgoing, P.HALO)
    for pid, frames in degrees.items():
        deliveries[pid].update(frames)
    conv = clients[0].make_model().state_dict()
    assert clients[0].halo is None
    assert handle(clients[0], P.EVALUATE, fed.content(conv, deliveries[0], **{P.SPLIT: "val"})).changed
    assert clients[0].halo.shape == (clients[0].plan.num_halo, 8)


def test_bad_messages_are_refused_by_name(sbm):
    _, clients, fed = _lazy(sbm)
    # Under secure aggregation a client's test counts leave masked only: an embed that asks for
    # them in clear (as a coordinator could, message by message) is refused.
    _, secure, _ = _lazy(sbm, secure_aggregation=True)
    with pytest.raises(ValueError, match=r"unknown message type 'query\.nope'"):
        handle(clients[0], "query.nope", {})
    eager = EagerClient(
        clients[0].part, TrainConfig.resolve(profile="exact", mode="eager", clients=3, stages=2, hidden=8)
    )
    with pytest.raises(ValueError, match=r"query\.embed is a lazy-mode message, this run is eager"):
        handle(eager, P.EMBED, fed.content(clients[0].make_model().state_dict(), **{P.STAGE: 0}))
    state = clients[1].make_model().state_dict()
    with pytest.raises(ValueError, match=r"an embed tests the test split only, not 'val'"):
        handle(clients[1], P.EMBED, fed.content(state, **{P.STAGE: 0, P.SPLIT: "val"}))
    with pytest.raises(ValueError, match=r"client 1: under secure aggregation a test is masked"):
        handle(secure[1], P.EMBED, fed.content(state, **{P.STAGE: 0, P.SPLIT: "test"}))
    with pytest.raises(ValueError, match=r"expected 'deg\|halo-from-<client id>'"):
        handle(clients[0], P.EVALUATE, {P.PAYLOADS: {"to-1": b"x"}, P.CONFIG: {P.SPLIT: "val"}})
    # Missed broadcast deltas come before the round's own, never alone, and in numbered steps.
    with pytest.raises(ValueError, match=r"client 0: missed broadcast deltas without the round's own"):
        handle(clients[0], P.TRAIN, {**fed.content(state, **{P.ROUND: 2}), P.MODEL_BEFORE: {"0/w": b"x"}})
    request = {P.CONFIG: {P.ROUND: 2, P.SPLIT: "val"}, P.MODEL: {"w": b"x"}, P.MODEL_BEFORE: {"w": b"x"}}
    with pytest.raises(ValueError, match=r"client 0: model-before key 'w'"):
        handle(clients[0], P.EVALUATE, request)


@pytest.mark.parametrize(
    ("kind", "value", "shown"),
    [(P.TRAIN, 1e37, "1e+37"), (P.EVALUATE, float("nan"), "nan"), (P.EMBED, -2e9, "2e+09")],
)
def test_a_state_whose_values_could_overflow_on_a_clients_data_is_refused_before_use(sbm, kind, value, shown):
    """Weights of 1e37 make a loss or a row overflow exactly where a raw feature passes a
    threshold, and a client that then refuses to go on answers that question: a received
    state is refused whole, naming the entry, whatever the client's data."""
    _, clients, fed = _lazy(sbm)
    fed.setup()
    state = clients[0].make_model().state_dict()
    state["body.weight"] = state["body.weight"].clone()
    state["body.weight"][0, 0] = value
    extra = {P.SPLIT: "val"} if kind == P.EVALUATE else {}
    with pytest.raises(
        ValueError,
        match=re.escape(
            f"client 0, stage 0, round 1: the received state's body.weight holds a value of magnitude {shown}"
        ),
    ):
        handle(clients[0], kind, fed.content(state, **{P.ROUND: 1, P.STAGE: 0, **extra}))
    fine = clients[0].make_model().state_dict()  # trained stages hold values of about 1
    assert handle(clients[0], P.TRAIN, fed.content(fine, **{P.ROUND: 1, P.STAGE: 0})).records


def test_a_control_variate_whose_values_could_overflow_is_refused_as_a_state_is(sbm):
    """SCAFFOLD's control variate is added to every local step's gradient: held to the same bound."""
    _, clients, fed = _lazy(sbm, drift_correction="scaffold")
    fed.setup()
    state = clients[0].make_model().state_dict()
    control = {k: torch.zeros_like(v) for k, v in state.items()}
    control["head.weight"][0, 0] = 1e37
    request = {**fed.content(state, **{P.ROUND: 2, P.STAGE: 0}), P.CONTROL: control}
    with pytest.raises(
        ValueError,
        match=re.escape("client 0, stage 0, round 2: the received state's head.weight holds a value"),
    ):
        handle(clients[0], P.TRAIN, request)
