"""Compressed model updates: b-bit deltas from the round's global state, with error feedback.

A client sends ``Q(new - base + residual)`` and keeps ``residual <- new - base + residual -
deQ(...)`` for its next round, so what quantization drops is sent later instead of lost
(error feedback). Matrices are scaled per row, vectors per tensor. The server rebuilds
``base + deQ(...)``; the frames are the same as the boundary rows' (:mod:`.payload`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import numpy as np
import torch
from torch import Tensor

from retexo_fl.compress.payload import HEADER_BYTES, decode_rows, encode_rows, pack_frame, unpack_frame
from retexo_fl.compress.quantize import (
    RANGE_DTYPES,
    QuantizedRows,
    dequantize_rows,
    fixed_widths,
    quantize_rows,
    quantize_stacked,
)
from retexo_fl.compress.settings import QUANT_BITS

StateDict = dict[str, Tensor]


def _as_rows(t: Tensor) -> Tensor:
    return t.reshape(t.shape[0], -1) if t.dim() >= 2 else t.reshape(1, -1)


def _dequantize_stack(blocks: list[QuantizedRows]) -> Tensor:
    """The blocks' float32 values, ``[n, k, d]``; one pass when the blocks' codes join into one
    block's (whole bytes per block), else block by block. Equal to :func:`dequantize_rows` on each."""
    (k, d), bits = blocks[0].shape, blocks[0].uniform_bits
    if bits is None or (k * d * bits) % 8:
        return torch.stack([dequantize_rows(q) for q in blocks])
    joined = QuantizedRows(
        (k * len(blocks), d),
        fixed_widths(k * len(blocks), bits),
        torch.cat([q.lo for q in blocks]),
        torch.cat([q.hi for q in blocks]),
        torch.cat([q.data for q in blocks]),
        blocks[0].half,
    )
    return dequantize_rows(joined.known_width(bits)).view(len(blocks), k, d)


def _unpack_stack(frames: list[bytes], k: int, d: int, half: str) -> Tensor | None:
    """The ``[n, k, d]`` values of ``n`` frames with one header (a uniform width whose codes fill
    whole bytes), or ``None`` when a frame's ranges fail :func:`unpack_frame`'s checks."""
    size = len(frames[0])
    table = np.frombuffer(b"".join(frames), np.uint8).reshape(len(frames), size)
    bits = int(table[0, 4])
    dtype = RANGE_DTYPES[half]
    ranges = torch.from_numpy(table[:, HEADER_BYTES : HEADER_BYTES + 4 * k].copy())
    lo = ranges[:, : 2 * k].contiguous().view(dtype).reshape(-1)
    hi = ranges[:, 2 * k :].contiguous().view(dtype).reshape(-1)
    finite = bool(torch.isfinite(lo).all()) and bool(torch.isfinite(hi).all()) and bool((hi >= lo).all())
    if not finite or not bool(torch.isfinite(hi.float() - lo.float()).all()):
        return None
    codes = torch.from_numpy(table[:, HEADER_BYTES + 4 * k :].copy()).reshape(-1)
    joined = QuantizedRows((k * len(frames), d), fixed_widths(k * len(frames), bits), lo, hi, codes, half)
    return dequantize_rows(joined.known_width(bits)).view(len(frames), k, d)


class UpdateCodec:
    """Encodes a client's model update at ``bits`` (8 by default; 32 is lossless).

    Args:
        bits (int, optional): code width for the deltas, one of 1, 2, 4, 8, 16, 32.
            (default: :obj:`8`)
        half (str, optional): dtype of the per-row ranges (``fp16`` or ``bf16``).
            (default: :obj:`"fp16"`)
    """

    def __init__(self, bits: int = 8, half: str = "fp16") -> None:
        self.bits, self.half = int(bits), half

    def encode(
        self,
        new: StateDict,
        base: StateDict,
        residual: StateDict | None,
        generator: torch.Generator | None = None,
        where: str = "update",
    ) -> tuple[dict[str, bytes], StateDict]:
        """Frames of ``new - base (+ residual)`` per tensor, and the residual to keep.

        Args:
            new (StateDict): the trained state.
            base (StateDict): the state training started from.
            residual (StateDict | None): what earlier rounds' quantization left out (error
                feedback), or ``None``.
            generator (torch.Generator | None, optional): the stochastic rounding's random source.
                (default: :obj:`None`)
            where (str, optional): names the sender in errors. (default: :obj:`"update"`)

        Shapes:
            - **input:** ``new[key]``, ``base[key]``, ``residual[key]`` of one shape; matrices are
              framed as ``[rows, numel / rows]``, vectors as ``[1, numel]``
            - **output:** ``{key: frame}``, and ``residual[key]`` in ``new[key]``'s shape (float32)

        Returns:
            ``(frames, residual)``.

        Raises:
            CodecError: if a delta holds NaN / Inf.
        """
        frames, kept = {}, {}
        for key, value in new.items():
            delta = value.detach().float().cpu() - base[key].detach().float().cpu()
            if residual is not None and key in residual:
                delta = delta + residual[key]
            if self.bits not in QUANT_BITS:  # 16 / 32 bits: the frame is the values
                frames[key] = encode_rows(
                    _as_rows(delta), self.bits, generator=generator, half=self.half, where=f"{where}, {key}"
                )
                kept[key] = delta - decode_rows(frames[key], where).view_as(delta)
                continue
            # The residual from the codes as quantized, not from the frame parsed and checked
            # again: the same values (a frame holds the codes and ranges as they are).
            q = quantize_rows(
                _as_rows(delta), self.bits, generator=generator, half=self.half, where=f"{where}, {key}"
            )
            frames[key] = pack_frame(q)
            kept[key] = delta - dequantize_rows(q).view_as(delta)
        return frames, kept

    def encode_many(
        self,
        news: Sequence[StateDict],
        base: StateDict,
        residuals: Sequence[StateDict | None],
        generators: Sequence[torch.Generator | None],
        wheres: Sequence[str],
    ) -> list[tuple[dict[str, bytes], StateDict]]:
        """:meth:`encode` for many clients that trained from one ``base``: equal, client for
        client and byte for byte, to calling it on each, in one pass per tensor.

        Args:
            news (Sequence[StateDict]): each client's trained state (the same keys and shapes).
            base (StateDict): the state they all trained from.
            residuals (Sequence[StateDict | None]): each client's error-feedback residual.
            generators (Sequence[torch.Generator | None]): each client's rounding source.
            wheres (Sequence[str]): each client's name in errors.

        Returns:
            ``(frames, residual)`` per client, in order.

        Raises:
            CodecError: as :meth:`encode` does, naming the first client whose delta it refuses.
        """
        n = len(news)
        if self.bits not in QUANT_BITS or n < 2:
            return [self.encode(news[i], base, residuals[i], generators[i], wheres[i]) for i in range(n)]
        frames: list[dict[str, bytes]] = [{} for _ in range(n)]
        kept: list[StateDict] = [{} for _ in range(n)]
        for key in news[0]:
            ref = base[key].detach().float().cpu()
            delta = torch.stack([new[key].detach().float().cpu() for new in news]) - ref
            carried = [i for i, r in enumerate(residuals) if r is not None and key in r]
            if carried:  # added only where a residual exists, as encode() does (-0.0 stays -0.0)
                delta[carried] += torch.stack([residuals[i][key] for i in carried])  # type: ignore[index]
            rows = delta.reshape(n, *_as_rows(ref).shape)
            blocks = quantize_stacked(
                rows, self.bits, generators, half=self.half, wheres=[f"{w}, {key}" for w in wheres]
            )
            for i, q in enumerate(blocks):
                frames[i][key] = pack_frame(q)
            for i, left in enumerate((rows - _dequantize_stack(blocks)).view_as(delta).unbind(0)):
                kept[i][key] = left
        return list(zip(frames, kept, strict=True))

    def decode(self, frames: dict[str, bytes], base: StateDict, source: str) -> StateDict:
        """``base + deltas``, checking every tensor is present and of ``base``'s shape.

        Args:
            frames (dict[str, bytes]): ``{key: frame}`` from :meth:`encode`.
            base (StateDict): the state the deltas apply to.
            source (str): who sent the frames, for error messages.

        Shapes:
            - **output:** one tensor per key of ``base``, in its shape and dtype

        Raises:
            ValueError: if a tensor of ``base`` has no frame.
            PayloadError: if a frame is malformed or of another shape.
        """
        missing = sorted(set(base) - set(frames))
        if missing:
            raise ValueError(f"update from {source}: missing tensors {missing}")
        out = {}
        for key, ref in base.items():
            rows = _as_rows(ref)
            q = unpack_frame(frames[key], f"{source} ({key})", rows.shape[0], rows.shape[1])
            out[key] = (ref.float() + dequantize_rows(q).view_as(ref)).to(ref.dtype)
        return out

    def decode_many(
        self, frames: Sequence[dict[str, bytes]], base: StateDict, sources: Sequence[str]
    ) -> list[StateDict]:
        """:meth:`decode` of many clients' frames against one ``base``, in one pass per tensor
        where every client's frame of it has the first one's header and size; equal to decoding
        each. A frame that differs, or ranges a check refuses, are decoded client by client, so
        an error names its sender exactly as :meth:`decode` does.

        Args:
            frames (Sequence[dict[str, bytes]]): each client's ``{key: frame}``.
            base (StateDict): the state the deltas apply to.
            sources (Sequence[str]): who sent each, for error messages.

        Raises:
            ValueError: if a tensor of ``base`` has no frame.
            PayloadError: if a frame is malformed or of another shape.
        """
        n = len(frames)
        if n < 2 or any(set(base) - set(f) for f in frames):
            return [self.decode(frames[i], base, sources[i]) for i in range(n)]
        out: list[StateDict] = [{} for _ in range(n)]
        for key, ref in base.items():
            k, d = _as_rows(ref).shape
            first = frames[0][key]
            q = unpack_frame(first, f"{sources[0]} ({key})", k, d)  # every check, on one frame
            bits = q.uniform_bits
            same = bits in QUANT_BITS and (k * d * bits) % 8 == 0
            same = same and all(
                len(f[key]) == len(first) and f[key][:HEADER_BYTES] == first[:HEADER_BYTES] for f in frames
            )
            deltas = _unpack_stack([f[key] for f in frames], k, d, q.half) if same else None
            if deltas is None:  # one by one: the sender's own checks and errors
                for i in range(n):
                    rows = _as_rows(ref)
                    one = unpack_frame(frames[i][key], f"{sources[i]} ({key})", rows.shape[0], rows.shape[1])
                    out[i][key] = (ref.float() + dequantize_rows(one).view_as(ref)).to(ref.dtype)
                continue
            values = (ref.float() + deltas.view(n, *ref.shape)).to(ref.dtype)
            for i in range(n):
                out[i][key] = values[i]
        return out

    @staticmethod
    def nbytes(frames: dict[str, bytes]) -> int:
        """Total bytes of ``frames``.

        Args:
            frames (dict[str, bytes]): ``{key: frame}``.
        """
        return sum(len(f) for f in frames.values())


class ModelBroadcast:
    """Server side of a compressed model broadcast: what every client holds, and how to move it.

    Clients hold a ``view`` of the global state. The first round of a stage sends the state
    whole; later rounds send ``Q(state - view)`` frames and both sides add the decoded delta to
    ``view``. What a round leaves out stays in ``state - view`` and goes out with the next round
    (error feedback). At 32 bits the view is the state itself.

    A client that missed rounds (sampled out, or a validator asked every few rounds) catches up
    with the deltas it missed, in order (:meth:`chain`): it then holds the very view the others
    hold, for no more bytes than they were sent. The broadcast keeps the last deltas of the stage
    for that, as many as cost less than the state sent whole.

    Args:
        bits (int, optional): width of the broadcast deltas (32: send the state whole every
            round). (default: :obj:`32`)
        half (str, optional): dtype of the per-row ranges. (default: :obj:`"fp16"`)
        seed (int, optional): seed of the stochastic rounding (rounds are mixed in).
            (default: :obj:`0`)
        catch_up (bool, optional): keep the deltas for clients that missed rounds (a control
            variate's broadcast reaches every client every round: it keeps none).
            (default: :obj:`True`)
    """

    #: ``(round, frames)`` of the stage's last deltas, oldest first (see :meth:`chain`). A class
    #: default: a checkpoint written by older code has none, and its clients catch up whole.
    past: ClassVar[list[tuple[int, dict[str, bytes]]]] = []
    #: Whether deltas are kept at all (see ``catch_up``); a class default for the same reason.
    catch_up: ClassVar[bool] = True

    def __init__(self, bits: int = 32, half: str = "fp16", seed: int = 0, catch_up: bool = True) -> None:
        self.codec = UpdateCodec(bits, half)
        self.bits, self.seed = int(bits), int(seed)
        self.view: StateDict | None = None
        self.frames: dict[str, bytes] | None = None
        self.past = []
        self.catch_up = catch_up

    def prepare(self, state: StateDict, round_: int) -> StateDict:
        """The view clients will hold after round ``round_``'s broadcast of ``state``.

        Args:
            state (StateDict): the new global state.
            round_ (int): the round it is broadcast for; round 1 (a stage's first) sends it whole.

        Shapes:
            - **output:** the view, one tensor per key in ``state``'s shape and dtype
        """
        if self.bits >= 32 or self.view is None or round_ <= 1:
            self.frames = None
            self.view = state  # states are never modified in place once made
            self.past = []
        else:
            gen = torch.Generator().manual_seed((self.seed * 1_000_003 + round_) % (1 << 63))
            self.frames, _ = self.codec.encode(state, self.view, None, gen, where="broadcast")
            self.view = self.codec.decode(self.frames, self.view, "server broadcast")
            # Keep the deltas a client might still catch up with: a longer chain than these
            # costs more than the state whole, which such a client is sent instead.
            past = [*self.past, (round_, self.frames)] if self.catch_up else []
            whole, size = self.whole_nbytes(), 0
            for i in range(len(past) - 1, -1, -1):
                size += UpdateCodec.nbytes(past[i][1])
                if size >= whole:
                    past = past[i + 1 :]
                    break
            self.past = past
        return self.view

    def chain(self, held: int) -> list[dict[str, bytes]] | None:
        """The deltas that take a client from the view of round ``held``'s broadcast to the
        current one, oldest first, when they cost less than the state sent whole; else ``None``.

        Args:
            held (int): the round whose broadcast the client holds (it took part in that round,
                or was caught up to it), from 1, the stage's whole state.

        Returns:
            list[dict[str, bytes]] | None: at least one delta (the current one last); ``None``
            also when the current broadcast is the state whole.
        """
        if self.frames is None or not self.past or held < self.past[0][0] - 1:
            return None
        steps = [frames for round_, frames in self.past if round_ > held]
        if not steps or sum(UpdateCodec.nbytes(f) for f in steps) >= self.whole_nbytes():
            return None
        return steps

    def whole_nbytes(self) -> int:
        """Bytes of the current view sent whole."""
        return sum(t.numel() * t.element_size() for t in (self.view or {}).values())

    def nbytes(self) -> int:
        """Bytes of the prepared broadcast, per client (the whole state when it is sent whole)."""
        if self.frames is None:
            return self.whole_nbytes()
        return UpdateCodec.nbytes(self.frames)
