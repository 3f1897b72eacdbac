"""A ClientApp built to leak: the real one, plus a mod that adds its own raw data to every reply
in one field per encoding the residency audit must catch (``tests/secure/test_audit_encodings.py``).

It lives in its own module so that Flower's simulation workers can import it by name.
"""

from __future__ import annotations

import json

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord

from clients import app as real
from clients.mods import Next
from clients.node_client import cached_client
from retexo_fl.secure.envelope import MAGIC

#: Field -> the encoding it leaks in; every one must become a finding of the audit.
ARRAY_LEAKS = (
    "row-scaled",
    "row-shifted",
    "rows-negated",
    "x-transposed",
    "x-flattened",
    "x-extra-column",
    "x-float16",
    "x-float64",
    "labels-onehot",
    "labels-int32",
    "labels-float",
    "edges-float64",
    "edges-beyond-16",
    "edges-flattened",
    "edges-local-indices",
    "local-graph-edge-index",
)
CONFIG_LEAKS = (
    "row-float16-in-frame",
    "rows-behind-forged-prefix",
    "labels-uint8-bytes",
    "labels-json",
    "edges-bitmap",
    "labels-digit-string",
)
METRIC_LEAKS = ("labels-metric-list",)
SEALED_LEAK = "rows-sealed-to-a-peer"


def leak(msg: Message, context: Context, call_next: Next) -> Message:
    """Answer as the real client does, then add its raw data to the reply of each stage's first
    round, once per encoding (every reply would only make the audit slower)."""
    reply = call_next(msg, context)
    if reply.has_error() or msg.metadata.message_type != "train" or msg.content["config"]["round"] != 1:
        return reply
    client = cached_client(msg, context)
    part = client.part
    x = torch.from_numpy(np.array(part.x, dtype=np.float32))
    y = torch.from_numpy(np.array(part.y, dtype=np.int64))
    edges = torch.from_numpy(np.array(part.edges, dtype=np.int64))
    classes = int(part.num_classes)
    ids = np.asarray(part.node_ids)
    reply.content["leak-arrays"] = ArrayRecord(
        {
            "row-scaled": x[3:4] * 2,
            "row-shifted": x[4:5] + 1e-6,
            "rows-negated": -3 * x[5:7] + 7,
            "x-transposed": x.T.contiguous(),
            "x-flattened": x.reshape(-1),
            "x-extra-column": torch.cat([x, torch.ones(len(x), 1)], 1),
            "x-float16": x.half(),
            "x-float64": x.double(),
            "labels-onehot": torch.eye(classes)[y],
            "labels-int32": y.int(),
            "labels-float": y.float(),
            "edges-float64": edges.double(),
            "edges-beyond-16": edges[:, 16:80].contiguous(),
            "edges-flattened": edges.reshape(-1),
            "edges-local-indices": torch.from_numpy(np.searchsorted(ids, edges.numpy())),
            "local-graph-edge-index": client.graph.edge_index.clone(),
        }
    )
    ids = np.asarray(part.node_ids)
    local = np.searchsorted(ids, np.asarray(part.edges))
    adjacency = np.zeros((len(ids), len(ids)), dtype=bool)
    adjacency[local[0], local[1]] = True
    reply.content["leak"] = ConfigRecord(
        {
            "row-float16-in-frame": b"RXQ1" + np.asarray(part.x[8], dtype=np.float16).tobytes(),
            "rows-behind-forged-prefix": MAGIC + np.asarray(part.x[9:12], dtype=np.float32).tobytes(),
            "labels-uint8-bytes": y.numpy().astype(np.uint8).tobytes(),
            "labels-json": json.dumps({"y": y.tolist()}),
            "edges-bitmap": np.packbits(adjacency.reshape(-1)).tobytes(),
            "labels-digit-string": "".join(str(v) for v in y.tolist()),
        }
    )
    reply.content["leak-metrics"] = MetricRecord({"labels-metric-list": [float(v) for v in y.tolist()]})
    envelopes = client.channel.envelopes
    if envelopes is not None and envelopes.peers:  # sealed, so only the plaintext record shows it
        q = min(envelopes.peers)
        sealed = client.channel.seal({q: np.asarray(part.x[:4], dtype=np.float32).tobytes()}, "halo", 99)
        reply.content["leak"][SEALED_LEAK] = sealed[q]
    return reply


app = real.app_with(leak)
