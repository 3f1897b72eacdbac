"""The ClientApp's mods: every failure becomes a one-line error reply; replies can be audited."""

from __future__ import annotations

from collections.abc import Callable

from flwr.app import ArrayRecord, Context, Error, Message, RecordDict
from flwr.common.constant import ErrorCode

from clients import shim
from clients.node import who
from clients.worker_link import WorkerError
from retexo_fl import protocol as P
from retexo_fl.secure.audit import AuditLog

Next = Callable[[Message, Context], Message]


def report_errors(msg: Message, context: Context, call_next: Next) -> Message:
    """Reply to any failure with a one-line reason that names this client, not a traceback."""
    try:
        return call_next(msg, context)
    except WorkerError as exc:  # already one line: what the worker raised, or why it is unreachable
        reason = f"{who(context)}: {exc}"
    except Exception as exc:  # every failure must reach the server as a reply
        reason = f"{who(context)}: {type(exc).__name__}: {exc}"
    return Message(Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=reason), reply_to=msg)


def _plain(content: RecordDict) -> dict[str, dict]:
    """A reply's records as the audit reads them: arrays as NumPy, frames as bytes (no torch)."""
    return {
        name: {k: a.numpy() for k, a in record.items()} if isinstance(record, ArrayRecord) else dict(record)
        for name, record in content.items()
    }


def audit_messages(msg: Message, context: Context, call_next: Next) -> Message:
    """With ``audit`` (or node config ``audit-dir``) set, record every reply this client sends,
    error replies included (their reason is text that leaves the node). It runs outside
    :func:`report_errors`, so it sees the error reply that mod made.

    With a node worker the worker says where and as whom (its reply header); without one, the
    client this process just answered with does. A failure before the client was built has no
    client to record it as, and nothing of the client's data loaded: it is not recorded.
    """
    reply = call_next(msg, context)
    if P.NODE_WORKER in context.node_config:
        target = shim.audit_target(msg)
    else:
        from clients.node_client import audit_target  # torch: only a process that answers itself

        target = audit_target(msg, context)
    if target:
        log = AuditLog(target["folder"], target["client"], target["partition"], target["encrypted"])
        if reply.has_error():
            log.record(msg.metadata.message_type, {"error": {"reason": reply.error.reason}})
        else:
            log.record(msg.metadata.message_type, _plain(reply.content))
    return reply
