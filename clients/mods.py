"""The ClientApp's mods: every failure becomes a one-line error reply; replies can be audited."""

from __future__ import annotations

from collections.abc import Callable

from flwr.app import Context, Error, Message, RecordDict
from flwr.common.constant import ErrorCode

from clients.node import cached_client, partition_dir, who
from clients.records import from_flower
from retexo_fl import protocol as P
from retexo_fl.secure.audit import AuditLog

Next = Callable[[Message, Context], Message]


def report_errors(msg: Message, context: Context, call_next: Next) -> Message:
    """Reply to any failure with a one-line reason that names this client, not a traceback."""
    try:
        return call_next(msg, context)
    except Exception as exc:  # every failure must reach the server as a reply
        reason = f"{who(context)}: {type(exc).__name__}: {exc}"
        return Message(Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=reason), reply_to=msg)


def _plain(content: RecordDict) -> dict[str, dict]:
    """A reply's records as the audit reads them: arrays as NumPy, frames as bytes."""
    records = from_flower(content)
    if P.ARRAYS in records:
        records[P.ARRAYS] = {k: v.numpy() for k, v in records[P.ARRAYS].items()}
    return records


def audit_messages(msg: Message, context: Context, call_next: Next) -> Message:
    """With ``audit`` (or node config ``audit-dir``) set, record every reply this client sends."""
    reply = call_next(msg, context)
    if reply.has_error():
        return reply
    # The handler has just built or restored this client: look it up, do not restore it again.
    client = cached_client(msg, context)
    cfg = client.cfg
    folder = context.node_config.get(P.NODE_AUDIT_DIR) or cfg.audit
    if folder:
        log = AuditLog(str(folder), client.id, str(partition_dir(context, cfg)), cfg.encrypt)
        log.record(msg.metadata.message_type, _plain(reply.content))
    return reply
