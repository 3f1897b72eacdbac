"""A client's node-local state: one save path, one load path, owner-only, bad files named."""

from __future__ import annotations

import stat

import pytest
import torch

from retexo_fl.config import TrainConfig
from retexo_fl.data.partitioners import partition_graph
from retexo_fl.party.eager_client import EagerClient
from retexo_fl.party.lazy_client import LazyClient
from retexo_fl.party.state import STATE_FILE, ClientState


def test_state_round_trips_and_is_owner_only(tmp_path):
    channel = {"identity": "ab" * 32, "counters": {"sent": {1: 3}, "accepted": {1: [2, "ff"]}}}
    state = ClientState(
        stage=3, owned=torch.arange(6.0).view(3, 2), channel=channel, sent=[1, {0: b"x"}, "{}"]
    )
    folder = tmp_path / "node-0"
    path = state.save(folder)
    assert path == folder / STATE_FILE
    assert stat.S_IMODE(path.stat().st_mode) == 0o600  # it holds a private key and embeddings
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700  # ... in a folder only its owner enters
    back = ClientState.load(folder)
    assert (
        back is not None and back.stage == 3 and back.channel == channel and back.sent == [1, {0: b"x"}, "{}"]
    )
    assert torch.equal(back.owned, state.owned)
    assert ClientState.load(tmp_path / "nothing") is None


def test_a_layer_0_snapshot_holds_no_raw_features(sbm, tmp_path):
    cfg = TrainConfig.resolve(profile="exact", clients=3, stages=3, hidden=8, encrypt=False)
    part = partition_graph(sbm, 3, "random", seed=0)[1]
    client = LazyClient(part, cfg)
    client.save(tmp_path)
    saved = ClientState.load(tmp_path)
    assert saved is not None and saved.owned is None  # the raw x stays in the partition alone
    fresh = LazyClient(part, cfg)
    assert fresh.restore(tmp_path) and torch.equal(fresh.owned, client.owned)


def test_a_corrupt_state_file_is_named(tmp_path):
    (tmp_path / STATE_FILE).write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match=rf"{STATE_FILE}: not a client state"):
        ClientState.load(tmp_path)


def test_a_lazy_client_comes_back_where_it_was(sbm, tmp_path):
    cfg = TrainConfig.resolve(profile="exact", clients=3, stages=3, hidden=8, encrypt=False)
    part = partition_graph(sbm, 3, "random", seed=0)[1]
    client = LazyClient(part, cfg)
    rows = client.advance(torch.randn(part.num_nodes, 8))
    client.receive_halo({q: torch.ones(int(ids.size), 8) for q, ids in client.plan.recv.items()})
    client.save(tmp_path)
    fresh = LazyClient(part, cfg)
    assert fresh.restore(tmp_path)
    assert (
        fresh.stage == 1 and torch.equal(fresh.owned, client.owned) and torch.equal(fresh.halo, client.halo)
    )
    assert sorted(rows) == sorted(client.plan.send)


def test_an_eager_client_keeps_its_halo_layers(sbm, tmp_path):
    cfg = TrainConfig.resolve(profile="exact", mode="eager", clients=3, stages=3, hidden=8, encrypt=False)
    part = partition_graph(sbm, 3, "random", seed=0)[0]
    client = EagerClient(part, cfg)
    client.halo_layers = [torch.full_like(h, float(i + 1)) for i, h in enumerate(client.halo_layers)]
    client.halo_round = 4
    client.save(tmp_path)
    fresh = EagerClient(part, cfg)
    assert fresh.restore(tmp_path) and fresh.halo_round == 4
    assert all(torch.equal(a, b) for a, b in zip(fresh.halo_layers, client.halo_layers, strict=True))


def test_the_key_directory_is_saved_once_beside_the_states_and_checked(tmp_path, monkeypatch):
    from retexo_fl.party import state as state_module

    directory = {str(q): f"{q:02x}" * 32 for q in range(50)}
    channel = {"identity": "ab" * 32, "directory": directory, "transcript": "cd" * 32}
    folder = tmp_path / "node-0"
    for stage in (1, 2):  # two saves, one directory file
        ClientState(stage=stage, channel=channel).save(folder)
    files = list(folder.glob("key-directory-*.json"))
    assert len(files) == 1 and stat.S_IMODE(files[0].stat().st_mode) == 0o600
    raw = torch.load(folder / STATE_FILE, weights_only=True)
    assert raw["channel"]["directory"] is None and raw["channel"]["directory-digest"]  # named, not held
    monkeypatch.setattr(state_module, "_loaded", {})  # a fresh process: read from the file
    back = ClientState.load(folder)
    assert back is not None and back.stage == 2 and back.channel["directory"] == directory
    # A directory file that is not the one named is refused, naming it.
    monkeypatch.setattr(state_module, "_loaded", {})
    files[0].write_text(files[0].read_text().replace("01" * 32, "02" * 32))
    with pytest.raises(ValueError, match=r"key-directory-.*\.json: not the key directory"):
        ClientState.load(folder)
    files[0].unlink()
    with pytest.raises(ValueError, match=r"key-directory-.*\.json: the key directory this client"):
        ClientState.load(folder)
