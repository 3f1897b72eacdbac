"""The aggregation seam: the round loop drives each round's aggregation through its hooks, in
order, sends every message itself (an aggregation asks for extra phases as Exchanges), and
aggregates only the rounds a stage keeps."""

from __future__ import annotations

import dataclasses

from retexo_fl import protocol as P
from retexo_fl.config import TrainConfig
from retexo_fl.coordinator import round_aggregation as ra
from retexo_fl.coordinator import round_loop
from retexo_fl.data.partitioners import partition_graph
from retexo_fl.training.lazy import run_lazy

BASE = TrainConfig.resolve(
    profile="exact", model="gcn", stages=2, hidden=16, rounds=8, seed=0, self_training=0
)


def _recording(monkeypatch) -> list[tuple]:
    """Replace the loop's choice of aggregation by one that records each hook call."""
    calls: list[tuple] = []
    choose = ra.round_aggregation

    def recorded(fed, rs, stage, round_, label):
        inner = choose(fed, rs, stage, round_, label)
        kind = type(inner).__name__

        class Recording(type(inner)):
            def configure(self):
                calls.append((kind, stage, round_, "configure"))
                return super().configure()

            def decorate(self, requests):
                calls.append((kind, stage, round_, "decorate"))
                return super().decorate(requests)

            def collect(self, replies, down):
                calls.append((kind, stage, round_, "collect"))
                asked = super().collect(replies, down)
                if asked is not None:
                    calls.append((kind, stage, round_, f"exchange {asked.kind} to {sorted(asked.requests)}"))
                return asked

            def resume(self, answers):
                calls.append((kind, stage, round_, f"resume with {sorted(answers)}"))
                return super().resume(answers)

            def aggregate(self):
                calls.append((kind, stage, round_, "aggregate"))
                return super().aggregate()

        inner.__class__ = Recording
        return inner

    monkeypatch.setattr(round_loop, "round_aggregation", recorded)
    return calls


def test_hooks_run_in_order_and_a_stopping_round_is_never_aggregated(sbm, monkeypatch):
    calls = _recording(monkeypatch)
    cfg = dataclasses.replace(BASE, rounds=40, patience=2, min_rounds=0)
    summary = run_lazy(partition_graph(sbm, 3, "metis", seed=0), cfg)
    by_round: dict[tuple[int, int], list[str]] = {}
    for kind, stage, round_, hook in calls:
        assert kind == "FedAvgRound"
        by_round.setdefault((stage, round_), []).append(hook)
    for stage_figures in summary.stages:
        stage, sent = stage_figures["stage"], stage_figures["rounds_sent"]
        for r in range(1, sent + 1):
            applied = ["configure", "decorate", "collect", "aggregate"]
            # The round whose replies stopped the stage was sent and read, never aggregated (so
            # DP noise is drawn, and accounted, for applied rounds alone).
            stopped = r == sent and stage_figures["rounds_run"] < sent
            assert by_round[(stage, r)] == (applied[:-1] if stopped else applied), (stage, r)
    assert any(s["rounds_run"] < s["rounds_sent"] for s in summary.stages)  # a stage did stop


def test_secure_unmasking_is_a_phase_the_loop_sends(sbm, monkeypatch):
    calls = _recording(monkeypatch)
    cfg = dataclasses.replace(BASE, rounds=3, secure_aggregation=True)
    summary = run_lazy(partition_graph(sbm, 3, "metis", seed=0), cfg)
    rounds_done = [(stage, r) for kind, stage, r, hook in calls if hook == "collect"]
    assert rounds_done and all(kind == "SecureRound" for kind, *_ in calls)
    for stage, r in rounds_done:
        hooks = [hook for kind, s, rr, hook in calls if (s, rr) == (stage, r)]
        assert hooks == [
            "configure",
            "decorate",
            "collect",
            f"exchange {P.UNMASK} to [0, 1, 2]",
            "resume with [0, 1, 2]",
            "aggregate",
        ]
    # One unmask message per survivor and round, all sent by the loop.
    assert summary["secure_aggregation"]["unmask_messages"] == 3 * len(rounds_done)
