"""A local step never waits for the device: no host read inside the step loop.

On a GPU every read of a device value on the host (``item``, ``tolist``, ``bool``/``int``/
``float`` of a tensor, ``nonzero``, indexing with a boolean mask, which counts the mask's rows
first) stalls the host until the queued work is done; one per step serializes the round. The
indices, labels and row-restricted graphs a step reads are built once per stage input, the loss
stays on the device and is read once per round. On CPU the same calls are counted: through the
Python methods that read values, and through a dispatch mode that sees every ATen operator a
step runs (its backward pass included), for what those methods do not cover.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections import Counter
from collections.abc import Iterator

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from retexo_fl.config import TrainConfig
from retexo_fl.data.partitioners import partition_graph
from retexo_fl.party.client import Client
from retexo_fl.party.eager_client import EagerClient
from retexo_fl.party.lazy_client import LazyClient
from retexo_fl.seeding import derive_seed

#: ATen operators whose result the host must wait for (their value or their output's size).
READS = {"_local_scalar_dense", "nonzero", "argwhere", "masked_select", "is_nonzero", "equal"}
READS |= {"unique", "_unique", "_unique2", "unique_consecutive", "unique_dim"}
#: Indexing operators: a boolean index is a ``nonzero`` (the output's size is the mask's count).
INDEXING = {"index", "index_put", "index_put_", "_index_put_impl_"}
#: Python methods that read values on the host.
METHODS = ("item", "tolist", "nonzero", "numpy", "cpu", "__bool__", "__int__", "__float__", "__index__")


class SyncCounter(TorchDispatchMode):
    """Counts host reads of device values while :attr:`active`, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.active = False
        self.calls: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.active:
            name = func.overloadpacket.__name__
            if name in READS:
                self.calls[f"aten.{name}"] += 1
            elif name in INDEXING and any(
                isinstance(t, torch.Tensor) and t.dtype in (torch.bool, torch.uint8) for t in args[1]
            ):
                self.calls[f"aten.{name} (boolean index)"] += 1
            elif name == "repeat_interleave" and kwargs.get("output_size") is None:
                self.calls["aten.repeat_interleave (no output_size)"] += 1
        return func(*args, **kwargs)

    @contextlib.contextmanager
    def counting(self) -> Iterator[None]:
        was, self.active = self.active, True
        try:
            yield
        finally:
            self.active = was

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        was, self.active = self.active, False
        try:
            yield
        finally:
            self.active = was


@pytest.fixture
def counter(monkeypatch) -> Iterator[SyncCounter]:
    """A :class:`SyncCounter` over every ATen call and the value-reading Python methods."""
    sync = SyncCounter()

    def patched(name, original):
        def method(*args, **kwargs):
            if sync.active:
                sync.calls[f"Tensor.{name}"] += 1
            return original(*args, **kwargs)

        return method

    for name in METHODS:
        monkeypatch.setattr(torch.Tensor, name, patched(name, getattr(torch.Tensor, name)))
    monkeypatch.setattr(torch, "nonzero", patched("torch.nonzero", torch.nonzero))
    with sync:
        yield sync


def count_steps(monkeypatch, sync: SyncCounter, client: Client) -> list[Counter[str]]:
    """Run ``client.train`` counting host reads within each local step (forward and backward,
    :meth:`Client.step_gradients`); one counter per step."""
    per_step: list[Counter[str]] = []
    original = type(client).step_gradients

    def step(self, *args, **kwargs):
        sync.calls = Counter()
        with sync.counting():
            out = original(self, *args, **kwargs)
        per_step.append(sync.calls)
        return out

    monkeypatch.setattr(type(client), "step_gradients", step)
    client.train(client.make_model().state_dict(), 1)
    monkeypatch.setattr(type(client), "step_gradients", original)
    return per_step


def _parts(sbm):
    return partition_graph(sbm, 3, "random", seed=0)


def _lazy(sbm, model="gcn", stage=1, **kw) -> LazyClient:
    """Client 0 of 3 random partitions; at ``stage`` 1 its owned and halo rows are random but
    fixed, its edges and GCN degrees its own (as tests/training/test_precompute.py builds it)."""
    cfg = TrainConfig.resolve(
        profile="exact", clients=3, stages=2, hidden=8, model=model, local_epochs=3, **kw
    )
    client = LazyClient(_parts(sbm)[0], cfg)
    gen = torch.Generator().manual_seed(0)
    client.halo_degree = torch.randint(1, 9, (client.graph.num_halo,), generator=gen).float()
    if stage:
        client.stage = stage
        client.owned = torch.randn(client.graph.num_owned, 8, generator=gen)
        client.halo = torch.randn(client.graph.num_halo, 8, generator=gen)
    return client


def _eager(sbm, local=False, **kw) -> EagerClient:
    """Client 0 of 3 random partitions, eager over 2 conv layers, with random halo rows and
    (halo gradients) random gradients from its peers, so that every term takes part."""
    cfg = TrainConfig.resolve(
        profile="exact", mode="eager", clients=3, stages=3, hidden=8, local_epochs=3, **kw
    )
    client = EagerClient(_parts(sbm)[0], cfg, local=local)
    gen = torch.Generator().manual_seed(0)
    client.halo_degree = torch.randint(1, 9, (client.graph.num_halo,), generator=gen).float()
    client.halo_layers = [torch.randn(client.graph.num_halo, 8, generator=gen) for _ in range(2)]
    if client.exchanges_gradients:
        sent = client.plan.send.items()
        client.grads_in = {q: [torch.randn(len(idx), 8, generator=gen) for _ in range(2)] for q, idx in sent}
    return client


CLIENTS = {
    "lazy stage 0 (mlp)": lambda sbm: _lazy(sbm, stage=0),
    "lazy local stage 0 (gcn)": lambda sbm: _lazy(sbm, stage=0, first_stage="local"),
    "lazy gcn": lambda sbm: _lazy(sbm, "gcn"),
    "lazy sage": lambda sbm: _lazy(sbm, "sage"),
    "lazy sage-max": lambda sbm: _lazy(sbm, "sage-max"),
    "lazy gcn chunk-rows": lambda sbm: _lazy(sbm, "gcn", chunk_rows=17),
    "lazy sage chunk-rows": lambda sbm: _lazy(sbm, "sage", chunk_rows=17),
    "lazy gcn precompute": lambda sbm: _lazy(sbm, "gcn", precompute=True),
    "eager": lambda sbm: _eager(sbm),
    "eager halo-gradients": lambda sbm: _eager(sbm, halo_gradients=True),
    "local, time-based rounds": lambda sbm: _eager(sbm, local=True, round_seconds=0.05),
}


@pytest.mark.parametrize("name", list(CLIENTS))
def test_a_local_step_reads_nothing_off_the_device(sbm, monkeypatch, counter, name):
    client = CLIENTS[name](sbm)
    if "chunk" in name:  # several chunks, or this proves less
        assert client.num_train > 2 * client.cfg.chunk_rows
    per_step = count_steps(monkeypatch, counter, client)
    assert len(per_step) == client.last_steps >= (1 if "time" in name else 3)
    assert all(not calls for calls in per_step), f"{name}: host reads per step {per_step}"


@pytest.mark.parametrize("name", ["lazy stage 0 (mlp)", "lazy gcn", "lazy gcn chunk-rows", "eager"])
def test_a_round_reads_the_same_however_many_steps(sbm, monkeypatch, counter, name):
    """The whole of ``train`` (the optimizer's own step aside: its step counters live on the
    host) reads as often for 1 step as for 4: the loss is read once, after the last step."""
    reads = []
    for steps in (1, 4):
        client = CLIENTS[name](sbm)
        client.cfg = dataclasses.replace(client.cfg, local_epochs=steps)
        state = client.make_model().state_dict()
        client.train(state, 1)  # what is built once per stage input: built here

        def optimizer(model, make=client.optimizer):
            opt = make(model)
            step = opt.step

            def paused_step(*args, **kwargs):
                with counter.paused():
                    return step(*args, **kwargs)

            opt.step = paused_step
            return opt

        monkeypatch.setattr(client, "optimizer", optimizer)
        counter.calls = Counter()
        with counter.counting():
            client.train(state, 1)
        assert client.last_steps == steps
        reads.append(sum(counter.calls.values()))
    assert reads[0] == reads[1], f"{name}: host reads in a round of 1 and of 4 steps: {reads}"


# -- the results are those of boolean-mask steps, bit for bit --------------------------------


def _reference(client: Client, state, round_: int) -> tuple[dict, float]:
    """``client.train`` as it was written: training rows by boolean mask, the graph restricted to
    them in every step, each step's loss read as it is computed."""
    model = client.make_model()
    model.load_state_dict(state)
    opt = client.optimizer(model)
    # torch's global generator, seeded alike: the round's own dropout stream draws the same masks.
    torch.random.default_generator.manual_seed(derive_seed(client.cfg.seed, *client.seed_tags(round_)))
    model.train()
    mask = client.masks["train"]
    losses = []
    for step in range(client.step_budget()[0]):
        opt.zero_grad()
        losses.append(_reference_step(client, model, mask, step))
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, losses[0]


def _reference_step(client: Client, model, mask, step: int) -> float:
    ce = torch.nn.functional.cross_entropy
    labels = client.train_y[mask]
    if isinstance(client, EagerClient):
        ei, w = client.message_graph()
        halo = client.halo_layers
        if step == 0 and client.exchanges_gradients:
            halo = [h.detach().clone().requires_grad_(True) for h in halo]
        logits, inputs = model(client.owned, ei, w, halo)
        loss = ce(logits[mask], labels)
        peer = loss.new_zeros(())
        for q, blocks in client.grads_in.items():
            for layer, grad in enumerate(blocks):
                peer = peer + (inputs[layer][client._send_index[q]] * grad).sum()
        (loss + peer / max(int(mask.sum()), 1)).backward()
        return loss.item()
    if client.row_wise:
        loss = ce(model(client.owned[mask])[1], labels)
        loss.backward()
        return loss.item()
    if client.precomputes(model):
        _, logits = model.forward_aggregated(client.aggregated_input(), client.owned)
        loss = ce(logits[mask], labels)
        loss.backward()
        return loss.item()
    ei, w = client.edges()
    x, n, index = client.stage_input(), client.graph.num_owned, mask.nonzero().squeeze(1)
    chunk = client.cfg.chunk_rows
    if not 0 < chunk < index.numel():
        loss = ce(model(x, ei, w, num_targets=n, rows=index)[1], labels)
        loss.backward()
        return loss.item()
    start, total = torch.random.get_rng_state(), 0.0
    for lo in range(0, index.numel(), chunk):
        torch.random.set_rng_state(start)
        _, logits = model(x, ei, w, num_targets=n, rows=index[lo : lo + chunk])
        part = ce(logits, labels[lo : lo + chunk], reduction="sum") / index.numel()
        part.backward()
        total += part.item()
    return total


@pytest.mark.parametrize("name", [n for n in CLIENTS if "time" not in n])
def test_steps_train_what_boolean_mask_steps_trained(sbm, name):
    client = CLIENTS[name](sbm)
    state = client.make_model().state_dict()
    for round_ in (1, 2):  # the second round reuses what the first built
        want, want_loss = _reference(client, state, round_)
        got, loss = client.train(state, round_)
        assert loss == want_loss
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want), name
        state = got
    if isinstance(client, LazyClient):
        # New training rows and labels (what self-training's relabel does): built again.
        gen = torch.Generator().manual_seed(1)
        n, classes = client.graph.num_owned, client.part.num_classes
        client.masks["train"] = client.masks["train"] | (torch.rand(n, generator=gen) < 0.3)
        client.train_y = torch.randint(0, classes, (n,), generator=gen)
        want, want_loss = _reference(client, state, 3)
        got, loss = client.train(state, 3)
        assert client.num_train == int(client.masks["train"].sum())
        assert loss == want_loss and all(torch.equal(got[k], want[k]) for k in want), name


@pytest.mark.parametrize("model", ["gcn", "sage", "gat"])
def test_evaluation_restricts_the_graph_to_its_rows_once_per_stage_input(sbm, monkeypatch, model):
    # A round's validation reads the same rows of the same graph: restricted once, it gives
    # what restricting in the forward pass gives, and other rows are restricted anew.
    from retexo_fl.models import stage as stage_module
    from retexo_fl.party import lazy_client as lazy_module

    client = _lazy(sbm, model=model)
    state = client.make_model().state_dict()
    rows = client.split_rows("val")
    calls = Counter()
    for module in (lazy_module, stage_module):
        original = module.select_in_edges

        def counted(*args, _original=original, **kwargs):
            calls["restrict"] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(module, "select_in_edges", counted)
    first = client.evaluate(state, "val")
    assert calls["restrict"] == 1
    second = client.evaluate(state, "val")
    assert calls["restrict"] == 1 and second == first
    with torch.no_grad():
        model_ = client.loaded_model(state).eval()
        ei, w = client.edges()
        x, n = client.stage_input(), client.graph.num_owned
        _, cached = client.outputs(model_, rows)
        _, again = model_(x, ei, w, num_targets=n, rows=rows)  # restricted in the forward pass
    assert torch.equal(cached, again)
    assert calls["restrict"] == 2  # the forward pass's own
    client.halo = client.halo * 2.0  # a new stage input over the same graph and rows
    moved = client.evaluate(state, "val")
    assert calls["restrict"] == 2 and moved != first  # the graph kept, the values read anew
    client.evaluate(state, "test")  # other rows: restricted anew
    assert calls["restrict"] == 3
