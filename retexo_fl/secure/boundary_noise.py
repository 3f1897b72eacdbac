r"""Clipped, noised boundary rows: a Gaussian mechanism on every row a client releases to peers.

Boundary rows are functions of a client's raw features, and stage 0's rows invert to them (the
inversion benchmark, ``bench/inversion.py``, measures how far). Before rows leave a client,
each is clipped to L2 norm :math:`C` (``boundary-clip``) and Gaussian noise of standard deviation
:math:`\sigma C` (``boundary-noise`` :math:`\sigma`) is added to every entry. The noise is drawn
once per row and exchange, so a row sent to two peers is one release, not two.

What it guarantees, exactly: each release is a Gaussian mechanism on one row's value, whose L2
sensitivity is :math:`2C` when the row is replaced by any other (both clipped). Composed over a
node's releases with Rényi DP (Mironov, 2017), :func:`gaussian_epsilon` gives the
:math:`(\varepsilon, \delta)` each row's value keeps. It is not node-level DP of the graph: a
node's features also shape its neighbours' rows at later stages, each of which is clipped and
noised too but is accounted as its own row.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import math
import os
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import Tensor

#: Rényi orders the accountant minimizes over.
_ORDERS = [1.0 + x / 10.0 for x in range(1, 100)] + [
    12.0,
    14.0,
    16.0,
    20.0,
    24.0,
    32.0,
    48.0,
    64.0,
    128.0,
    256.0,
]


def release_rows(rows: Tensor, clip: float, noise: float, generator: torch.Generator | None = None) -> Tensor:
    """``rows`` clipped to L2 norm ``clip`` each, plus Gaussian noise of std ``noise * clip``.

    Args:
        rows (Tensor): the rows to release.
        clip (float): the per-row L2 norm, > 0.
        noise (float): the noise multiplier, >= 0 (0: clipping only).
        generator (torch.Generator, optional): seeds the noise. (default: :obj:`None`)

    Shapes:
        - **input:** ``rows`` ``[n, d]``
        - **output:** ``[n, d]``, float32

    Raises:
        ValueError: ``clip`` <= 0, ``noise`` < 0, or either not finite.
    """
    if not (math.isfinite(clip) and math.isfinite(noise)) or clip <= 0 or noise < 0:
        raise ValueError(f"boundary-clip must be > 0 and boundary-noise >= 0, got {clip} and {noise}")
    rows = rows.float()
    norms = rows.norm(dim=1, keepdim=True).clamp_min(1e-12)
    out = rows * (clip / norms).clamp(max=1.0)
    if noise > 0:
        out = out + torch.randn(out.shape, generator=generator) * (noise * clip)
    return out


def gaussian_epsilon(noise: float, releases: int, delta: float) -> float:
    r"""The :math:`\varepsilon` one row's value keeps after ``releases`` clipped, noised releases.

    Each release is a Gaussian mechanism with noise multiplier ``noise`` on a row of L2
    sensitivity twice the clip (replacement), so its Rényi DP at order :math:`\alpha` is
    :math:`2\alpha / \sigma^2`; ``releases`` of them add up, and
    :math:`\varepsilon = \min_\alpha \mathrm{RDP}(\alpha) + \log(1/\delta) / (\alpha - 1)`.

    Args:
        noise (float): the noise multiplier :math:`\sigma` (0: no guarantee, ``inf``).
        releases (int): how many times a row's value was released.
        delta (float): the :math:`\delta`, in (0, 1).
    """
    if releases <= 0:
        return 0.0
    if noise <= 0:
        return math.inf
    per_order = (releases * 2.0 * a / noise**2 + math.log(1.0 / delta) / (a - 1.0) for a in _ORDERS)
    return min(per_order)


def release_load(noise: float) -> float:
    r"""One release's share of a row's Rényi DP: at order :math:`\alpha` a release with noise
    multiplier :math:`\sigma` costs :math:`2\alpha / \sigma^2`, so releases at any noise add up
    as the sum of their :math:`1 / \sigma^2` (``inf`` without noise)."""
    return math.inf if noise <= 0 else 1.0 / noise**2


def load_epsilon(load: float, delta: float) -> float:
    """The :math:`\varepsilon` of releases whose :func:`release_load` sums to ``load``: as
    :func:`gaussian_epsilon` of one release at noise ``load ** -0.5``."""
    if load <= 0:
        return 0.0
    return math.inf if math.isinf(load) else gaussian_epsilon(load**-0.5, 1, delta)


class ReleaseLedger:
    """A node's record of what its boundary releases spent, per partition, over every run.

    A JSON file ``{partition: summed release load}`` (:func:`release_load`), read and written
    under an exclusive lock, so that the ClientApp processes of one node (one a message) count
    into one total. A party's budget (``max-boundary-epsilon``) is spent against it: a server
    that starts the same federation again, under a new run key, starts from what the earlier
    runs spent. Every release is counted as it is made: each draws fresh noise, so a release
    made again (a round sent again after a crash) is another release.

    Args:
        path (Path): the ledger file (created with its folder; mode 0600).
        key (str): whose rows (the partition's folder, resolved).
    """

    def __init__(self, path: Path, key: str) -> None:
        self.path = path
        self.key = key
        self._data: dict[str, float] = {}

    @contextlib.contextmanager
    def spending(self) -> Iterator[float]:
        """Lock the ledger and give what this key spent so far; :meth:`add` within the block
        records a release.

        Raises:
            ValueError: an unreadable ledger, naming the file (a budget that cannot be read is
                not assumed unspent).
        """
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path.with_suffix(".lock"), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            self._data = {}
            if self.path.exists():
                try:
                    raw = json.loads(self.path.read_text())
                    self._data = {str(k): float(v) for k, v in raw.items()}
                except (ValueError, TypeError, AttributeError) as exc:
                    raise ValueError(f"{self.path}: boundary release ledger unreadable ({exc})") from None
            yield self._data.get(self.key, 0.0)
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

    def add(self, load: float) -> None:
        """Record one release of ``load`` (inside :meth:`spending`), written before it returns."""
        self._data[self.key] = self._data.get(self.key, 0.0) + load
        tmp = self.path.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as out:
            json.dump(self._data, out)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, self.path)
