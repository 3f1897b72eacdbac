"""Deterministic seeds shared by every engine and process (and the devices they run on)."""

from __future__ import annotations

import torch


def derive_seed(*parts: int) -> int:
    """A 63-bit seed from integers (FNV-1a over their low 48 bits), identical in every process.

    Args:
        *parts (int): the integers naming what is seeded: run seed, stage, round, client, a tag.

    Returns:
        int: a seed in ``[0, 2**63)``.
    """
    h = 1469598103934665603
    for p in parts:
        h = ((h ^ (int(p) & 0xFFFFFFFFFFFF)) * 1099511628211) % (1 << 63)
    return h


def seed_dropout(seed: int, device: torch.device) -> None:
    """Seed the generator ``device`` draws dropout masks from.

    ``torch.manual_seed`` would also queue the seed for every accelerator not yet initialised,
    formatting a stack trace for each: about a millisecond a call, paid by every client every
    round. The CPU stream it leaves is the same.

    Args:
        seed (int): the seed, e.g. from :func:`derive_seed`.
        device (torch.device): where the model runs; CUDA devices are seeded too.
    """
    torch.random.default_generator.manual_seed(seed)
    if device.type == "cuda":
        torch.cuda.manual_seed_all(seed)


def resolve_device(name: str) -> torch.device:
    """The torch device a ``device`` setting names (``auto``: CUDA when there is one, else CPU).

    Args:
        name (str): ``auto``, ``cpu``, ``cuda`` or ``cuda:N``.

    Raises:
        ValueError: a name torch does not know, or a CUDA device this machine does not have
            (said here, not at the first tensor moved there).
    """
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as err:
        raise ValueError(f"device {name!r}: not a device name (auto, cpu, cuda or cuda:N)") from err
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ValueError(
                f"device {name!r}: torch {torch.__version__} sees no CUDA device on this machine; "
                "use --device auto or cpu"
            )
        if device.index is not None and device.index >= count:
            raise ValueError(f"device {name!r}: this machine has {count} CUDA device(s), from cuda:0")
    return device
