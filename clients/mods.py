"""The ClientApp's mods: every failure becomes a one-line error reply; replies can be audited."""

from __future__ import annotations

from collections.abc import Callable

from flwr.app import ArrayRecord, Context, Error, Message, RecordDict
from flwr.common.constant import ErrorCode

from clients.node import cached_client, partition_dir, who
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
    """A reply's records as plain values for the audit: arrays as NumPy, frames as bytes."""
    out: dict[str, dict] = {}
    for name, record in content.items():
        if isinstance(record, ArrayRecord):
            out[name] = {k: v.numpy() for k, v in record.to_torch_state_dict().items()}
        else:
            out[name] = dict(record)
    return out


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
