"""Plain records to Flower's and back: a value shared by a batch's messages is one record."""

from __future__ import annotations

import torch
from flwr.app import ArrayRecord, ConfigRecord

from clients.records import from_flower, to_flower
from retexo_fl import protocol as P


def _requests(n: int) -> dict[int, dict]:
    state = {"w": torch.arange(6.0).reshape(2, 3), "b": torch.ones(2)}
    frames = {"w": b"\x01\x02\x03", "b": b"\x04"}
    return {
        node: {P.CONFIG: {P.ROUND: 3, P.RUN_KEY: node}, P.ARRAYS: state, P.MODEL: frames} for node in range(n)
    }


def test_values_shared_by_a_batch_become_one_record_and_read_back_the_same():
    requests = _requests(3)
    built: dict = {}
    batch = [to_flower(r, built) for r in requests.values()]
    alone = [to_flower(r) for r in requests.values()]
    assert all(isinstance(c[P.ARRAYS], ArrayRecord) and isinstance(c[P.MODEL], ConfigRecord) for c in batch)
    assert batch[0][P.ARRAYS] is batch[2][P.ARRAYS] and batch[0][P.MODEL] is batch[1][P.MODEL]
    assert batch[0][P.CONFIG] is not batch[1][P.CONFIG], "each message's own config stays its own"
    assert alone[0][P.ARRAYS] is not alone[1][P.ARRAYS]
    for shared, own in zip(batch, alone, strict=True):
        a, b = from_flower(shared), from_flower(own)
        assert a[P.CONFIG] == b[P.CONFIG] and a[P.MODEL] == b[P.MODEL]
        assert all(torch.equal(a[P.ARRAYS][k], b[P.ARRAYS][k]) for k in b[P.ARRAYS])
        # What a record costs on the wire does not depend on whether it is shared.
        assert all(shared[k].deflate() == own[k].deflate() for k in own)
