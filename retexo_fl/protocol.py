"""The message vocabulary shared by the ServerApp and the ClientApp (message types, record keys, payloads).

The library defines what travels; ``server/`` and ``clients/`` put it into Flower records.
"""

from __future__ import annotations

import json
import struct

import numpy as np
import torch

from retexo_fl.config import TrainConfig

# Message types (Flower requires train / evaluate / query, optionally with .<name>).
SETUP = "query.setup"  # load and validate the partition; report counts, plan digests, degrees
TRAIN = "train"  # validate the incoming state, then train on it; may carry halo deliveries
EVALUATE = "evaluate"  # validation (or test) metrics of one state
EMBED = "query.embed"  # compute the stage's embeddings with the kept state; return boundary rows

# Record keys.
CONFIG = "config"  # ConfigRecord: run config JSON, stage, round, split
ARRAYS = "arrays"  # ArrayRecord: the stage model's state
METRICS = "metrics"  # MetricRecord: counts, losses, accuracies
PAYLOADS = "payloads"  # ConfigRecord: "to-<q>" (outgoing) or "from-<p>" (deliveries) -> bytes

_ROWS = struct.Struct("<4sBII")  # magic, dtype code, rows, cols
ROW_HEADER_BYTES = _ROWS.size
_MAGIC = b"RXR1"


class PayloadError(ValueError):
    """A boundary payload does not match its header or what the receiver expects."""


def rows_to_bytes(rows: torch.Tensor) -> bytes:
    """Serialize a ``[k, d]`` float32 row block with a small header (shape checked on receipt)."""
    arr = np.ascontiguousarray(rows.detach().cpu().numpy(), dtype="<f4")
    if arr.ndim != 2:
        raise PayloadError(f"rows must be 2-D, got shape {arr.shape}")
    return _ROWS.pack(_MAGIC, 32, arr.shape[0], arr.shape[1]) + arr.tobytes()


def rows_from_bytes(data: bytes, source: int, expect_rows: int | None = None) -> torch.Tensor:
    """Parse :func:`rows_to_bytes` output from client ``source``, checking header and size."""
    if len(data) < _ROWS.size:
        raise PayloadError(f"payload from client {source}: {len(data)} bytes is shorter than a header")
    magic, bits, k, d = _ROWS.unpack_from(data)
    if magic != _MAGIC or bits != 32:
        raise PayloadError(f"payload from client {source}: bad header (magic {magic!r}, bits {bits})")
    if len(data) != _ROWS.size + 4 * k * d:
        raise PayloadError(
            f"payload from client {source}: header says {k}x{d} float32 "
            f"but the body has {len(data) - _ROWS.size} bytes"
        )
    if expect_rows is not None and k != expect_rows:
        raise PayloadError(f"payload from client {source}: {k} rows, boundary plan expects {expect_rows}")
    arr = np.frombuffer(data, dtype="<f4", offset=_ROWS.size).reshape(k, d)
    return torch.from_numpy(arr.copy())


def config_to_json(cfg: TrainConfig) -> str:
    return json.dumps(cfg.to_dict())


def config_from_json(text: str) -> TrainConfig:
    values = json.loads(text)
    values.pop("extra", None)
    return TrainConfig.from_mapping(values)


def peer_key(prefix: str, peer: int) -> str:
    return f"{prefix}-{peer}"


def parse_peer_key(key: str) -> int:
    return int(key.rsplit("-", 1)[1])
