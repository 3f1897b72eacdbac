"""Dropout with a cheaper mask than ``nn.Dropout``'s: 16 hashed bits per element, compared.

PyTorch's CPU dropout draws its mask with ``bernoulli_(1 - p)``, one scalar Bernoulli draw per
element: about 15 ns an element on these machines (torch 2.13, 2 threads). In a lazy conv stage
that was half of a round's time: the input dropout covers every owned and halo row at every
step (``bench/scale.py``'s profile, 100,000 nodes). Here a mask takes one 64-bit key from
torch's generator (the device's, so masks are reproducible per seed; a GPU run as a whole need
not be, where its kernels add with atomics, as PyG's scatters do) and hashes a counter with
it: word ``w`` is ``splitmix64(key + (w + 1) * 0x9E3779B97F4A7C15)``, whose four 16-bit lanes
give elements ``4 w`` to ``4 w + 3`` a uniform ``w16`` each. An element is kept when ``w16 >=
round(p * 2^16)``: with probability ``1 - p'``, ``p'`` being ``p`` rounded to a multiple of
2^-16 (exactly ``p`` for 0.5, 0.25, ...; within 7.7e-6 of it always). A kept element is scaled by
``1 / (1 - p')``, so the output's expectation is the input, as with ``nn.Dropout``.

On the CPU a float32 mask is hashed by one compiled loop
(:func:`retexo_fl.compress.native.dropout_mask`); elsewhere (a GPU, another dtype, no compiler,
``RETEXO_FL_NATIVE=0``) torch integer ops hash it; both give the same mask, bit for bit. From
:data:`FUSED_MIN_ELEMENTS` elements a contiguous CPU float32 dropout multiplies by the mask in
that loop without writing it, and hashes it again for the backward pass, so no mask is held
between the passes: the same values and gradients as ``x * mask``.

The hash replaced a draw of every lane from torch's Mersenne Twister, whose 64-bit draws alone
took 7.4 ns per four elements, and four more passes to compare, cast and scale: a Cora run with
the defaults spent a quarter of its time there.
"""

from __future__ import annotations

import math
import sys

import torch
from torch import Tensor, nn

from retexo_fl.compress import native
from retexo_fl.seeding import dropout_generator

# splitmix64's constants, as the int64 values of the same bits (torch's integers are signed; its
# products wrap as unsigned ones do).
_GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)
_MIX1 = 0xBF58476D1CE4E5B9 - (1 << 64)
_MIX2 = 0x94D049BB133111EB - (1 << 64)

#: From this many elements a contiguous CPU float32 dropout multiplies by its mask in the compiled
#: loop without writing the mask (forward and backward); below, the autograd function and the two
#: loop calls cost more than the pass they save. Measured forward + backward on 2 cores: 572 us
#: against 457 at 388,343 elements, 753 against 669 at 600,000, 1.19 ms against 1.43 at 1,000,000,
#: 6.5 ms against 7.5 at 4,000,000. The values are the same either way.
FUSED_MIN_ELEMENTS = 1 << 20


def _shift_right(z: Tensor, bits: int) -> Tensor:
    """``z >> bits`` as on unsigned 64-bit integers (torch's ``>>`` on int64 copies the sign)."""
    return (z >> bits) & ((1 << (64 - bits)) - 1)


def hashed_lanes(key: Tensor, n: int) -> Tensor:
    """The first ``n`` signed 16-bit lanes of the counter hash, as torch ops (the compiled loop's
    reference, and the path on devices other than the CPU).

    Args:
        key (Tensor): the mask's key, one int64 (on the device the lanes are made on).
        n (int): lanes to return.

    Shapes:
        - **output:** ``[n]`` int16
    """
    z = torch.arange(1, (n + 3) // 4 + 1, dtype=torch.int64, device=key.device).mul_(_GOLDEN).add_(key)
    z = z.bitwise_xor_(_shift_right(z, 30)).mul_(_MIX1)
    z = z.bitwise_xor_(_shift_right(z, 27)).mul_(_MIX2)
    z = z.bitwise_xor_(_shift_right(z, 31))
    # Lane j of a word is bits 16 j to 16 j + 15: the int16 at index j of the word on a
    # little-endian machine (one view, no pass); elsewhere each lane is cut out by value.
    if sys.byteorder == "little":
        return z.view(torch.int16)[:n]
    lanes = torch.stack([_shift_right(z, 16 * j) & 0xFFFF for j in range(4)], dim=1).view(-1)[:n]
    return (lanes - ((lanes >= 32768).to(torch.int64) << 16)).to(torch.int16)


def _mask_constants(p: float) -> tuple[int, float]:
    """The lane threshold (on the lane read as a signed value) and a kept element's scale."""
    if not 0.0 <= p < 1.0:
        raise ValueError(f"a keep mask needs 0 <= p < 1, got {p}")
    dropped = min(round(p * 65536), 65535)  # of the 2^16 equally likely values of a lane
    return dropped - 32768, 65536 / (65536 - dropped)


def _draw_key(device: torch.device) -> Tensor:
    # Every int64 but the largest; the key is read on the device, never by the host.
    return torch.randint(
        -(2**63), 2**63 - 1, (1,), dtype=torch.int64, device=device, generator=dropout_generator(device)
    )


def keep_mask(shape: tuple[int, ...], p: float, *, dtype: torch.dtype, device: torch.device) -> Tensor:
    """A dropout mask: ``1 / (1 - p')`` where an element is kept (probability ``1 - p'``), else 0;
    ``p'`` is ``p`` rounded to a multiple of 2^-16.

    Draws one int64 from ``device``'s dropout generator (:func:`~retexo_fl.seeding.dropout_generator`).

    Args:
        shape (tuple[int, ...]): the mask's shape.
        p (float): the probability of dropping an element, in ``[0, 1)``.
        dtype (torch.dtype): the mask's dtype.
        device (torch.device): where it is drawn.

    Raises:
        ValueError: unless ``0 <= p < 1``.
    """
    lo, scale = _mask_constants(p)
    n = math.prod(shape)
    key = _draw_key(device)
    if dtype == torch.float32 and key.device.type == "cpu" and native.library() is not None:
        return native.dropout_mask(key, n, lo, scale).view(shape)
    # A float32 scale written as a constant equals 1.0 * scale in float32, as below; other
    # dtypes round the scale their own way, so they take this path everywhere.
    return hashed_lanes(key, n).view(shape).ge(lo).to(dtype).mul_(scale)


def dropout(x: Tensor, p: float, training: bool = True) -> Tensor:
    """``x`` with each element zeroed with probability ``p`` and the rest scaled by ``1 / (1 - p)``
    (``x`` itself outside training or at ``p = 0``; zeros at ``p = 1``).

    Args:
        x (Tensor): the input.
        p (float): the drop probability, in ``[0, 1]``.
        training (bool, optional): whether to drop at all. (default: :obj:`True`)

    Shapes:
        - **input:** ``x`` any shape
        - **output:** the shape of ``x``
    """
    if not training or p == 0.0:
        return x
    if p >= 1.0:
        return x * 0.0  # keeps the graph, as nn.Dropout(1.0) does
    if _fused(x):
        lo, scale = _mask_constants(p)
        return _MaskedProduct.apply(x, _draw_key(x.device), lo, scale)
    return x * keep_mask(tuple(x.shape), p, dtype=x.dtype, device=x.device)


def _fused(x: Tensor) -> bool:
    """Whether :func:`dropout` multiplies ``x`` by its mask in the compiled loop."""
    large = x.numel() >= FUSED_MIN_ELEMENTS and x.is_contiguous()  # the product keeps x's layout
    return large and _loop_serves(x)


def _loop_serves(x: Tensor) -> bool:
    """Whether the compiled loop computes ``x * mask`` as torch would: float32 on the CPU, the
    loop built, and denormals not flushed (its threads do not flush them)."""
    on_cpu = x.dtype == torch.float32 and x.device.type == "cpu"
    return on_cpu and native.library() is not None and native.denormals_flushed() is False


class _MaskedProduct(torch.autograd.Function):
    """``x * keep_mask(...)`` with the mask hashed again in the backward pass instead of kept:
    the same values and gradients, one pass each way, and no mask held between them."""

    @staticmethod
    def forward(ctx, x: Tensor, key: Tensor, lo: int, scale: float) -> Tensor:
        ctx.save_for_backward(key)
        ctx.lo, ctx.scale = lo, scale
        return native.dropout_apply(x, key, lo, scale)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None, None]:
        (key,) = ctx.saved_tensors
        if _loop_serves(grad):
            # The gradient of the product is the same product, so this is differentiable again
            # (``create_graph``) and exact at every order.
            return _MaskedProduct.apply(grad, key, ctx.lo, ctx.scale), None, None, None
        mask = hashed_lanes(key, grad.numel()).view(grad.shape).ge(ctx.lo).to(grad.dtype)
        return grad * mask.mul_(ctx.scale), None, None, None


class Dropout(nn.Dropout):
    """``nn.Dropout`` (same ``p``, same checks, no parameters) drawing its mask as :func:`dropout` does.

    Args:
        p (float, optional): the drop probability. (default: :obj:`0.5`)

    Shapes:
        - **input:** any shape
        - **output:** the input's shape
    """

    def forward(self, x: Tensor) -> Tensor:
        """Drop elements of ``x`` in training mode."""
        return dropout(x, self.p, self.training)
