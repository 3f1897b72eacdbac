"""The message vocabulary shared by the ServerApp and the ClientApp (message types, record keys, payloads).

The library defines what travels; ``server/`` and ``clients/`` put it into Flower records.
"""

from __future__ import annotations

import hashlib
import json

from retexo_fl.compress.payload import HEADER_BYTES, PayloadError, decode_rows, encode_rows
from retexo_fl.config import TrainConfig

# Message types (Flower requires train / evaluate / query, optionally with .<name>).
HELLO = "query.hello"  # encryption on: report the partition id and this client's public key
SETUP = "query.setup"  # load and validate the partition; report counts, plan digests, degrees
TRAIN = "train"  # validate the incoming state, then train on it; may carry halo deliveries
EVALUATE = "evaluate"  # validation (or test) metrics of one state
EMBED = "query.embed"  # compute the stage's embeddings with the kept state; return boundary rows

# Record keys.
CONFIG = "config"  # ConfigRecord: run config (RUN or RUN_DIGEST), "run-key", stage, round, split
RUN = "run"  # in CONFIG: the run config JSON, on every message type but train
RUN_DIGEST = "run-digest"  # in CONFIG of train messages: config_digest() of the config sent before
ARRAYS = "arrays"  # ArrayRecord: the stage model's state
METRICS = "metrics"  # MetricRecord: counts, losses, accuracies
PAYLOADS = "payloads"  # ConfigRecord: "to-<q>" (outgoing) or "from-<p>" (deliveries) -> bytes

STATS = "stats"  # ConfigRecord: a client's exchange figures (bytes before / after, widths), JSON
MODEL = "model"  # ConfigRecord: tensor name -> broadcast delta frame (broadcast-bits < 32)
UPDATE = "update"  # ConfigRecord: tensor name -> compressed update frame (update-bits < 32)

# Boundary rows, degrees and compressed updates all travel as the frames of compress.payload.
__all__ = ["HEADER_BYTES", "PayloadError", "decode_rows", "encode_rows"]


def config_to_json(cfg: TrainConfig) -> str:
    return json.dumps(cfg.to_dict())


def config_digest(run_json: str) -> str:
    """What a train message carries instead of the run config: its SHA-256, 16 bytes in hex.

    The config is about a kilobyte of JSON; every client gets a train message every round, and
    with a small model (16 hidden units, 4-bit deltas) it was 64% of a conv stage's train
    payload. The client keeps the config the hello / setup messages brought and checks it
    against this.
    """
    return hashlib.sha256(run_json.encode()).hexdigest()[:32]


def config_from_json(text: str) -> TrainConfig:
    values = json.loads(text)
    values.pop("extra", None)
    return TrainConfig.from_mapping(values)


def peer_key(prefix: str, peer: int) -> str:
    return f"{prefix}-{peer}"


def parse_peer_key(key: str) -> int:
    return int(key.rsplit("-", 1)[1])
