"""A client's node-local state: one save path, one load path, owner-only, bad files named."""

from __future__ import annotations

import math
import stat

import pytest
import torch

from retexo_fl.config import TrainConfig
from retexo_fl.data.partitioners import partition_graph
from retexo_fl.party.eager_client import EagerClient
from retexo_fl.party.lazy_client import LazyClient
from retexo_fl.party.state import (
    SPARE_FILE,
    STATE_FILE,
    STATE_MAGIC,
    ClientState,
    decode_state,
    encode_state,
    read_state_file,
)


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


def test_saves_write_over_a_spare_file_that_no_other_name_links(tmp_path):
    """A save writes over the state file no name needs any more (the one it replaced, or an old
    journal) instead of a new file: each load reads the last save, longer or shorter than the
    file written over, the folder holds at most the state, one spare and the journal the state
    names, owner-only; a spare another name also links is never written over."""
    folder = tmp_path / "node-0"

    def state(n: int, journal: list | None = None) -> ClientState:
        return ClientState(stage=n, owned=torch.full((n % 3 * 50 + 1, 4), float(n)), journal=journal)

    state(0).save(folder)
    inodes = set()
    for n in range(1, 9):
        # Every other save keeps the file it replaces as a round journal (a hard link), as a
        # train round's does; the journal before it is then no state's, and becomes the spare.
        link = f"journal-{n}.state" if n % 2 else None
        journal = [[0, 0, n], link or f"journal-{n - 1}.state", {}]
        path = state(n, journal).save(folder, journal_link=link)
        inodes.add(path.stat().st_ino)
        back = ClientState.load(folder)
        assert back is not None and back.stage == n and torch.equal(back.owned, state(n).owned)
        names = {f.name for f in folder.iterdir() if not f.name.startswith("key-directory")}
        assert names == {STATE_FILE, SPARE_FILE, journal[1]} - ({SPARE_FILE} if n == 1 else set()), n
        assert all(stat.S_IMODE(f.stat().st_mode) == 0o600 for f in folder.iterdir())
    assert len(inodes) <= 3, "the saves took turns over the same few files"
    # A spare another name links (kept by someone else) is not written over.
    other = tmp_path / "elsewhere"
    other.hardlink_to(folder / SPARE_FILE)
    before = other.read_bytes()
    state(20).save(folder)
    assert other.read_bytes() == before
    assert ClientState.load(folder).stage == 20


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
    raw = read_state_file(folder / STATE_FILE)
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


def test_a_process_hashes_a_key_directory_once_whichever_way_it_met_it(tmp_path, monkeypatch):
    """A Ray actor serving thousands of one-node clients meets one key directory at setup (a
    read-only view), in each state it saves (hex) and in each it loads: one view, one hex dict,
    one digest for all of them (each save hashed it again: a tenth of a node-level actor's time)."""
    from retexo_fl.party import state as state_module
    from retexo_fl.secure import channel as channel_module

    for module, memo in (
        (state_module, "_loaded"),
        (state_module, "_saved_digests"),
        (channel_module, "_hex_of"),
        (channel_module, "_view_of"),
    ):
        monkeypatch.setattr(module, memo, {})
    digests = []
    real = state_module._directory_text  # what the digest is of: made once, hashed once
    monkeypatch.setattr(state_module, "_directory_text", lambda d: digests.append(1) or real(d))

    view, _ = channel_module.frozen_directory({q: bytes([q]) * 32 for q in range(50)}, {})
    hexed = channel_module._directory_hex(view)
    assert channel_module._directory_hex(view) is hexed
    assert channel_module._directory_parsed(hexed) is view, "a state's directory is the view set up"
    for node in range(3):
        channel = {
            "identity": "ab" * 32,
            "directory": channel_module._directory_hex(view),
            "transcript": "cd" * 32,
        }
        ClientState(stage=1, channel=channel).save(tmp_path / f"node-{node}")
    back = [ClientState.load(tmp_path / f"node-{node}") for node in range(3)]
    assert all(b is not None and b.channel["directory"] is hexed for b in back)
    assert channel_module._directory_parsed(back[2].channel["directory"]) is view
    assert len(digests) == 1
    # A directory met first in a saved state (another process saved it) is parsed once too.
    other = {str(q): f"{q:02x}" * 32 for q in range(40)}
    ClientState(stage=1, channel={"directory": other, "transcript": "cd" * 32}).save(tmp_path / "node-9")
    monkeypatch.setattr(state_module, "_loaded", {})
    first, second = ClientState.load(tmp_path / "node-9"), ClientState.load(tmp_path / "node-9")
    assert first is not None and second is not None
    parsed = channel_module._directory_parsed(first.channel["directory"])
    assert channel_module._directory_parsed(second.channel["directory"]) is parsed
    assert channel_module._directory_hex(parsed) is first.channel["directory"]


def test_the_state_file_format_round_trips_every_kind_of_value_exactly():
    """Tensors of every dtype and shape (bit for bit), bytes, tuples, int-keyed maps, floats that
    JSON has no literal for: what a client keeps comes back as it was, type for type."""
    values = {
        "stage": 3,
        "owned": torch.randn(5, 3, dtype=torch.float64),
        "halo": torch.empty(0, 4),
        "halo_degree": torch.tensor([3, 0, 7]),
        "residual": {"w": torch.randn(2, 2).t(), "mask": torch.tensor([True, False]), "s": torch.tensor(2.5)},
        "view": {"b": torch.randn(3, dtype=torch.bfloat16), "h": torch.randn(2, dtype=torch.float16)},
        "sent": [1, {4: b"\x00\xff" * 3, 9: b""}, '{"rows": 2}'],
        "journal": [(1, 0, 4), {"kept": {"w": torch.arange(6, dtype=torch.int32).reshape(2, 3)}}, None],
        "secagg": {"loss": float("nan"), "inf": float("-inf"), "ok": True, "members": [0, 2]},
    }
    back = decode_state(encode_state(values))
    assert set(back) == set(values) and back["stage"] == 3 and back["halo"].shape == (0, 4)
    for a, b in ((values["owned"], back["owned"]), (values["residual"]["w"], back["residual"]["w"])):
        assert a.dtype == b.dtype and torch.equal(a, b)
    for group in ("residual", "view"):
        for k, v in values[group].items():
            assert back[group][k].dtype == v.dtype and back[group][k].shape == v.shape
            assert torch.equal(back[group][k], v)
    assert back["sent"] == [1, {4: b"\x00\xff" * 3, 9: b""}, '{"rows": 2}']
    assert back["journal"][0] == (1, 0, 4) and isinstance(back["journal"][0], tuple)
    assert torch.equal(back["journal"][1]["kept"]["w"], values["journal"][1]["kept"]["w"])
    assert math.isnan(back["secagg"]["loss"]) and back["secagg"]["inf"] == float("-inf")
    assert back["secagg"]["members"] == [0, 2] and back["secagg"]["ok"] is True
    back["owned"].add_(1)  # tensors read back are writable and their own
    assert not torch.equal(back["owned"], values["owned"])
    with pytest.raises(TypeError, match="cannot hold a set"):
        encode_state({"x": {1, 2}})


def test_a_state_file_of_the_earlier_format_still_loads_and_a_cut_one_is_named(tmp_path):
    folder = tmp_path / "node-0"
    folder.mkdir(mode=0o700)
    old = {"stage": 2, "view": {"w": torch.ones(2, 2)}, "boundary_releases": 1}
    torch.save(old, folder / STATE_FILE)  # written by torch.save, as until 2026-11-28
    back = ClientState.load(folder)
    assert back is not None and back.stage == 2 and torch.equal(back.view["w"], torch.ones(2, 2))
    path = ClientState(stage=4, view={"w": torch.randn(64, 64)}).save(folder)
    assert path.read_bytes().startswith(STATE_MAGIC)
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(ValueError, match=rf"{STATE_FILE}: not a client state \(ValueError: cut short\)"):
        ClientState.load(folder)


def test_a_tensor_held_twice_is_written_once_and_read_back_as_one():
    view = {"w": torch.randn(64, 64)}
    values = {"view": view, "kept": dict(view), "journal": [[0, 0, 2], {"view": dict(view)}, None]}
    once, twice = encode_state(values), encode_state({**values, "kept": {"w": view["w"].clone()}})
    assert len(twice) - len(once) >= 64 * 64 * 4
    back = decode_state(once)
    assert back["kept"]["w"] is back["view"]["w"] is back["journal"][1]["view"]["w"]
    assert torch.equal(back["view"]["w"], view["w"])
