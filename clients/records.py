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

#: A Flower record of a message's content.
Record = ArrayRecord | ConfigRecord | MetricRecord


def to_flower(
    records: Records, built: dict[tuple[str, int], tuple[object, Record]] | None = None
) -> RecordDict:
    """``records`` as a Flower ``RecordDict``.

    Args:
        records (Records): the message's records.
        built (dict, optional): records already built for other messages of one batch, by name
            and the ``id`` of their values: values shared between messages (a round's broadcast frames,
            a stage's state sent whole) become one Flower record, serialized and hashed once,
            not once per recipient. Holds the values too, so that no id is reused while it
            lives. (default: :obj:`None`)
    """
    out: dict[str, Record] = {}
    for name, values in records.items():
        known = built.get((name, id(values))) if built is not None else None
        if known is not None and known[0] is values:
            out[name] = known[1]
            continue
        kind = P.record_kind(name)  # a lane's records (first-stage auto) are of their base name's kind
        if kind in P.ARRAY_RECORDS:
            record: Record = ArrayRecord(values)
        elif kind == P.METRICS:
            record = MetricRecord(values)
        else:
            record = ConfigRecord(values)
        if built is not None:
            built[(name, id(values))] = (values, record)
        out[name] = record
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
