"""Deterministic seeds shared by every engine and process (and the devices they run on)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

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


class _Streams(threading.local):
    """Each thread's dropout generator while a :func:`dropout_stream` block runs (else none)."""

    generator: torch.Generator | None = None


_STREAMS = _Streams()


@contextlib.contextmanager
def dropout_stream(seed: int, device: torch.device) -> Iterator[torch.Generator]:
    """Draw this thread's dropout masks from a generator of their own, seeded with ``seed``.

    Not torch's global generator: two runs a node worker answers side by side each train on a
    thread of their own, and masks drawn from one shared stream made each run's masks depend on
    when the other drew. The stream is the one the global generator gives after
    ``manual_seed(seed)`` (the same algorithm, seeded alike), so a run alone trains as it did.

    Args:
        seed (int): the seed, e.g. from :func:`derive_seed`.
        device (torch.device): where the masks are drawn (the model's device).

    Yields:
        torch.Generator: the generator, for a step that replays its masks (its state).
    """
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    outer, _STREAMS.generator = _STREAMS.generator, generator
    try:
        yield generator
    finally:
        _STREAMS.generator = outer


def dropout_generator(device: torch.device) -> torch.Generator:
    """The generator dropout masks on ``device`` come from: the thread's :func:`dropout_stream`
    when one runs on that device, else torch's default generator of the device."""
    generator = _STREAMS.generator
    if generator is not None and generator.device.type == device.type:
        return generator
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return torch.cuda.default_generators[index]
    return torch.random.default_generator


#: ``--device auto`` puts a party on the GPU only from this many nodes in its partition up. Below
#: it, a step is a few small kernels whose launches cost more than the CPU's arithmetic: on an
#: NVIDIA H200 host (16 cores), a 2-stage lazy run of one client took 0.32 s on the GPU against
#: 0.27 s on the CPU at 2,000 nodes, and 0.35 s against 0.55 s at 8,000 (``bench/gpu.py``,
#: section crossover); Cora's 10 random partitions (270 nodes each) ran 1.6x slower on the GPU.
AUTO_GPU_MIN_NODES = 4096


def resolve_device(name: str, nodes: int | None = None) -> torch.device:
    """The torch device a ``device`` setting names.

    ``auto`` is CUDA when there is a CUDA device and the partition is large enough for it to be
    the faster one (``nodes`` at least :data:`AUTO_GPU_MIN_NODES`, or ``nodes`` not given), else
    the CPU. :func:`device_choice` says which and why.

    Args:
        name (str): ``auto``, ``cpu``, ``cuda`` or ``cuda:N``.
        nodes (int, optional): the nodes of the partition the device will hold, for ``auto``.
            (default: :obj:`None`)

    Raises:
        ValueError: a name torch does not know, or a CUDA device this machine does not have
            (said here, not at the first tensor moved there).
    """
    return device_choice(name, nodes)[0]


def device_choice(name: str, nodes: int | None = None) -> tuple[torch.device, str]:
    """:func:`resolve_device`'s device and a line saying why it was chosen.

    Args:
        name (str): ``auto``, ``cpu``, ``cuda`` or ``cuda:N``.
        nodes (int, optional): the nodes of the partition the device will hold, for ``auto``.
            (default: :obj:`None`)

    Returns:
        tuple[torch.device, str]: the device, and the reason, e.g. ``"auto: cpu, as 270 nodes
        are under the 4096 from which the GPU is faster (--device cuda to use it)"``.
    """
    if name == "auto":
        if not torch.cuda.is_available():
            return torch.device("cpu"), "auto: cpu, as torch sees no CUDA device"
        if nodes is not None and nodes < AUTO_GPU_MIN_NODES:
            return torch.device("cpu"), (
                f"auto: cpu, as {nodes} nodes are under the {AUTO_GPU_MIN_NODES} from which "
                "the GPU is faster (--device cuda to use it)"
            )
        return torch.device("cuda"), f"auto: cuda ({torch.cuda.get_device_name(0)})"
    return check_device_name(name), f"{name}: as set"


def check_device_name(name: str) -> torch.device:
    """The device ``name`` names, checked without using it: no CUDA context is made (the process
    that checks a run's settings, a simulation's driver or a data-center run's parent, may not
    be one that computes, and a context holds seconds and GPU memory). ``auto`` is the CPU here.

    Args:
        name (str): ``auto``, ``cpu``, ``cuda`` or ``cuda:N``.

    Raises:
        ValueError: a name torch does not know, or a CUDA device this machine does not have.
    """
    if name == "auto":
        return torch.device("cpu")
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
