"""A round's cohort: many one-node clients in process train and encode in one computation,
with the result of each training alone (retexo_fl.party.cohort)."""

from __future__ import annotations

import pytest
import torch

from retexo_fl import protocol as P
from retexo_fl.config import TrainConfig
from retexo_fl.party.cohort import TrainCohort
from retexo_fl.party.lazy_client import LazyClient
from retexo_fl.runner import make_partitions
from retexo_fl.training.lazy import run_lazy


def _node_level(clients=160, method="node", **extra):
    cfg = TrainConfig.resolve(
        dataset="sbm:160,4,8,0.8",
        clients=clients,
        method=method,
        seed=3,
        split="random:0.5,0.2,0.3",
        stages=2,
        rounds=2,
        patience=0,
        min_rounds=0,
        self_training=0,
        **extra,
    )
    return make_partitions(cfg), cfg


def _run(parts, cfg, monkeypatch):
    """The run's summary, every stage's kept state, and how many members the cohorts served."""
    served = []
    trained = TrainCohort.trained

    def counting(self, client, state, round_):
        result = trained(self, client, state, round_)
        served.append(result is not None)
        return result

    monkeypatch.setattr(TrainCohort, "trained", counting)
    states = {}
    summary = run_lazy(parts, cfg, on_stage=lambda stage, state: states.__setitem__(stage, state))
    return summary, states, sum(served)


def test_a_cohort_trains_and_encodes_as_each_client_alone(monkeypatch):
    parts, cfg = _node_level(cohorts=False)  # 8-bit updates: equal frames need equal weights
    alone, states_alone, none = _run(parts, cfg, monkeypatch)
    parts, cfg = _node_level()
    together, states_together, served = _run(parts, cfg, monkeypatch)
    trainers = sum(int(p.train_mask.sum()) for p in parts)
    assert none == 0
    # Stage 0's two rounds and the GCN stage's second, every trainer (dropout on); the GCN stage's
    # first round brings the halo rows, so there a member trains alone until its own turn.
    assert 3 * trainers <= served < 4 * trainers
    # Bit for bit: each member's linear maps are its own calls, the rest elementwise.
    for stage, state in states_alone.items():
        for key, value in state.items():
            assert torch.equal(value, states_together[stage][key]), (stage, key)
    assert together.bytes_total == alone.bytes_total and together.bytes_model == alone.bytes_model
    assert together.clients == alone.clients  # each client's bytes per stage
    assert together.federation["messages"] == alone.federation["messages"]
    assert together.test_accuracy == pytest.approx(alone.test_accuracy, abs=1e-9)


def test_only_what_batches_exactly_joins_a_cohort():
    parts, cfg = _node_level()
    clients = {p.partition_id: LazyClient(p, cfg) for p in parts if int(p.train_mask.sum())}
    requests = {pid: {P.CONFIG: {}} for pid in clients}
    cohort = TrainCohort.gather(clients, requests)
    assert cohort is not None and set(cohort.members) == set(clients)
    # Validators only, a client optimizer with its own state, or too few members: each alone.
    assert TrainCohort.gather(clients, {pid: {P.CONFIG: {P.VALIDATE_ONLY: True}} for pid in clients}) is None
    assert TrainCohort.gather(dict(list(clients.items())[:3]), requests) is None
    adam_parts, adam = _node_level(optimizer="adam")
    adam_clients = {p.partition_id: LazyClient(p, adam) for p in adam_parts if p.partition_id in clients}
    assert TrainCohort.gather(adam_clients, requests) is None
    # A member whose own call brings another state trains alone.
    first = next(iter(clients.values()))
    state = first.make_model().state_dict()
    assert cohort.trained(first, state, 1) is not None
    other = {k: v + 1 for k, v in state.items()}
    assert cohort.trained(first, other, 1) is None
    assert cohort.trained(first, state, 2) is None


@pytest.mark.parametrize("clients, method", [(160, "node"), (24, "random")])
def test_members_with_wide_inputs_train_bit_for_bit_as_alone(clients, method):
    """Long dot products (Cora's 1,433 bag-of-words features) are where a batched product sums in
    another order than a member's own Linear: measured there before each member got its own
    calls, 45 of 64 members differed after one round. With 24 clients a member trains several rows
    (its loss the mean over them)."""
    # Stage 0 as the MLP: over partitions the default (auto) waits for a message to name it.
    parts, cfg = _node_level(clients, method, first_stage="mlp")
    gen = torch.Generator().manual_seed(0)
    clients = {p.partition_id: LazyClient(p, cfg) for p in parts if int(p.train_mask.sum())}
    for client in clients.values():  # sparse 0/1 rows, 1,433 wide
        client.owned = (torch.rand(client.owned.shape[0], 1433, generator=gen) < 0.013).float()
    state = next(iter(clients.values())).make_model().state_dict()
    alone = {pid: client.train(state, 1) for pid, client in clients.items()}
    cohort = TrainCohort.gather(clients, {pid: {P.CONFIG: {}} for pid in clients})
    assert cohort is not None
    for pid, client in clients.items():
        client.cohort = cohort
        new, loss = client.train(state, 1)
        assert loss == alone[pid][1]
        assert all(torch.equal(new[k], alone[pid][0][k]) for k in new), pid
    assert len(cohort.results) == len(clients)
    assert max(client.num_train for client in clients.values()) > (1 if method == "random" else 0)


def test_each_layer_takes_its_own_weight_decay_alone_and_in_a_cohort():
    """``weight-decay`` per layer, like ``lr``, and ``mlp-weight-decay`` for a layer-0 MLP: a
    round decays by its own value, alone (the client's optimizer) and in a cohort (its batched
    step), and the two stay bit for bit."""

    def round_one(**decay):
        parts, cfg = _node_level(24, "random", first_stage="mlp", **decay)
        clients = {p.partition_id: LazyClient(p, cfg) for p in parts if int(p.train_mask.sum())}
        first = next(iter(clients.values()))
        state = first.make_model().state_dict()
        alone = {pid: client.train(state, 1)[0] for pid, client in clients.items()}
        cohort = TrainCohort.gather(clients, {pid: {P.CONFIG: {}} for pid in clients})
        assert cohort is not None
        together = {}
        for pid, client in clients.items():
            client.cohort = cohort
            together[pid] = client.train(state, 1)[0]
        assert len(cohort.results) == len(clients)
        for pid, new in alone.items():
            assert all(torch.equal(new[k], together[pid][k]) for k in new), pid
        return first, alone

    def decay_of(client, stage):
        client.stage = stage
        return client.optimizer(client.make_model()).param_groups[0]["weight_decay"]

    # Per layer: the MLP's rounds take the first value, a GCN layer's the second.
    first, by_layer = round_one(weight_decay=[0.3, 0.0], mlp_weight_decay=0.0)
    assert decay_of(first, 0) == 0.3 and decay_of(first, 1) == 0.0
    # mlp-weight-decay takes the MLP's rounds alone: not a GCN layer's, nor a local stage 0's.
    first, by_mlp = round_one(weight_decay=0.0, mlp_weight_decay=0.3)
    assert decay_of(first, 0) == 0.3 and decay_of(first, 1) == 0.0
    assert all(torch.equal(new[k], by_layer[pid][k]) for pid, new in by_mlp.items() for k in new)
    first.first_stage = "local"
    assert decay_of(first, 0) == 0.0
    # The value applied is the MLP's: with the values swapped, every client's round differs.
    _, swapped = round_one(weight_decay=[0.0, 0.3], mlp_weight_decay=0.0)
    for pid, new in swapped.items():
        assert any(not torch.equal(new[k], by_layer[pid][k]) for k in new), pid


@pytest.mark.parametrize("width", [8, 256])
def test_members_of_many_rows_join_while_the_input_they_cover_is_small(monkeypatch, width):
    """A partition of a small graph trains more rows than a one-node client, yet a round of its
    steps is mostly fixed costs: it joins a cohort while its rows times the input width (an MLP
    stage's training rows, a GCN stage's owned and halo rows) stay under the bound, and trains bit
    for bit as alone, at stage 0's MLP and at a GCN stage. 256 wide, a GCN stage's bias must be
    added after its map, as alone: a Linear with the bias folded in rounds otherwise."""
    import retexo_fl.party.cohort as cohort_module

    cfg = TrainConfig.resolve(
        dataset="sbm:540,4,8,0.8",
        clients=9,  # one past the bound below leaves a cohort's least
        method="random",
        seed=3,
        split="random:0.5,0.2,0.3",
        first_stage="mlp",
        hidden=width,
    )
    parts = make_partitions(cfg)
    clients = {p.partition_id: LazyClient(p, cfg) for p in parts}
    assert min(c.num_train for c in clients.values()) > cohort_module.MAX_MEMBER_ROWS
    requests = {pid: {P.CONFIG: {}} for pid in clients}
    gen = torch.Generator().manual_seed(0)
    for stage in (0, 1):
        for client in clients.values():
            if stage:  # a GCN stage over random but fixed embeddings, own and halo rows
                client.stage = stage
                client.owned = torch.randn(client.graph.num_owned, width, generator=gen)
                client.halo = torch.randn(client.graph.num_halo, width, generator=gen)
                client.halo_degree = torch.randint(1, 9, (client.graph.num_halo,), generator=gen).float()
            client.cohort = None
        first = next(iter(clients.values()))
        state = first.make_model().state_dict()
        alone = {pid: client.train(state, 1) for pid, client in clients.items()}
        cohort = TrainCohort.gather(clients, requests)
        assert cohort is not None and set(cohort.members) == set(clients), stage
        for pid, client in clients.items():
            client.cohort = cohort
            new, loss = client.train(state, 1)
            assert loss == alone[pid][1]
            assert all(torch.equal(new[k], alone[pid][0][k]) for k in new), (stage, pid)
        assert len(cohort.results) == len(clients)
        # Past the bound a member trains alone: the largest input's, the rest still batch.
        covered = {
            pid: (c.graph.num_owned + c.graph.num_halo if stage else c.num_train) * c.owned.shape[1]
            for pid, c in clients.items()
        }
        widest = max(covered, key=covered.__getitem__)
        monkeypatch.setattr(cohort_module, "MAX_MEMBER_VALUES", covered[widest] - 1)
        smaller = TrainCohort.gather(clients, requests)
        assert smaller is not None and set(smaller.members) == set(clients) - {widest}, stage
        monkeypatch.undo()


def test_a_local_stage_0_member_counts_the_rows_it_reads(monkeypatch):
    """A local stage 0 passes messages over the client's own edges and reads its owned rows
    alone: the input its dropout covers is those rows times the feature width, not the halo's
    too. Under a bound between the two the clients still join, and train bit for bit as alone."""
    import retexo_fl.party.cohort as cohort_module

    cfg = TrainConfig.resolve(
        dataset="sbm:540,4,8,0.8",
        clients=9,
        method="random",
        seed=3,
        split="random:0.5,0.2,0.3",
        first_stage="local",
        hidden=64,  # no narrower than the features: the cohort batches a GCN layer as (A x) W
    )
    parts = make_partitions(cfg)
    clients = {p.partition_id: LazyClient(p, cfg) for p in parts}
    width = next(iter(clients.values())).owned.shape[1]
    owned = {pid: c.graph.num_owned * width for pid, c in clients.items()}
    with_halo = {pid: (c.graph.num_owned + c.graph.num_halo) * width for pid, c in clients.items()}
    assert {pid: cohort_module.covered_values(c) for pid, c in clients.items()} == owned
    assert max(owned.values()) < min(with_halo.values())  # a bound between the two exists
    monkeypatch.setattr(cohort_module, "MAX_MEMBER_ROWS", 0)
    monkeypatch.setattr(cohort_module, "MAX_MEMBER_VALUES", max(owned.values()))
    requests = {pid: {P.CONFIG: {}} for pid in clients}
    state = next(iter(clients.values())).make_model().state_dict()
    alone = {pid: client.train(state, 1) for pid, client in clients.items()}
    cohort = TrainCohort.gather(clients, requests)
    assert cohort is not None and set(cohort.members) == set(clients)
    for pid, client in clients.items():
        client.cohort = cohort
        new, loss = client.train(state, 1)
        assert loss == alone[pid][1]
        assert all(torch.equal(new[k], alone[pid][0][k]) for k in new), pid
    assert len(cohort.results) == len(clients)  # trained together, not each alone


def test_a_member_sampled_out_of_a_stages_first_rounds_encodes_without_the_last_stages_residual():
    """With half the trainers sampled a round, a member's first round of a stage can come after
    the stage's first: it still holds the residual of the last stage it encoded in, of another
    model's shapes (here a local stage 0 of the self-training pass, 8 features wide, after a
    16-wide GCN stage). It must encode as alone, where its round begins without it."""
    from retexo_fl.data.datasets import apply_split, synthetic_sbm
    from retexo_fl.data.partitioners import partition_graph

    data = synthetic_sbm(200, 3, avg_degree=8, homophily=0.8, num_features=8, feature_signal=0.5, seed=2)
    apply_split(data, "random:0.3,0.2,0.5", seed=2)
    parts = partition_graph(data, 16, "random", seed=0)
    common = dict(
        stages=2, hidden=16, seed=1, rounds=3, patience=0, min_rounds=0, self_training=1,
        warm_min_rounds=0, fraction_train=0.5,
    )  # fmt: skip
    alone, batched = (run_lazy(parts, TrainConfig.resolve(cohorts=c, **common)) for c in (False, True))
    assert batched.stages[0]["first_stage"] == "local"  # the stage whose weights are 8 wide
    assert batched.test_accuracy == alone.test_accuracy and batched.bytes_total == alone.bytes_total
    assert [s["val_accuracy"] for s in batched.stages] == [s["val_accuracy"] for s in alone.stages]
