"""Compressed model updates: b-bit deltas from the round's global state, with error feedback.

A client sends ``Q(new - base + residual)`` and keeps ``residual <- new - base + residual -
deQ(...)`` for its next round, so what quantization drops is sent later instead of lost
(error feedback). Matrices are scaled per row, vectors per tensor. The server rebuilds
``base + deQ(...)``; the frames are the same as the boundary rows' (:mod:`.payload`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from retexo_fl.compress.payload import decode_rows, encode_rows, unpack_frame
from retexo_fl.compress.quantize import dequantize_rows

StateDict = dict[str, Tensor]


def _as_rows(t: Tensor) -> Tensor:
    return t.reshape(t.shape[0], -1) if t.dim() >= 2 else t.reshape(1, -1)


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
            frames[key] = encode_rows(
                _as_rows(delta), self.bits, generator=generator, half=self.half, where=f"{where}, {key}"
            )
            kept[key] = delta - decode_rows(frames[key], where).view_as(delta)
        return frames, kept

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

    Args:
        bits (int, optional): width of the broadcast deltas (32: send the state whole every
            round). (default: :obj:`32`)
        half (str, optional): dtype of the per-row ranges. (default: :obj:`"fp16"`)
        seed (int, optional): seed of the stochastic rounding (rounds are mixed in).
            (default: :obj:`0`)
    """

    def __init__(self, bits: int = 32, half: str = "fp16", seed: int = 0) -> None:
        self.codec = UpdateCodec(bits, half)
        self.bits, self.seed = int(bits), int(seed)
        self.view: StateDict | None = None
        self.frames: dict[str, bytes] | None = None

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

        else:
            gen = torch.Generator().manual_seed((self.seed * 1_000_003 + round_) % (1 << 63))
            self.frames, _ = self.codec.encode(state, self.view, None, gen, where="broadcast")
            self.view = self.codec.decode(self.frames, self.view, "server broadcast")
        return self.view

    def nbytes(self) -> int:
        """Bytes of the prepared broadcast, per client (the whole state when it is sent whole)."""
        if self.frames is None:
            return sum(t.numel() * t.element_size() for t in (self.view or {}).values())
        return UpdateCodec.nbytes(self.frames)
