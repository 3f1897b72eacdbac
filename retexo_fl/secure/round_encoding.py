"""The encoding both halves of a secure round agree on: the update vector's layout, its clip and
grid, and the terms a round is masked under (protocol and security argument:
:mod:`retexo_fl.secure.secagg`; the client's half: :mod:`retexo_fl.party.secure_reply`, the server's:
:mod:`retexo_fl.coordinator.secure_aggregation`)."""

from __future__ import annotations

import hashlib
import json
import math
from typing import Any

import numpy as np
import torch

from retexo_fl import protocol as P
from retexo_fl.records import StateDict
from retexo_fl.secure.secagg import (
    SecAggError,
    UpdateGrid,
    VectorCodec,
    expand_rows,
)

#: Seed tag of the field encoding's stochastic rounding (not secret: the vector is masked).
ROUNDING_TAG = 0x5A
#: Seed tag of a client's DP noise share under ``dp-reproducible``.
NOISE_TAG = 0xD9
#: How many noise-share standard deviations the field encoding leaves room for under DP.
NOISE_SIGMAS = 8.0
#: A grid row's clip over the clients' mean largest update magnitude in the row, last round, by
#: code width: room for a client whose peak is above the mean, or whose update grew. What a clip
#: cuts goes with the next round (error feedback), and the next grid reaches it; a wider clip
#: makes every step coarser. Chosen on validation, 2026-11-26: at 4 bits, Cora, 4 METIS clients,
#: defaults, seeds 0-2, mean val 0.763 at 1.0, 0.771 at 1.5, 0.760 at 2.0, 0.766 at 3.0 (0.777
#: without secure aggregation); at 8 and 16 bits (the generated 600-node graph, 8 rounds a
#: stage) 1.5 clipped ~300 coordinates and lost 5.7 (8 bits) and 4.7 (16 bits) points of test
#: accuracy, 4.0 clipped 6-7 and matched the plain run within 0.7 points (steps of 4/127 of a
#: peak cost nothing there).
GRID_MARGIN = {2: 1.5, 4: 1.5}
#: The margin of wider codes (see :data:`GRID_MARGIN`).
WIDE_GRID_MARGIN = 4.0


def flat_delta(base: StateDict, new: StateDict) -> np.ndarray:
    """``new - base`` over ``base``'s tensors in sorted key order, as one float64 vector."""
    return np.concatenate([(new[k].double() - base[k].double()).reshape(-1).numpy() for k in sorted(base)])


def flat_state(state: StateDict) -> np.ndarray:
    return np.concatenate([state[k].double().reshape(-1).numpy() for k in sorted(state)])


def unflatten(flat: np.ndarray, like: StateDict) -> StateDict:
    """A flat vector (:func:`flat_delta`'s order) back into ``like``'s shapes, float32."""
    out, at = {}, 0
    for k in sorted(like):
        n = like[k].numel()
        out[k] = torch.from_numpy(np.ascontiguousarray(flat[at : at + n])).float().reshape(like[k].shape)
        at += n
    return out


def update_clip(cfg: Any, members: int) -> float:
    """The bound of an update coordinate: ``secagg-clip``, or under DP the clipping norm plus
    :data:`NOISE_SIGMAS` noise-share deviations."""
    if cfg.dp_noise > 0:
        return cfg.dp_clip * (1.0 + NOISE_SIGMAS * cfg.dp_noise / math.sqrt(members))
    return float(cfg.secagg_clip)


def finite_or(value: float, otherwise: float) -> float:
    return float(value) if math.isfinite(float(value)) else otherwise


def round_terms(
    stage: int,
    round_: int,
    members: list[int],
    threshold: int,
    bound: float,
    grid: bytes = b"",
    *,
    state_digest: str = "",
    validate: bool = True,
    variant: str = "",
    inputs: str = "",
    config: str = "",
) -> bytes:
    """The digest of a masked round's terms, bound into every pair mask of the round
    (:func:`~retexo_fl.secure.masking.pairwise_mask_seed`): clients sent different terms derive
    masks that do not cancel, so the server decodes nothing from such a round.

    Every term a message can set per client and that shapes the masked contribution is bound:
    the members, threshold, weight bound and update grid; the broadcast state the client trains
    from (``state_digest``, :func:`masked_state_digest`): sent a useless state to every member
    but one, the others' updates would be known and the sum that member's alone; whether the
    round validates (``validate``): sent to one member only, the summed validation counts would
    be that member's; stage 0's variant under ``first-stage auto`` (``variant``); and where the
    client's stage inputs came from (``inputs``: a running digest of the states it embedded the
    earlier stages with, which the server also sends each client on its own); and the run
    config's digest as setup bound it (``config``), which holds the clip, update bits, learning
    rate and seed: a client rebuilt from a message refuses any other config, and members that
    were somehow handed different ones still derive masks that do not cancel.
    """
    text = json.dumps(
        [
            int(stage),
            int(round_),
            sorted(members),
            int(threshold),
            float(bound),
            hashlib.sha256(grid).hexdigest(),
            str(state_digest),
            bool(validate),
            str(variant),
            str(inputs),
            str(config),
        ]
    )
    return hashlib.sha256(b"retexo-fl secagg terms v5\0" + text.encode()).digest()


def grid_bits(cfg: Any) -> int:
    """The code width of the update grid: ``update-bits`` when compressed updates can be summed
    on a shared grid (2 to 16 bits, no DP: noise shares need the field's resolution), else 0."""
    bits = int(cfg.update_bits)
    return bits if 2 <= bits <= 16 and cfg.dp_noise <= 0 else 0


def row_sizes(like: StateDict) -> list[int]:
    """The rows of a state in :func:`flat_delta`'s order, as the update codec frames them: a
    matrix's first dimension (of ``numel / rows`` values each), a vector or scalar as one row."""
    rows: list[int] = []
    for k in sorted(like):
        t = like[k]
        if t.dim() >= 2 and t.shape[0] > 0:
            rows += [t.numel() // t.shape[0]] * t.shape[0]
        else:
            rows.append(t.numel())
    return rows


def masked_state_digest(state: StateDict) -> str:
    """A digest of a broadcast state: the same state sent twice is recognised."""
    h = hashlib.sha256()
    for k in sorted(state):
        h.update(k.encode() + b"\0" + state[k].detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def round_codec(
    cfg: Any, like: StateDict, members: int, bound: float, grid: np.ndarray | None = None
) -> VectorCodec:
    """The round's vector layout; ``grid`` (per-row clips) puts the update on a shared grid."""
    size = sum(t.numel() for t in like.values())
    rows = row_sizes(like) if grid_bits(cfg) else []
    shared = None
    if grid is not None:
        shared = UpdateGrid(expand_rows(grid, rows), grid_bits(cfg), members)
    return VectorCodec(size, members, update_clip(cfg, members), bound, shared, tuple(rows))


def parse_grid(blob: object, cfg: Any, like: StateDict, members: int, where: str) -> np.ndarray:
    """The per-row clips of a :data:`~retexo_fl.protocol.SECAGG_GRID` value, checked.

    Raises:
        SecAggError: the run does not put updates on a grid, or the value is not one finite clip
            in ``(0, secagg-clip]`` per row of the model, or its lanes would not fit a field
            element (naming the client and the field).
    """
    field_ = P.SECAGG_GRID
    if not grid_bits(cfg):
        raise SecAggError(
            f"{where}: a {field_} for a run with update-bits {cfg.update_bits} and dp-noise "
            f"{cfg.dp_noise}; its updates are summed as field elements"
        )
    rows = row_sizes(like)
    if not isinstance(blob, bytes | bytearray) or len(blob) != 4 * len(rows):
        raise SecAggError(f"{where}: {field_} is not {len(rows)} float32 row clips ({4 * len(rows)} bytes)")
    clips = np.frombuffer(bytes(blob), dtype="<f4").astype(np.float64)
    top = update_clip(cfg, members)
    if not (np.isfinite(clips).all() and (clips > 0).all() and (clips <= top).all()):
        raise SecAggError(f"{where}: {field_} holds a clip that is not finite, > 0 and <= secagg-clip {top}")
    if (2 * members * (2 ** (grid_bits(cfg) - 1) - 1)).bit_length() > 32:
        raise SecAggError(
            f"{where}: {field_} for {members} members: their sums would not fit a field element"
        )
    return clips
