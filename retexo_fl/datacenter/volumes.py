"""Closed-form communication of each CAGNET algorithm, to set beside what a run measured."""

from __future__ import annotations

from retexo_fl.datacenter.blocks import NNZ_BYTES

#: Bytes of one dense word (float32).
WORD_BYTES = 4


def spmm_bytes(algorithm: str, n: int, nnz: int, width: int, procs: int, replication: int = 2) -> float:
    """Mean bytes a process receives in one distributed ``A @ H`` (``A`` ``[n, n]``, ``H`` ``[n, width]``).

    With ``q`` the grid side and ``T = P / c`` the 1.5D team count:

    - 1D: ``(P - 1) / P * n F`` words (every H block but one's own);
    - 1.5D: ``(T - 1) / (c T) * n F`` by broadcast plus a ring all-reduce of the team's block,
      ``2 (c - 1) / c * n F / T``;
    - 2D: ``(q - 1) / q^2 * nnz`` nonzeros plus ``(q - 1) / q^2 * n F`` words (SUMMA);
    - 3D: ``(q - 1) / q^3 * nnz`` nonzeros plus ``2 (q - 1) / q^3 * n F`` words (all-gather of
      H, reduce-scatter of the partial sums).

    A nonzero costs :data:`~retexo_fl.datacenter.blocks.NNZ_BYTES`, a word :data:`WORD_BYTES`.

    Args:
        algorithm (str): ``"1d"``, ``"1.5d"``, ``"2d"`` or ``"3d"``.
        n (int): the number of nodes.
        nnz (int): the adjacency's nonzeros.
        width (int): ``F``, the dense matrix's columns.
        procs (int): ``P``, the process count.
        replication (int, optional): 1.5D's ``c``. (default: :obj:`2`)

    Raises:
        ValueError: on an unknown ``algorithm``.
    """
    p, nf = procs, n * width
    if algorithm == "1d":
        words, nonzeros = (p - 1) / p * nf, 0.0
    elif algorithm == "1.5d":
        c = replication
        t = p // c
        words, nonzeros = (t - 1) / (c * t) * nf + 2 * (c - 1) / c * nf / t, 0.0
    elif algorithm == "2d":
        q = round(p**0.5)
        words, nonzeros = (q - 1) / q**2 * nf, (q - 1) / q**2 * nnz
    elif algorithm == "3d":
        q = round(p ** (1 / 3))
        words, nonzeros = 2 * (q - 1) / q**3 * nf, (q - 1) / q**3 * nnz
    else:
        raise ValueError(f"unknown algorithm {algorithm!r}")
    return words * WORD_BYTES + nonzeros * NNZ_BYTES


def epoch_spmm_bytes(
    algorithm: str, n: int, nnz: int, widths: list[int], procs: int, replication: int = 2
) -> float:
    """Mean bytes a process receives in the products of one training epoch (forward + backward).

    Args:
        algorithm (str): ``"1d"``, ``"1.5d"``, ``"2d"`` or ``"3d"``.
        n (int): the number of nodes.
        nnz (int): the adjacency's nonzeros.
        widths (list[int]): the width of each layer's product.
        procs (int): ``P``, the process count.
        replication (int, optional): 1.5D's ``c``. (default: :obj:`2`)

    Raises:
        ValueError: on an unknown ``algorithm``.
    """
    return sum(2 * spmm_bytes(algorithm, n, nnz, w, procs, replication) for w in widths)
