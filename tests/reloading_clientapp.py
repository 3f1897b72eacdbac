"""The real ClientApp, plus a mod that makes each process forget which saved state its cached
client of node 2 holds, so that every message to node 2 loads the node's state from its folder
(as a Ray actor that did not answer the node's last message does). ``test_flower_simulation.py``
corrupts that state mid-run and expects the load to fail, naming the client.

It lives in its own module so that Flower's simulation workers can import it by name.
"""

from __future__ import annotations

from flwr.app import Context, Message

from clients import app as real
from clients import node_client
from clients.mods import Next
from clients.node import cache_key

#: The node whose state is loaded before every message.
NODE = "2"


def reload_node(msg: Message, context: Context, call_next: Next) -> Message:
    """Forget the version node :data:`NODE`'s cached client holds, then answer."""
    key = cache_key(msg, context)
    if key[1] == NODE:
        with node_client._LOCK:
            node_client._CURRENT.pop(key, None)
    return call_next(msg, context)


app = real.app_with(reload_node)
