"""Flower ClientApp: each message type is a thin adapter over the library's client handlers.

A handler restores this node's client (:mod:`clients.node`), turns the message's records into
plain ones (:mod:`clients.records`), lets :func:`retexo_fl.training.handlers.handle` answer,
saves the client's node-local state when the answer changed it, and replies.
"""

from __future__ import annotations

from flwr.app import Context, Message
from flwr.clientapp import ClientApp

from clients.mods import audit_messages, report_errors
from clients.node import node_client
from clients.records import from_flower, to_flower
from retexo_fl import protocol as P
from retexo_fl.training.handlers import handle

app = ClientApp(mods=[report_errors, audit_messages])


def _answer(msg: Message, context: Context) -> Message:
    client, work = node_client(msg, context)
    identity = str(context.node_config.get(P.NODE_IDENTITY_KEY, ""))
    reply = handle(client, msg.metadata.message_type, from_flower(msg.content), identity)
    if reply.changed:
        client.save(work)  # node-local: the private key and stage inputs stay in this folder
    return Message(to_flower(reply.records), reply_to=msg)


@app.query("hello")
def hello(msg: Message, context: Context) -> Message:
    """Key setup: this client's partition id and public key."""
    return _answer(msg, context)


@app.query("setup")
def setup(msg: Message, context: Context) -> Message:
    """Setup: connect to peers, report counts, plan digests and sealed degree frames."""
    return _answer(msg, context)


@app.train()
def train(msg: Message, context: Context) -> Message:
    """A round: validate the received state, train, reply with the update."""
    return _answer(msg, context)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    """Metrics of the received state on a split."""
    return _answer(msg, context)


@app.query("embed")
def embed(msg: Message, context: Context) -> Message:
    """End of a lazy stage: the sealed boundary rows for peers."""
    return _answer(msg, context)
