"""The simulation pump's patch: the pinned Flower is the code it was written for, and one walk of
the store a poll hands out exactly what Flower's node-by-node calls would."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
from flwr.server.superlink.fleet.vce import vce_api
from flwr.server.superlink.linkstate.in_memory_linkstate import InMemoryLinkState

from server import simulation_queue as Q


def test_the_pinned_flower_is_the_code_the_patch_was_written_for():
    # If this fails, Flower's simulation pump or its in-memory LinkState changed: re-read
    # flwr/server/superlink/fleet/vce/vce_api.py (add_messages_to_queue) and
    # in_memory_linkstate.py (get_message_ins), and update server/simulation_queue.py.
    Q.check_upstream()


class FakeState:
    """What upstream ``InMemoryLinkState.get_message_ins`` reads of ``self``: a lock, the store,
    and the check that drops expired messages (here: those named ``expired``)."""

    def __init__(self, messages: list[tuple[str, int, str]]) -> None:
        self.lock = threading.RLock()
        self.message_ins_store = {
            mid: SimpleNamespace(
                id=mid, metadata=SimpleNamespace(dst_node_id=node, run_id=1, delivered_at=delivered)
            )
            for mid, node, delivered in messages
        }
        self.checked: list[str] = []

    def _check_stored_messages(self, message_ids: set[str], run_id: int | None = None) -> None:
        for mid in message_ids:
            self.checked.append(mid)
            if mid.startswith("expired"):
                self.message_ins_store.pop(mid, None)


MESSAGES = [
    ("a1", 1, ""),
    ("b1", 2, "2026-11-28T00:00:00"),  # delivered already (its reply not pulled yet)
    ("expired-c", 3, ""),
    ("b2", 2, ""),
    ("a2", 1, ""),  # node 1's second message: the next poll's
    ("other", 9, ""),  # a node the engine does not run
    ("c2", 3, ""),
]


def _delivered(state: FakeState) -> set[str]:
    return {mid for mid, m in state.message_ins_store.items() if m.metadata.delivered_at}


def test_one_walk_hands_out_what_the_per_node_calls_would():
    nodes = {3: 0, 1: 1, 2: 2}  # the pump's polling order
    ours, theirs = FakeState(MESSAGES), FakeState(MESSAGES)
    for _ in range(3):  # three polls: the second hands out node 1's second message
        got = Q.first_undelivered(ours, nodes)
        want = [m for n in nodes for m in InMemoryLinkState.get_message_ins(theirs, node_id=n, limit=1)]
        assert [m.id for m in got] == [m.id for m in want]
        assert _delivered(ours) == _delivered(theirs)
        assert set(ours.message_ins_store) == set(theirs.message_ins_store)  # the expired one dropped
    assert [m.id for m in Q.first_undelivered(FakeState(MESSAGES), nodes)] == ["c2", "a1", "b2"]
    assert "expired-c" not in ours.message_ins_store and "other" in ours.message_ins_store
    assert ours.message_ins_store["other"].metadata.delivered_at == ""


def test_the_pump_is_swapped_for_the_block_only_and_not_on_other_code(monkeypatch, caplog):
    upstream = vce_api.add_messages_to_queue
    with Q.indexed_message_queue() as patched:
        assert patched and vce_api.add_messages_to_queue is Q.add_messages_by_one_scan
        Q.check_upstream()  # still checks upstream's source while swapped
    assert vce_api.add_messages_to_queue is upstream
    monkeypatch.setitem(Q.EXPECTED_SOURCES, "add_messages_to_queue", "0" * 16)
    with pytest.raises(Q.SimulationPatchError, match="add_messages_to_queue changed"):
        Q.check_upstream()
    with Q.indexed_message_queue() as patched:
        assert not patched and vce_api.add_messages_to_queue is upstream
    assert "polls its messages as Flower does" in caplog.text
