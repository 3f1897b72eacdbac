"""Adaptive bit widths (AdaQP): per-row widths that minimize weighted quantization variance in a budget.

A row sent at ``b`` bits adds variance proportional to ``w * range^2 / (2^b - 1)^2`` to the
receiver's aggregation, where ``w`` is the row's (squared) aggregation coefficient summed over
the receiver's nodes it feeds. :func:`allocate_bits` picks ``b`` per row in ``(1, 2, 4, 8)`` to
minimize the sum under a byte budget, exactly: every row's choices cost the same bytes, so an
optimal assignment gives wider codes to heavier rows (swap any violating pair and the objective
does not rise); it is therefore fixed by three cut points in the rows sorted by weight, which are
enumerated (vectorized over the last free cut).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from retexo_fl.compress.payload import HEADER_BYTES, frame_size
from retexo_fl.compress.quantize import CodecError
from retexo_fl.data.partition import CROSS_OUT, Partition
from retexo_fl.plan import BoundaryPlan

LEVELS = (1, 2, 4, 8)
# Above this many rows, cut points move in steps of ceil(n / MAX_CUTS) rows (per-group widths).
MAX_CUTS = 4096


def variance_factor(bits: int) -> float:
    """``1 / (2^b - 1)^2``: a row's quantization variance per unit of ``range^2``.

    Args:
        bits (int): the row's width ``b``.
    """
    return 1.0 / float((1 << bits) - 1) ** 2


def frame_overhead(rows: int) -> int:
    """Bytes of a per-row-width frame that do not depend on the widths: header, widths, ranges.

    Args:
        rows (int): the frame's rows.
    """
    return HEADER_BYTES + 5 * rows


def code_units(budget_bytes: int, rows: int, cols: int, frames: int = 1) -> int:
    """The most ``sum_i b_i`` that ``budget_bytes`` pays for, after fixed costs and packing slack.

    Args:
        budget_bytes (int): the byte budget.
        rows (int): the rows sent, over all frames.
        cols (int): values per row.
        frames (int, optional): the frames the rows go in (each pays a header and packing slack).
            (default: :obj:`1`)

    Returns:
        The bit-units per column, or ``-1`` when the budget does not cover the fixed costs.
    """
    free = budget_bytes - frames * HEADER_BYTES - 5 * rows - frames * len(LEVELS)
    return max(-1, (8 * free) // max(cols, 1)) if free >= 0 else -1


def one_bit_bytes(rows: int, cols: int) -> int:
    """The least budget (bytes) one frame of ``rows x cols`` values at 1 bit each needs: the
    inverse of :func:`code_units` at ``rows`` units."""
    return HEADER_BYTES + 5 * rows + len(LEVELS) + (rows * cols + 7) // 8


def allocate_bits(weights: Tensor, units: int) -> Tensor:
    """Widths ``b_i`` in ``(1, 2, 4, 8)``: minimize ``sum_i w_i / (2^b_i - 1)^2`` s.t. ``sum_i b_i <= units``.

    Args:
        weights (Tensor): non-negative row weights (aggregation weight times squared range).
        units (int): the bit budget per column, ``sum_i b_i`` (see :func:`code_units`).

    Shapes:
        - **input:** ``weights`` ``[n]``
        - **output:** ``[n]`` uint8

    Returns:
        The widths. Optimal for ``n <= MAX_CUTS``; above, rows are taken in sorted groups of
        ``ceil(n / MAX_CUTS)`` and the result is optimal among group-wise assignments.

    Raises:
        CodecError: if ``units < n`` (not even one bit per row fits).
    """
    w = weights.detach().double().cpu().view(-1)
    n = w.numel()
    if n == 0:
        return torch.zeros(0, dtype=torch.uint8)
    if units < n:
        raise CodecError(f"budget of {units} bit-units cannot give {n} rows one bit each")
    if units >= 8 * n:
        return torch.full((n,), 8, dtype=torch.uint8)
    order = torch.argsort(w, descending=True, stable=True)
    prefix = torch.cat([torch.zeros(1, dtype=torch.float64), torch.cumsum(w[order], 0)])
    g = {b: variance_factor(b) for b in LEVELS}
    group = -(-n // MAX_CUTS)
    cuts = torch.arange(0, n + 1, group)
    if int(cuts[-1]) != n:
        cuts = torch.cat([cuts, torch.tensor([n])])
    extra = units - n  # bits beyond one per row: 8-bit rows cost 7, 4-bit 3, 2-bit 1
    best_val, best = float("inf"), (0, 0, 0)
    for a in cuts.tolist():
        if 7 * a > extra:
            break
        b4 = cuts[(cuts >= a)] - a  # rows at 4 bits, vectorized
        b4 = b4[7 * a + 3 * b4 <= extra]
        if b4.numel() == 0:
            continue
        room = extra - 7 * a - 3 * b4
        c2 = torch.minimum(n - a - b4, room)
        c2 = (c2 // group) * group if group > 1 else c2  # stay on group boundaries
        end4, end2 = a + b4, a + b4 + c2
        val = (
            g[8] * prefix[a]
            + g[4] * (prefix[end4] - prefix[a])
            + g[2] * (prefix[end2] - prefix[end4])
            + g[1] * (prefix[n] - prefix[end2])
        )
        i = int(torch.argmin(val))
        if float(val[i]) < best_val:
            best_val, best = float(val[i]), (a, int(b4[i]), int(c2[i]))
    a, b4, c2 = best
    sorted_bits = torch.ones(n, dtype=torch.uint8)
    sorted_bits[:a] = 8
    sorted_bits[a : a + b4] = 4
    sorted_bits[a + b4 : a + b4 + c2] = 2
    out = torch.empty(n, dtype=torch.uint8)
    out[order] = sorted_bits
    return out


def objective(weights: Tensor, bits: Tensor) -> float:
    """``sum_i w_i / (2^b_i - 1)^2``: the weighted quantization variance of an assignment.

    Args:
        weights (Tensor): row weights.
        bits (Tensor): row widths.

    Shapes:
        - **input:** ``weights`` ``[n]``, ``bits`` ``[n]``
    """
    factors = 1.0 / ((2.0 ** bits.double()) - 1.0) ** 2
    return float((weights.double() * factors).sum())


def aggregation_weights(
    part: Partition,
    plan: BoundaryPlan,
    in_degree: Tensor,
    halo_degree: Tensor | None,
    model: str,
) -> dict[int, Tensor]:
    """Per peer, ``[k]`` summed squared aggregation coefficients of the rows sent to it.

    Row ``i`` feeds node ``j`` of the peer with coefficient ``1 / sqrt((d_i + 1)(d_j + 1))`` (GCN)
    or ``1 / d_j`` (mean-style aggregators); ``d_j`` is the halo degree the peer sent when known
    (``j`` among this client's halo nodes), else ``d_i`` stands in for it. Only this client's own
    cross edges are read.

    Args:
        part (Partition): the client's partition.
        plan (BoundaryPlan): its boundary plan.
        in_degree (Tensor): global in-degrees of the owned nodes.
        halo_degree (Tensor | None): global in-degrees of the halo nodes, or ``None``.
        model (str): the conv kind; ``"gcn"`` takes the GCN coefficient.

    Shapes:
        - **input:** ``in_degree`` ``[n]``, ``halo_degree`` ``[H]``
        - **output:** ``{peer: [k_peer]}`` float64, in :attr:`BoundaryPlan.send` row order
    """
    c = part.cross_edges
    deg_owned = in_degree.double().numpy()
    halo_deg: dict[int, float] = {}
    if halo_degree is not None and halo_degree.numel():
        halo_deg = dict(zip(plan.halo_ids.tolist(), halo_degree.double().view(-1).tolist(), strict=True))
    out = {}
    for q, ids in plan.send_ids.items():
        rows = c[(c[:, 2] == q) & ((c[:, 3] & CROSS_OUT) != 0)]
        local = np.searchsorted(part.node_ids, rows[:, 0])
        d_i = deg_owned[local]
        d_j = np.array([halo_deg.get(int(j), np.nan) for j in rows[:, 1]], dtype=np.float64)
        d_j = np.where(np.isnan(d_j), d_i, d_j)
        gcn = model == "gcn"
        coef2 = 1.0 / ((d_i + 1.0) * (d_j + 1.0)) if gcn else 1.0 / np.maximum(d_j, 1.0) ** 2
        slot = np.searchsorted(ids, rows[:, 0])
        out[q] = torch.from_numpy(np.bincount(slot, weights=coef2, minlength=ids.size))
    return out


def plan_widths(
    rows: dict[int, Tensor],
    weights: dict[int, Tensor],
    budgets: dict[int, int] | int,
    where: str,
) -> dict[int, Tensor]:
    """Per-row widths for each peer's block under a byte budget.

    Args:
        rows (dict[int, Tensor]): peer -> block to send.
        weights (dict[int, Tensor]): peer -> aggregation weights (:func:`aggregation_weights`).
        budgets (dict[int, int] | int): one budget (bytes) shared by all peers' frames, solved
            jointly; or peer -> its own budget (one problem per link, the bandwidth policy).
        where (str): names the stage / client in errors.

    Shapes:
        - **input:** ``rows[peer]`` ``[k, d]``, ``weights[peer]`` ``[k]``
        - **output:** ``{peer: [k]}`` uint8 (empty for a peer with no rows)

    Raises:
        CodecError: if a budget cannot pay one bit per value plus the frames' fixed bytes.
    """
    peers = [q for q in sorted(rows) if rows[q].shape[0]]
    out = {q: torch.zeros(0, dtype=torch.uint8) for q in rows}
    if not peers:
        return out
    cols = rows[peers[0]].shape[1]

    def items(qs: list[int]) -> Tensor:
        parts = []
        for q in qs:
            spread = (rows[q].amax(1) - rows[q].amin(1)).double().cpu()
            parts.append(weights[q].double().cpu().view(-1) * spread**2)
        return torch.cat(parts)

    groups = [peers] if isinstance(budgets, int) else [[q] for q in peers]
    for qs in groups:
        budget = budgets if isinstance(budgets, int) else budgets[qs[0]]
        n = sum(rows[q].shape[0] for q in qs)
        units = code_units(budget, n, cols, frames=len(qs))
        if units < n:
            floor = sum(frame_size(rows[q].shape[0], cols, torch.ones(rows[q].shape[0])) for q in qs)
            target = "its peers" if len(qs) > 1 else f"client {qs[0]}"
            raise CodecError(
                f"{where}: a budget of {budget} bytes to {target} is below the 1-bit minimum "
                f"of about {floor + 4 * len(qs)} bytes: raise byte-budget (or the rate-schedule's "
                "lowest rate)"
            )
        widths = allocate_bits(items(qs), units)
        start = 0
        for q in qs:
            k = rows[q].shape[0]
            out[q] = widths[start : start + k]
            start += k
    return out
