"""The ClientApp as a shim: forward a message to this node's worker and return its reply.

With node config ``worker`` (set by ``retexo-fl supernode``) the per-message ClientApp process
imports no torch and loads no partition: it hands the message's records to the long-lived node
worker (:mod:`clients.worker`) over the node-local channel (:mod:`clients.worker_link`) and
builds the reply from what comes back. The mods (error reporting, audit) run here, around it.
"""

from __future__ import annotations

from flwr.app import Context, Message, RecordDict

from clients.worker_link import WorkerError, call
from retexo_fl import protocol as P

#: message id -> the audit target the worker reported with its reply (read once by the mod).
_AUDIT: dict[str, dict | None] = {}
#: Seconds a message waits for a worker that is (re)starting before the node is reported lost.
WORKER_WAIT = 60.0


def forward(msg: Message, context: Context) -> RecordDict:
    """The worker's reply content to ``msg``.

    Raises:
        WorkerError: one line: the worker is unreachable, refused, died, or raised.
    """
    header = {
        "type": msg.metadata.message_type,
        "run_id": msg.metadata.run_id,
        "message_id": msg.metadata.message_id,
        "node_id": context.node_id,
    }  # no node config: the worker answers under the one `retexo-fl supernode` was started with
    try:
        reply, content = call(str(context.node_config[P.NODE_WORKER]), header, msg.content, wait=WORKER_WAIT)
    except WorkerError as exc:
        _AUDIT[msg.metadata.message_id] = exc.audit  # the error reply is audited like any other
        raise
    if content is None:
        raise WorkerError(f"the node worker sent no content for a {msg.metadata.message_type} message")
    _AUDIT[msg.metadata.message_id] = reply.get("audit")
    return content


def audit_target(msg: Message) -> dict | None:
    """What the worker said about auditing its reply to ``msg`` (None: no audit)."""
    return _AUDIT.pop(msg.metadata.message_id, None)
