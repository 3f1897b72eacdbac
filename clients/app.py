"""Flower ClientApp: each message type is a thin adapter over the library's client handlers.

With a node worker (node config ``worker``, set by ``retexo-fl supernode``) a handler forwards
the message to it (:mod:`clients.shim`) and this process never imports torch. Without one, the
process answers itself (:func:`clients.node_client.answer`): it restores this node's client,
lets :func:`retexo_fl.party.handlers.handle` answer, saves the client's node-local state when
the answer changed it, and replies. Either way the mods (error reporting, audit) run here.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from flwr.app import Context, Message
from flwr.clientapp import ClientApp

from clients import shim
from clients.mods import Next, audit_messages, report_errors
from retexo_fl import protocol as P


def app_named(ref: str) -> ClientApp:
    """The ClientApp a ``module:attribute`` reference names (``clients.app:app``)."""
    module, _, name = ref.partition(":")
    found = getattr(importlib.import_module(module), name, None)
    if not isinstance(found, ClientApp):
        raise ValueError(f"{ref!r} names no ClientApp")
    return found


class NamedClientApp(ClientApp):
    """A ClientApp that travels as the ``module:attribute`` reference that holds it.

    Flower's simulation engine pickles the ClientApp (in a closure) into every message's Ray
    task. Pickled whole, it cost the server 0.4 ms a message, a seventh of its time at one node
    per client (113,000 messages); as a reference, 0.05 ms, and the actor imports the module it
    names, as ``flwr run`` does.

    Args:
        ref (str): where the app is, ``module:attribute``.
        mods (list, optional): the app's mods, outermost first. (default: :obj:`None`)
    """

    def __init__(self, ref: str, mods: list[Any] | None = None) -> None:
        super().__init__(mods=mods)
        self.ref = ref

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (app_named, (self.ref,))


# The audit is outermost: it records the error replies report_errors makes, too.
app = NamedClientApp("clients.app:app", mods=[audit_messages, report_errors])


def _answer(msg: Message, context: Context) -> Message:
    if P.NODE_WORKER in context.node_config:
        return Message(shim.forward(msg, context), reply_to=msg)
    # Imported here: torch, PyG's partition loader and the client cost a worker-less process
    # seconds a message; a shim never pays them.
    from clients.node_client import answer

    return Message(answer(msg, context), reply_to=msg)


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


@app.query("unmask")
def unmask(msg: Message, context: Context) -> Message:
    """Secure aggregation: shares and pair seeds that unmask the round's sum."""
    return _answer(msg, context)


def app_with(*mods: Callable[[Message, Context, Next], Message]) -> ClientApp:
    """A ClientApp with these handlers and ``mods`` inside the audit and error reporting: the
    variants tests run in simulation (one built to leak, one that reloads a node's state)."""
    variant = ClientApp(mods=[audit_messages, report_errors, *mods])
    for name, handler in (("hello", hello), ("setup", setup), ("embed", embed), ("unmask", unmask)):
        variant.query(name)(handler)
    variant.train()(train)
    variant.evaluate()(evaluate)
    return variant
