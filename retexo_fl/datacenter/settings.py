"""The data-center section of a run configuration, and what data-center mode reads from a run.

This module is a leaf of the package graph (no torch, no :mod:`retexo_fl.config`):
:class:`~retexo_fl.config.TrainConfig` imports it to build and validate its ``datacenter``
section, and the rest of :mod:`retexo_fl.datacenter` takes any :class:`DatacenterConfig`, which
:class:`~retexo_fl.config.TrainConfig` is, so the package never imports the configuration module.
"""

from __future__ import annotations

from typing import Any, Literal, Protocol, get_args

from retexo_fl.setting import check_choices, section, setting

Algorithm = Literal["1d", "1.5d", "2d", "3d"]
#: The CAGNET products data-center mode can run.
ALGORITHMS: tuple[str, ...] = get_args(Algorithm)


def check_procs(algorithm: str, procs: int, replication: int = 2) -> None:
    """Raise a clear error where ``procs`` cannot form ``algorithm``'s process grid.

    Args:
        algorithm (str): one of :obj:`ALGORITHMS`.
        procs (int): the process count.
        replication (int, optional): 1.5d's replication factor ``c``. (default: :obj:`2`)
    """
    if algorithm == "1.5d" and (replication < 1 or procs % replication):
        raise ValueError(f"1.5d: the replication factor {replication} must divide the process count {procs}")
    dims = {"2d": 2, "3d": 3}.get(algorithm)
    if dims:
        q = round(procs ** (1.0 / dims))
        if q**dims != procs:
            kind = "a square (4, 9, 16, ...)" if dims == 2 else "a cube (8, 27, ...)"
            raise ValueError(f"{algorithm} needs a process count that is {kind}; got {procs}")


@section
class DatacenterSettings:
    r"""Data-center mode: CAGNET full-graph training on :mod:`torch.distributed` (trusted clusters only).

    The ``datacenter`` section of :class:`~retexo_fl.config.TrainConfig`.
    """

    algorithm: Algorithm = setting(
        "1d",
        "the data-center product: 1d, 1.5d, 2d (procs a square) or 3d (procs a cube)",
        modes=("datacenter",),
    )
    procs: int = setting(
        4, "data-center processes started on this host (torchrun sets its own)", modes=("datacenter",)
    )
    replication: int = setting(2, "1.5d's replication factor c, a divisor of procs", modes=("datacenter",))
    trusted_cluster: bool = setting(
        False,
        "let data-center mode pool partitions whose manifests mark them residency-bound",
        modes=("datacenter",),
    )

    def validate(self, grid: bool = True) -> DatacenterSettings:
        """Raise :class:`ValueError` naming the first bad setting; return ``self`` otherwise.

        Args:
            grid (bool, optional): also check that ``procs`` forms ``algorithm``'s process grid
                (only a data-center run needs one). (default: :obj:`True`)
        """
        check_choices(self)
        if self.procs < 1:
            raise ValueError(f"procs must be >= 1, got {self.procs}")
        if grid:
            check_procs(self.algorithm, self.procs, self.replication)
        return self


class DatacenterConfig(Protocol):
    """What data-center mode reads from a run configuration; :class:`~retexo_fl.config.TrainConfig`
    is one.

    The dataset fields are those :func:`~retexo_fl.data.loading.load_graph` reads; the model and
    optimizer fields give the centralized reference's GCN and schedule, so the two compare.
    """

    dataset: str
    data_root: str
    split: str
    split_index: int
    partitions: str
    seed: int
    device: str
    hidden: int
    central_layers: int
    server_optimizer: str | list[str]
    weight_decay: float | list[float]

    @property
    def datacenter(self) -> DatacenterSettings:
        """The run's data-center section."""
        ...

    def per_stage(self, name: str, stage: int) -> Any:
        """The value of a per-stage setting for ``stage``."""
        ...
