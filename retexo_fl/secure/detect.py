"""Finding a client's raw data in anything it sent, re-encoded or not.

:class:`SecretFinder` holds one client's feature rows, label vectors and edges, and searches a
value of any type a message can carry (arrays of any dtype and shape, bytes, strings, lists of
numbers) for them:

- **feature rows**, under any affine change of the values (``a * x + b``, ``a != 0``: scaled,
  shifted, negated), re-typed (float16, float64, integers for integer-valued features), as a
  row, a column (transposed), inside a flattened array at any offset, beside extra columns, or
  inside bytes at any offset in any of those dtypes. Every row of the partition is searched:
  each candidate window is z-normalized, sketched by six fixed random projections, and looked
  up by its quantized sketch (neighbouring bins probed), then confirmed by a correlation of at
  least :data:`MATCH_CORRELATION` over the whole row and at most two values wherever the row has
  one (a copy maps equal values to equal ones, stochastic rounding to one of two codes). Rows
  with fewer than two non-zero entries (a one-hot row, an empty row) are not searched: they occur
  by chance.
- **label vectors** (all owned nodes, and each split's), as integers of any width, floats,
  one-hot rows or columns, numbers in text, digits in text (``"0120..."``) or a list: a
  contiguous copy of the whole vector.
- **edges**: any pairs of integer-valued numbers (any dtype, as rows, columns, interleaved or
  as two halves of a flat array) of which at least half, and at least four, are this client's
  edges, local or cross, in global ids or in local indices (the owned nodes' row numbers),
  every edge searched; and an adjacency bitmap over the owned nodes.

What it does not find: a secret transformed in any other way (rotated, encrypted, compressed,
mixed with noise, split across messages or fields), or a row with fewer than two non-zeros.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import numpy as np

from retexo_fl.data.partition import Partition, sorted_unique

#: Correlation (after z-normalization) a window needs with a feature row to count as a copy:
#: float16 re-typing keeps it above 0.9999; independent rows of 16+ entries almost never reach it.
MATCH_CORRELATION = 0.999
_SKETCH = 6  # projections in the lookup key
_BIN = 0.25  # width of a sketch bin (a sketch coordinate is about N(0, 1))
_TOL = 0.03  # a coordinate this close to a bin edge also probes the neighbouring bin
_CHUNK = 1 << 14
_DTYPES = ("<f4", "<f2", "<f8", "<i1", "<u1", "<i2", "<i4", "<i8")
_NUMBER = re.compile(rb"-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?")
_DIGITS = re.compile(rb"\d{8,}")  # a run of digits: one digit per value (labels of < 10 classes)


def _zscore(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Rows z-normalized, and which had spread (a constant row has no shape to match)."""
    mean = rows.mean(1, keepdims=True)
    std = rows.std(1, keepdims=True)
    ok = std[:, 0] > 1e-12
    return (rows - mean) / np.where(std > 1e-12, std, 1.0), ok


def _pair_keys(pairs: np.ndarray) -> np.ndarray:
    """One int64 per (u, v) pair of non-negative ids below 2^31."""
    return pairs[:, 0].astype(np.int64) * (1 << 31) + pairs[:, 1].astype(np.int64)


class SecretFinder:
    """One client's raw data, in forms a search over any message value can use.

    Args:
        part (Partition): the client's partition.
    """

    def __init__(self, part: Partition) -> None:
        x = np.asarray(part.x, dtype=np.float64)
        self.num_features = f = x.shape[1]
        informative = x[(x != 0).sum(1) >= 2]
        z, ok = _zscore(informative) if len(informative) else (informative, np.zeros(0, bool))
        self.rows = z[ok]
        rng = np.random.default_rng(0x5EC)
        self.proj = rng.standard_normal((f, _SKETCH)) / np.sqrt(f)
        self.table: dict[int, list[int]] = {}
        # Each row is filed under its bin and every neighbouring bin a coordinate is near, so a
        # candidate only looks up its own bin: a copy within the tolerance lands on one of them.
        for i, keys in enumerate(self._keys(self.rows @ self.proj, exact=False)):
            for key in set(keys.tolist()):
                self.table.setdefault(int(key), []).append(i)
        self.keys = np.array(sorted(self.table), dtype=np.int64)
        y = np.asarray(part.y, dtype=np.int64)
        labels = [y] + [y[np.asarray(m)] for m in (part.train_mask, part.val_mask, part.test_mask)]
        # A constant vector (one class only) is no secret a copy could be told from.
        self.labels = [v.tobytes() for v in labels if v.size >= 8 and np.unique(v).size >= 2]
        c = np.asarray(part.cross_edges, dtype=np.int64).reshape(-1, 4)
        pairs = np.concatenate([np.asarray(part.edges, dtype=np.int64).T, c[:, :2]])
        # The same edges in local indices (row numbers of the owned nodes, as a client's own
        # LocalGraph numbers them): a local edge list is the same secret.
        ids = np.asarray(part.node_ids, dtype=np.int64)
        local = np.searchsorted(ids, np.asarray(part.edges, dtype=np.int64)).T
        pairs = np.concatenate([pairs, local])
        both = np.concatenate([pairs, pairs[:, ::-1]])
        self.edge_keys = sorted_unique(_pair_keys(both), in_place=True)
        # The bitmap check looks set bits up in the edge keys: no n x n matrix is ever built.
        self.node_ids = np.asarray(part.node_ids, dtype=np.int64)
        self.n_owned = len(self.node_ids)
        self.has_local_edges = np.asarray(part.edges).size > 0

    # -- feature rows ---------------------------------------------------------------------
    @staticmethod
    def _keys(sketch: np.ndarray, exact: bool = False) -> np.ndarray:
        """Lookup keys of sketches ``[n, 6]``: one (exact) or every neighbouring-bin variant."""
        base = np.floor(sketch / _BIN)
        if exact:
            variants = base[:, None, :]
        else:
            lo, hi = np.floor((sketch - _TOL) / _BIN), np.floor((sketch + _TOL) / _BIN)
            alt = np.where(lo != base, lo, hi)
            combos = (np.arange(1 << _SKETCH)[:, None] >> np.arange(_SKETCH)) & 1  # [64, 6]
            variants = np.where(combos[None].astype(bool), alt[:, None, :], base[:, None, :])
        bins = np.clip(variants, -64, 63).astype(np.int64) + 64
        return (bins << (7 * np.arange(_SKETCH))).sum(-1)

    def _match(self, sketch: np.ndarray, row: Any) -> int:
        """How many candidates, given their z-sketches ``[n, 6]`` and ``row(i)`` (the i-th
        candidate z-normalized, ``[F]``), are feature rows up to ``a x + b``."""
        hits = 0
        for sign in (1.0, -1.0):  # a negative scale flips the z-scores
            for start in range(0, len(sketch), _CHUNK):
                keys = self._keys(sign * sketch[start : start + _CHUNK], exact=True)[:, 0]
                for i in np.flatnonzero(np.isin(keys, self.keys)):
                    cands = np.asarray(self.table[int(keys[i])])
                    window = sign * row(start + i)
                    corr = self.rows[cands] @ window / self.num_features
                    close = cands[corr >= MATCH_CORRELATION]
                    hits += int(any(self._same_ties(c, window) for c in close))
        return hits

    def _same_ties(self, c: int, window: np.ndarray) -> bool:
        """Whether ``window`` holds at most two values wherever feature row ``c`` holds one: any
        element-wise map of the row holds one, stochastic rounding one of two neighbouring codes
        (:data:`MATCH_CORRELATION` alone took a packed update read as float64, two huge values
        where a two-word row has its words and hundreds of others elsewhere, for a copy)."""
        # The z-scores are an element-wise map of the row: equal where its values are equal.
        order = np.lexsort((window, self.rows[c]))
        z, w = self.rows[c][order], window[order]
        same = z[1:] == z[:-1]
        group = np.concatenate([[0], np.cumsum(~same)])  # each run of one row value
        new_value = np.concatenate([[False], same & (w[1:] != w[:-1])])
        return bool(np.bincount(group, weights=new_value).max() <= 1)

    def _row_hits(self, rows: np.ndarray) -> int:
        """How many of ``rows`` (``[n, F]``, any values) are feature rows up to ``a x + b``."""
        if not len(self.rows) or not len(rows):
            return 0
        z, ok = _zscore(np.asarray(rows, dtype=np.float64))
        z = np.where(ok[:, None], z, 0.0)
        sketch = np.where(ok[:, None], z @ self.proj, np.inf)  # constant rows match nothing
        return self._match(sketch, lambda i: z[i])

    def _run_hits(self, v: np.ndarray) -> int:
        """How many windows of the flat run ``v`` are feature rows up to ``a x + b``, every
        offset searched: the windows' z-sketches come from FFT correlations, not copies."""
        f = self.num_features
        if not len(self.rows) or v.size < f:
            return 0
        n = v.size - f + 1
        c1 = np.concatenate([[0.0], np.cumsum(v)])
        c2 = np.concatenate([[0.0], np.cumsum(v * v)])
        mean = (c1[f:] - c1[:-f]) / f
        std = np.sqrt(np.maximum((c2[f:] - c2[:-f]) / f - mean**2, 0.0))
        size = 1 << int(np.ceil(np.log2(v.size + f)))
        fv = np.fft.rfft(v, size)
        dots = np.stack(
            [np.fft.irfft(fv * np.conj(np.fft.rfft(p, size)), size)[:n] for p in self.proj.T], axis=1
        )
        ok = std > 1e-9 * np.maximum(np.abs(mean), 1.0)
        sketch = (dots - mean[:, None] * self.proj.sum(0)) / np.where(ok, std, 1.0)[:, None]
        sketch = np.where(ok[:, None], sketch, np.inf)

        def row(i: int) -> np.ndarray:
            w = v[i : i + f]
            return (w - w.mean()) / max(float(w.std()), 1e-300)

        return self._match(sketch, row)

    def _candidate_hits(self, a: np.ndarray) -> int:
        """Feature rows in ``a`` as rows, columns, beside extra columns, or in a flat run."""
        f = self.num_features
        hits = 0
        views = [a] if a.ndim < 2 else [a, np.swapaxes(a, -1, -2)]
        for v in views:
            d = v.shape[-1] if v.ndim else 0
            if v.ndim >= 2 and f <= d <= f + 16:
                m = v.reshape(-1, d)
                hits += sum(self._row_hits(m[:, off : off + f]) for off in range(d - f + 1))
            elif v.size >= f:
                hits += self._run_hits(np.ascontiguousarray(v, dtype=np.float64).reshape(-1))
        return hits

    # -- the search -----------------------------------------------------------------------
    def numeric_views(self, value: Any) -> Iterator[tuple[str, np.ndarray]]:
        """``value`` as numeric arrays: itself, its bytes in every dtype and alignment, numbers
        in its text, its list."""
        if isinstance(value, np.ndarray) and value.dtype.kind in "biuf" and value.dtype != np.uint8:
            yield "", value
            return
        if isinstance(value, np.ndarray):  # raw bytes (uint8)
            value = value.tobytes()
        if isinstance(value, str):
            value = value.encode()
        if isinstance(value, bytes | bytearray | memoryview):
            blob = bytes(value)
            for dt in _DTYPES:
                size = np.dtype(dt).itemsize
                for off in range(min(size, max(len(blob) - size + 1, 0))):
                    n = (len(blob) - off) // size
                    arr = np.frombuffer(blob, dtype=dt, count=n, offset=off)
                    yield f" as {np.dtype(dt).name} bytes", arr
            numbers = _NUMBER.findall(blob)
            if len(numbers) >= 8:
                yield " as numbers in text", np.array([float(t) for t in numbers])
            for run in _DIGITS.findall(blob):  # "0120...": labels written digit by digit
                yield " as digits in text", np.frombuffer(run, dtype=np.uint8).astype(np.float64) - ord("0")
            return
        if isinstance(value, list | tuple) and value and all(isinstance(v, int | float) for v in value):
            yield " as a list", np.asarray(value, dtype=np.float64)

    def scan(self, value: Any) -> list[str]:
        """What of this client's raw data ``value`` holds, in words (empty: nothing found)."""
        found: list[str] = []
        for how, arr in self.numeric_views(value):
            with np.errstate(all="ignore"):
                a = np.nan_to_num(arr.astype(np.float64), nan=0.0, posinf=0.0, neginf=0.0)
                # Bytes read as floats give values no feature has, and that overflow the sums.
                a[np.abs(a) > 1e30] = 0.0
            with np.errstate(all="ignore"):
                results = (self._rows_in(a), self._labels_in(a), self._edges_in(a, arr))
            for what in results:
                if what and what + how not in found:
                    found.append(what + how)
        return found

    def _rows_in(self, a: np.ndarray) -> str | None:
        hits = self._candidate_hits(a)
        return f"holds {hits} raw feature row(s) (up to scale and shift)" if hits else None

    def _labels_in(self, a: np.ndarray) -> str | None:
        if not self.labels or a.size < 8:
            return None
        seqs = []
        if np.all(a == np.round(a)) and np.all(np.abs(a) < 2**62):
            seqs.append(a.reshape(-1))
            if a.ndim == 2:
                seqs.append(a.T.reshape(-1))
        if a.ndim == 2 and min(a.shape) >= 2:  # one-hot rows or columns
            for m in (a, a.T):
                top = m.max(1, keepdims=True)
                if np.all((m == top).sum(1) == 1) and np.all((m == top) | (m == m.min(1, keepdims=True))):
                    seqs.append(m.argmax(1).astype(np.float64))
        for s in seqs:
            blob = s.astype(np.int64).tobytes()
            for i, secret in enumerate(self.labels):
                pos = blob.find(secret)
                while pos != -1 and pos % 8:
                    pos = blob.find(secret, pos + 1)
                if pos != -1:
                    return "holds the label vector" if i == 0 else "holds a split's label vector"
        return None

    def _edges_in(self, a: np.ndarray, raw: np.ndarray) -> str | None:
        if raw.dtype == bool or raw.dtype == np.uint8:
            bits = (
                np.unpackbits(raw.astype(np.uint8).reshape(-1)) if raw.dtype == np.uint8 else raw.reshape(-1)
            )
            n = self.n_owned
            if bits.size >= n * n and self.has_local_edges:
                where = np.flatnonzero(bits[: n * n])
                pairs = np.stack([self.node_ids[where // n], self.node_ids[where % n]], 1)
                hits, total = int(np.isin(_pair_keys(pairs), self.edge_keys).sum()), len(where)
                if hits >= max(4, total // 2):
                    return f"holds the adjacency as a bitmap ({hits} of {total} set bits are edges)"
        if a.size < 8 or not np.all(a == np.round(a)) or np.any(np.abs(a) >= 2**62):
            return None
        ai = a.astype(np.int64)
        candidates = []
        if ai.ndim == 2 and 2 in ai.shape:
            candidates.append(ai.T if ai.shape[0] == 2 else ai)
        flat = ai.reshape(-1)
        if flat.size % 2 == 0:
            candidates += [flat.reshape(-1, 2), flat.reshape(2, -1).T]
        for pairs in candidates:
            ok = (pairs >= 0).all(1) & (pairs < 2**31).all(1)
            hits = int(np.isin(_pair_keys(pairs[ok]), self.edge_keys).sum())
            if hits >= max(4, len(pairs) // 2):
                return f"is an edge list ({hits} of {len(pairs)} pairs are this client's edges)"
        return None


def flatten_values(value: Any) -> Iterator[Any]:
    """Leaves of a JSON-like value: strings, byte strings, arrays and lists of numbers."""
    if isinstance(value, dict):
        for v in value.values():
            yield from flatten_values(v)
    elif isinstance(value, list | tuple) and not all(isinstance(v, int | float) for v in value):
        for v in value:
            yield from flatten_values(v)
    elif isinstance(value, str):
        try:
            parsed = json.loads(value)
        except ValueError:
            yield value
        else:
            if isinstance(parsed, dict | list):
                yield from flatten_values(parsed)
            yield value
    else:
        yield value
