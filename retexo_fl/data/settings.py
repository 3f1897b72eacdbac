"""The data section of a run configuration: which graph, how it is split and cut into partitions.

A leaf of the package graph (no torch, no :mod:`retexo_fl.config`): :class:`~retexo_fl.config.TrainConfig`
imports it to build and validate its ``data`` section.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DataSettings:
    r"""Which graph a run trains on, its split, and its partitions (one per client).

    The ``data`` section of :class:`~retexo_fl.config.TrainConfig`.

    Args:
        dataset (str, optional): a PyG dataset name, ``"sbm:N,C[,deg,homophily]"``, or the path of a
            saved ``Data`` file. (default: :obj:`"Cora"`)
        data_root (str, optional): folder with the dataset's ``raw/`` files. (default: :obj:`"data"`)
        split (str, optional): ``"public"``, ``"random:TRAIN,VAL,TEST"`` or
            ``"per-class:K,VAL,TEST"``. (default: :obj:`"public"`)
        split_index (int, optional): which of a dataset's several public splits. (default: :obj:`0`)
        clients (int, optional): the number of clients, one partition each. (default: :obj:`4`)
        method (str, optional): the partitioner, e.g. ``"metis"``, ``"louvain"``, ``"random"``.
            (default: :obj:`"metis"`)
        partitions (str, optional): a folder of ``part-<id>/`` partitions written by
            ``retexo-fl partition``, used instead of cutting ``dataset``. (default: :obj:`""`)
    """

    dataset: str = "Cora"
    data_root: str = "data"
    split: str = "public"
    split_index: int = 0
    clients: int = 4
    method: str = "metis"
    partitions: str = ""

    def validate(self) -> DataSettings:
        """Raise :class:`ValueError` naming the first bad setting; return ``self`` otherwise."""
        if self.clients < 1:
            raise ValueError(f"clients must be >= 1, got {self.clients}")
        return self
