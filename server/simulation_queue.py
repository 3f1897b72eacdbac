"""One scan a poll for Flower's simulation message pump (``flwr>=1.38,<1.40``): a documented patch.

Flower 1.38-1.39's simulation engine moves the ServerApp's messages to its workers in
``add_messages_to_queue`` (``flwr/server/superlink/fleet/vce/vce_api.py``): every 0.1 s it asks
the LinkState, node by node, for that node's first undelivered message
(``state.get_message_ins(node_id=node_id, limit=1)``). The in-memory LinkState answers each
call by walking every message it stores (``in_memory_linkstate.py``, ``get_message_ins``),
delivered ones included until their replies are pulled, and checking each one's expiry and
federation (``_check_stored_messages``). A poll therefore costs nodes x stored messages checks:
at one node per client (Cora, 2,708 virtual nodes, about 1,000 messages a round) a round took
about 25 s in simulation against about 1 s in process.

:func:`indexed_message_queue` swaps that function, for the length of a ``with`` block, for
:func:`add_messages_by_one_scan`, which walks the stored messages once a poll and hands each
node what the per-node calls would have: its first undelivered message in the store's order,
checked the same way, marked delivered with the same timestamp, at most one a node a poll,
queued in the nodes' order. (Delivered messages awaiting their replies are passed over without
the expiry check upstream gives them on every call: an expired one is dropped when the server
pulls its reply instead of at the next poll.) A state that is not the in-memory one is polled
as upstream does.

:func:`check_upstream` refuses to patch unless the installed function and the LinkState method
whose answers it reproduces are the source this module was written for (their SHA-256): a
Flower release that changes either runs unpatched, and ``tests/server/test_simulation_queue.py``
fails loudly.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import logging
import threading
from collections.abc import Callable, Iterator
from queue import Queue
from typing import Any

log = logging.getLogger(__name__)

#: SHA-256 of the upstream sources this patch replaces or reproduces (Flower 1.38.0 and 1.39.0).
EXPECTED_SOURCES = {
    "add_messages_to_queue": "953f4bd41a931a77",
    "InMemoryLinkState.get_message_ins": "6547c8dcbc62e12f",
}
#: The pump's wait between polls, as upstream's (seconds).
POLL_SECONDS = 0.1


class SimulationPatchError(RuntimeError):
    """The installed Flower's simulation pump is not the code this patch was written for."""


def _modules() -> tuple[Any, Any]:
    from flwr.server.superlink.fleet.vce import vce_api
    from flwr.server.superlink.linkstate import in_memory_linkstate

    return vce_api, in_memory_linkstate


def source_digest(function: Any) -> str:
    """The first 16 hex digits of the SHA-256 of ``function``'s source."""
    return hashlib.sha256(inspect.getsource(function).encode()).hexdigest()[:16]


def check_upstream() -> None:
    """Raise :class:`SimulationPatchError` unless the installed sources are the expected ones."""
    vce_api, ims = _modules()
    pump = vce_api.add_messages_to_queue
    found = {
        "add_messages_to_queue": source_digest(_upstream if pump is add_messages_by_one_scan else pump),
        "InMemoryLinkState.get_message_ins": source_digest(ims.InMemoryLinkState.get_message_ins),
    }
    changed = [name for name, digest in EXPECTED_SOURCES.items() if found[name] != digest]
    if changed:
        raise SimulationPatchError(
            f"Flower's {', '.join(changed)} changed (source digest {[found[n] for n in changed]}, "
            f"expected {[EXPECTED_SOURCES[n] for n in changed]}): re-read it and update "
            "server/simulation_queue.py"
        )


def first_undelivered(state: Any, nodes: dict[int, int]) -> list[Any]:
    """Each node's first undelivered message, in the nodes' order, marked delivered: what
    ``state.get_message_ins(node_id=n, limit=1)`` for each ``n`` of ``nodes`` in turn returns,
    in one walk of the store.

    Args:
        state (InMemoryLinkState): the simulation's LinkState.
        nodes (dict[int, int]): the virtual nodes (node id -> partition), in polling order.
    """
    from flwr.common import now

    found: dict[int, Any] = {}
    with state.lock:
        for msg_id in list(state.message_ins_store.keys()):
            msg = state.message_ins_store.get(msg_id)
            if msg is None or msg.metadata.dst_node_id in found or msg.metadata.dst_node_id not in nodes:
                continue
            if msg.metadata.delivered_at != "":
                # Delivered, its reply not pulled yet: upstream checks it here too, which only
                # drops it sooner if it expired (the server's pull checks it again); a round's
                # thousand of them were most of a poll.
                continue
            state._check_stored_messages({msg_id})  # expired or out of the federation: dropped
            msg = state.message_ins_store.get(msg_id)
            if msg is not None and msg.metadata.delivered_at == "":
                found[msg.metadata.dst_node_id] = msg
    delivered_at = now().isoformat()
    ordered = [found[node] for node in nodes if node in found]
    for msg in ordered:
        msg.metadata.delivered_at = delivered_at
    return ordered


def add_messages_by_one_scan(
    state: Any, queue: Queue, nodes_mapping: dict[int, int], f_stop: threading.Event
) -> None:
    """Upstream ``add_messages_to_queue`` with one walk of the store a poll (see the module)."""
    _, ims = _modules()
    if not isinstance(state, ims.InMemoryLinkState):
        assert _upstream is not None  # patched in: the upstream pump was kept
        _upstream(state, queue, nodes_mapping, f_stop)
        return
    while not f_stop.is_set():
        for msg in first_undelivered(state, nodes_mapping):
            queue.put(msg)
        f_stop.wait(POLL_SECONDS)


#: Upstream's pump while :func:`indexed_message_queue` has swapped it out.
_upstream: Callable[..., None] | None = None


@contextlib.contextmanager
def indexed_message_queue() -> Iterator[bool]:
    """Within the block, Flower's simulation pump walks its messages once a poll; yields whether
    it does (``False``: the installed Flower is not the code the patch was written for, and the
    run goes on unpatched, saying so)."""
    global _upstream
    vce_api, _ = _modules()
    try:
        check_upstream()
    except SimulationPatchError as exc:
        log.warning("%s; the simulation polls its messages as Flower does", exc)
        yield False
        return
    if vce_api.add_messages_to_queue is add_messages_by_one_scan:  # a block within a block
        yield True
        return
    _upstream = vce_api.add_messages_to_queue
    vce_api.add_messages_to_queue = add_messages_by_one_scan
    try:
        yield True
    finally:
        vce_api.add_messages_to_queue, _upstream = _upstream, None
