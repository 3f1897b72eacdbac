"""A stage's kept state never travels twice: with compressed broadcasts, embed and evaluate
messages name it by digest (the client's view, or the copy a KEEP message told it to make), the
stage's last validation goes as the next broadcast delta, and a client that does not hold a named
state is sent it whole. The run ends exactly as when every state travels whole."""

from __future__ import annotations

import pytest
import torch

from retexo_fl import protocol as P
from retexo_fl.config import TrainConfig
from retexo_fl.coordinator.stages import LazyStageMachine
from retexo_fl.coordinator.transport import Batch
from retexo_fl.data.partitioners import partition_graph
from retexo_fl.metrics import RunRecorder
from retexo_fl.party.client import Client
from retexo_fl.party.lazy_client import LazyClient
from retexo_fl.records import same_bits, state_digest
from retexo_fl.training.inprocess import InProcessTransport

# Early stopping on (its best round is rarely the last), one self-training pass, 4-bit deltas.
# Stage 0 trained once, as the MLP: the carried states counted below are one training's (the
# default over partitions, first-stage auto, trains stage 0 twice; its own test is below).
CFG = dict(
    clients=3, model="gcn", stages=2, hidden=16, rounds=8, seed=0, patience=2, min_rounds=2, first_stage="mlp"
)


class Recording(InProcessTransport):
    """Records, per message type, how each request carried its state, and the NOT_HELD replies."""

    def __init__(self, clients: list[Client]) -> None:
        super().__init__(clients)
        self.carried: list[tuple[str, str]] = []  # (message type, "whole" | "held" | "delta" | "-")
        self.not_held = 0

    def send(self, kind: str, requests: dict, phase: str, stage: int) -> Batch:
        for r in requests.values():
            held = P.HELD in r[P.CONFIG]
            how = "whole" if P.ARRAYS in r else "delta" if P.MODEL in r else "held" if held else "-"
            self.carried.append((kind, how))
        batch = super().send(kind, requests, phase, stage)
        self.not_held += sum(P.NOT_HELD in r.get(P.METRICS, {}) for r in batch.replies.values())
        return batch


def _run(parts, **over) -> tuple[dict, Recording]:
    cfg = TrainConfig.resolve(**{**CFG, **over})
    transport = Recording([LazyClient(p, cfg) for p in parts])
    summary = LazyStageMachine(transport, cfg, RunRecorder(None, stream=None)).run()
    return summary, transport


def _curve(summary: dict) -> list[float]:
    return [h[k] for s in summary["stages"] for h in s["history"] for k in ("val_accuracy", "train_loss")]


def test_state_digest_sees_every_bit():
    state = {"w": torch.arange(6, dtype=torch.float32).view(2, 3), "b": torch.tensor(0.5)}
    same = {k: v.clone() for k, v in state.items()}
    assert state_digest(state) == state_digest(same)
    same["w"][1, 2] = torch.nextafter(same["w"][1, 2], torch.tensor(10.0))  # one ulp
    assert state_digest(state) != state_digest(same)
    assert state_digest(state) != state_digest({"w": state["w"].view(3, 2), "b": state["b"]})


def test_same_bits_is_the_digests_equality_without_hashing():
    state = {"w": torch.tensor([[0.0, 1.5], [float("nan"), -2.0]]), "b": torch.tensor(0.5)}
    copy = {k: v.clone() for k, v in state.items()}
    assert same_bits(state, copy) and state_digest(state) == state_digest(copy)  # NaN: same bits
    strided = {**copy, "w": copy["w"].t().contiguous().t()}  # the same bits laid out column-major
    assert not strided["w"].is_contiguous() and same_bits(state, strided)
    half = {"w": state["w"].to(torch.bfloat16)}  # a dtype numpy lacks
    assert same_bits(half, {"w": half["w"].clone()})
    assert not same_bits(half, {"w": half["w"].neg()})
    for changed in (
        {**copy, "w": torch.tensor([[-0.0, 1.5], [float("nan"), -2.0]])},  # equal values, not bits
        {**copy, "w": copy["w"].view(4)},
        {**copy, "b": copy["b"].double()},
        {"w": copy["w"]},
    ):
        assert not same_bits(state, changed) and state_digest(state) != state_digest(changed)


def test_a_broadcast_is_decoded_once_for_views_with_the_same_bits(sbm, monkeypatch):
    """Clients whose views hold the same bits in separate tensors (a Flower simulation actor reads
    each node's view from its own file) share one decode of a broadcast delta, and hold what each
    would have decoded alone; a view one ulp apart decodes its own."""
    from retexo_fl.compress.updates import UpdateCodec
    from retexo_fl.party import model_exchange

    cfg = TrainConfig.resolve(**{**CFG, "broadcast_bits": 8})
    a, b, c = (LazyClient(p, cfg) for p in partition_graph(sbm, 3, "random", seed=0))
    torch.manual_seed(0)
    base = {"weight": torch.randn(16, 8), "bias": torch.randn(16)}
    new = {k: v + 0.01 * torch.randn_like(v) for k, v in base.items()}
    frames, _ = UpdateCodec(8).encode(new, base, None, torch.Generator().manual_seed(0), where="server")
    decodes = []
    real = UpdateCodec.decode
    monkeypatch.setattr(UpdateCodec, "decode", lambda self, *args: decodes.append(1) or real(self, *args))
    monkeypatch.setattr(model_exchange, "_decoded", [])
    apart = {k: v.clone() for k, v in base.items()}
    apart["bias"][3] = torch.nextafter(apart["bias"][3], torch.tensor(10.0))
    for client, view in ((a, base), (b, {k: v.clone() for k, v in base.items()}), (c, apart)):
        client.view = view
    got_a, got_b = a.receive_model(None, dict(frames)), b.receive_model(None, dict(frames))
    assert len(decodes) == 1 and got_b is got_a
    alone = real(UpdateCodec(8), frames, base, "server")
    assert same_bits(got_a, alone)
    got_c = c.receive_model(None, dict(frames))
    assert len(decodes) == 2 and same_bits(got_c, real(UpdateCodec(8), frames, apart, "server"))
    assert not same_bits(got_c, got_a)


def test_kept_states_go_by_digest_and_the_run_ends_as_when_sent_whole(sbm, monkeypatch):
    parts = partition_graph(sbm, 3, "random", seed=0)
    held, t_held = _run(parts)
    assert t_held.not_held == 0, "every client held the state the server named"
    embeds = {how for kind, how in t_held.carried if kind == P.EMBED}
    evaluates = {how for kind, how in t_held.carried if kind == P.EVALUATE}
    assert embeds == {"held"}
    assert evaluates <= {"held", "delta"} and "held" in evaluates  # the test split: by digest

    # Every named state refused: each goes again, whole; the run must not change by a bit.
    monkeypatch.setattr(Client, "held_state", lambda self, digest: None)
    whole, t_whole = _run(parts)
    assert t_whole.not_held == sum(how == "held" for _, how in t_held.carried)
    assert whole["test_accuracy"] == held["test_accuracy"]
    assert _curve(whole) == _curve(held)
    assert [s["best_round"] for s in whole["stages"]] == [s["best_round"] for s in held["stages"]]


@pytest.mark.slow
def test_first_stage_auto_names_the_first_trainings_state_by_digest_after_the_second(sbm, monkeypatch):
    """Under ``first-stage auto`` clients hold the first training's last and kept views while the
    second trains, so whichever is kept goes to the stage's test and embed by digest. Before,
    a kept first variant went whole to every client (checked here: in one order the first
    training's variant is the one kept)."""
    parts = partition_graph(sbm, 3, "random", seed=0)
    kept_first = []
    for first in ("local", "mlp"):
        auto = {"first_stage": "auto", "first_stage_first": first, "first_stage_race": 0}
        held, t_held = _run(parts, **auto)
        kept_first.append(held["stages"][0]["first_stage"] == first)
        stage_0 = [how for kind, how in t_held.carried if kind in (P.EVALUATE, P.EMBED)]
        assert "whole" not in stage_0 and t_held.not_held == 0, first
        with monkeypatch.context() as m:  # every named state refused: the run must not change
            m.setattr(Client, "held_state", lambda self, digest: None)
            whole, t_whole = _run(parts, **auto)
        assert t_whole.not_held > 0
        assert whole["test_accuracy"] == held["test_accuracy"] and _curve(whole) == _curve(held), first
    assert any(kept_first), "neither order kept its first training: the case is not exercised"


def test_a_wrong_kept_state_is_never_used(sbm, monkeypatch):
    """The test can fail: were the KEEP copy taken from the wrong message (the new view instead of
    the one held before it), the digest would not match and every embed would go again, whole."""
    parts = partition_graph(sbm, 3, "random", seed=0)
    original = Client.receive_model

    def keeps_the_new_view(self: Client, state, frames, keep: bool = False, missed=None):
        view = original(self, state, frames, False, missed)
        if keep:
            self.kept = view
        return view

    monkeypatch.setattr(Client, "receive_model", keeps_the_new_view)
    summary, transport = _run(parts)
    assert transport.not_held > 0  # caught by the digest, and sent whole instead
    monkeypatch.undo()
    reference, _ = _run(parts)
    assert summary["test_accuracy"] == reference["test_accuracy"]


def test_whole_broadcasts_send_whole_states(sbm):
    """With 32-bit broadcasts clients do not persist views: nothing is named by digest."""
    parts = partition_graph(sbm, 3, "random", seed=0)
    _, transport = _run(parts, broadcast_bits=32, update_bits=32)
    assert {how for kind, how in transport.carried if kind in (P.EMBED, P.EVALUATE)} == {"whole"}
    assert transport.not_held == 0
