"""Our plain records (:data:`retexo_fl.protocol.Records`) as Flower records, and back.

The one place the wire vocabulary meets Flower's record types: a model state travels as an
``ArrayRecord``, metrics as a ``MetricRecord``, everything else (config, frames, figures) as a
``ConfigRecord``. The ServerApp's Grid transport uses the same two functions, so a message is
built and read the same way on both sides.
"""

from __future__ import annotations

from flwr.app import ArrayRecord, ConfigRecord, MetricRecord, RecordDict

from retexo_fl import protocol as P
from retexo_fl.protocol import Records


def to_flower(records: Records) -> RecordDict:
    """``records`` as a Flower ``RecordDict``."""
    out = {}
    for name, values in records.items():
        if name in P.ARRAY_RECORDS:
            out[name] = ArrayRecord(values)
        elif name == P.METRICS:
            out[name] = MetricRecord(values)
        else:
            out[name] = ConfigRecord(values)
    return RecordDict(out)


def from_flower(content: RecordDict) -> Records:
    """A Flower ``RecordDict`` as plain records: states as (writable) tensors, frames as bytes."""
    out: Records = {}
    for name, record in content.items():
        if isinstance(record, ArrayRecord):
            out[name] = {k: v.clone() for k, v in record.to_torch_state_dict().items()}
        else:
            out[name] = dict(record)
    return out
