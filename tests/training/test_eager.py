"""Eager and local baselines in process: they train, count every byte, and time-based rounds end on time."""

from __future__ import annotations

import pytest

from retexo_fl.compress.payload import HEADER_BYTES
from retexo_fl.config import TrainConfig
from retexo_fl.data.partitioners import partition_graph
from retexo_fl.party.eager_client import EagerClient, step_delays
from retexo_fl.plan import BoundaryPlan
from retexo_fl.secure.envelope import ENVELOPE_BYTES
from retexo_fl.training.eager import run_eager


def _cfg(**kw) -> TrainConfig:
    return TrainConfig.resolve(**{"model": "gcn", "hidden": 16, "stages": 3, "rounds": 80, "seed": 0, **kw})


def test_eager_trains_and_counts_every_round(sbm):
    parts = partition_graph(sbm, 3, "random", seed=0)
    cfg = _cfg(mode="eager", model="sage", halo_gradients=False)  # with them: test_halo_gradients
    out = run_eager(parts, cfg)
    assert out["mode"] == "eager" and out["test_accuracy"] >= 0.85
    # Each round every client sends each peer one sealed frame: (layers - 1) blocks of its rows.
    per_round = frames = 0
    for p in parts:
        for idx in BoundaryPlan.from_partition(p).send.values():
            per_round += HEADER_BYTES + (cfg.stages - 1) * idx.size * cfg.hidden * 4
            frames += 1
    # Every round, and one refresh per conv layer before the test (rows of the best state).
    exchanges = out["stages"][0]["rounds_run"] + cfg.stages - 1
    assert out["bytes_boundary"] == exchanges * (per_round + frames * ENVELOPE_BYTES)
    assert out["bytes_boundary_raw"] == exchanges * per_round


def test_local_mode_sends_no_boundary_and_loses_the_cross_edges(sbm):
    parts = partition_graph(sbm, 4, "metis", seed=0)
    local = run_eager(parts, _cfg(mode="local"), local=True)
    assert local["bytes_boundary"] == 0 and local["bytes_model"] > 0
    assert local["test_accuracy"] >= 0.5


def test_compressed_eager_exchange(sbm):
    parts = partition_graph(sbm, 3, "random", seed=0)
    out = run_eager(parts, _cfg(mode="eager", rounds=10, rate_schedule="linear:2,8"))
    widths = {int(b) for b in out["bit_histogram"]}
    assert widths == {2, 4, 8}  # the schedule eases off over rounds
    assert out["bytes_boundary"] < out["bytes_boundary_raw"] / 4


@pytest.mark.slow  # wall-clock: a time-based round is measured in seconds
def test_time_based_rounds_end_on_time_and_slow_clients_do_fewer_steps(sbm):
    parts = partition_graph(sbm, 3, "random", seed=0)
    cfg = _cfg(mode="local", round_seconds=0.6, step_delay="1:0.2")
    clients = [EagerClient(p, cfg, local=True) for p in parts]
    state = {k: v.detach().clone() for k, v in clients[0].make_model().state_dict().items()}
    steps = []
    for c in clients:
        # Counted in a second round: the first's deadline runs from before the client's first
        # graph and model are built, which took most of a short budget in a fresh process.
        c.train(state, 1)
        c.train(state, 2)
        steps.append(c.last_steps)
    # The slow client fits at most 0.6 s / 0.2 s + 1 steps in its budget, however idle the
    # machine; the others, with no delay, more. Not a multiple: beside the suite's other process
    # a 600-node step took 50 ms (the fast clients fit 6 and 42 steps of 0.3 s), so how many more
    # is the machine's, not the code's. (How long a round takes is a benchmark's to measure.)
    assert steps[1] <= 4 and min(steps[0], steps[2]) > steps[1]
    assert step_delays("1:0.1, 3:2") == {1: 0.1, 3: 2.0}
    with pytest.raises(ValueError, match="step-delay"):
        step_delays("1=0.1")


@pytest.mark.parametrize("eager_model", ["standard", "layered"])
def test_settled_halos_give_the_whole_graph_forward(sbm, eager_model: str):
    """With the state held fixed, two exchanges settle both layers' halos: every client's logits
    then equal the whole-graph model's, so eager's only approximation is staleness."""
    import torch

    from retexo_fl import protocol as P
    from retexo_fl.coordinator.federation import FederationView
    from retexo_fl.metrics import RunRecorder
    from retexo_fl.party.handlers import handle
    from retexo_fl.training.centralized import whole_graph_partition
    from retexo_fl.training.inprocess import InProcessTransport

    cfg = _cfg(mode="eager", hidden=8, clients=3, eager_model=eager_model)
    clients = [EagerClient(p, cfg) for p in partition_graph(sbm, 3, "random", seed=0)]
    fed = FederationView(InProcessTransport(clients), cfg, RunRecorder(None, stream=None))
    degrees = fed.setup()  # key setup and the sealed GCN degrees, as a run does them
    state = {k: v.detach().clone() for k, v in clients[0].make_model().state_dict().items()}
    for c in clients:  # the degrees ride with the first message a client gets
        handle(c, P.EVALUATE, fed.content(state, degrees[c.id], **{P.SPLIT: "val"}))

    def logits(client):
        model = client.make_model()
        model.load_state_dict(state)
        model.eval()
        with torch.no_grad():
            return client.forward(model)

    whole = logits(EagerClient(whole_graph_partition(sbm), cfg))

    def gap() -> float:
        return max(float((logits(c) - whole[torch.from_numpy(c.part.node_ids)]).abs().max()) for c in clients)

    before = gap()  # zero halos
    for r in range(1, cfg.stages):
        incoming: dict[int, dict[int, bytes]] = {c.id: {} for c in clients}
        for c in clients:
            for q, frame in c.encode_rows_for_round(c.boundary_rows(state), r)[0].items():
                incoming[q][c.id] = frame
        for c in clients:
            c.receive_deliveries(incoming[c.id])
    assert before > 1e-2 and gap() < 1e-5
