"""The data section of a run configuration: which graph, how it is split and cut into partitions.

A leaf of the package graph (no torch, no :mod:`retexo_fl.config`): :class:`~retexo_fl.config.TrainConfig`
imports it to build and validate its ``data`` section.
"""

from __future__ import annotations

from retexo_fl.setting import check_choices, section, setting

#: The settings a run reads only when it cuts the dataset itself: a folder of partitions
#: (``--partitions``) holds the graph, its split and its cut already.
_CUT = "partitions="


@section
class DataSettings:
    r"""Which graph a run trains on, its split, and its partitions (one per client).

    The ``data`` section of :class:`~retexo_fl.config.TrainConfig`.
    """

    dataset: str = setting(
        "Cora",
        "a PyG dataset name, sbm:N,C[,deg,homophily], the path of a saved Data file or an npz graph, "
        "or files:edges=E.csv,features=F,labels=L.csv[,id-column=C][,label-column=C] (docs/cli.md)",
        needs=_CUT,
    )
    data_root: str = setting(
        "data", "folder with the dataset's raw/ files (PyG downloads there if it can)", needs=_CUT
    )
    split: str = setting("public", "public, random:TRAIN,VAL,TEST or per-class:K,VAL,TEST", needs=_CUT)
    split_index: int = setting(0, "which of a dataset's fixed public splits (WebKB, Actor: 0-9)", needs=_CUT)
    clients: int = setting(4, "the number of clients, one partition each")
    # Read with --partitions too: method node picks the node-level defaults.
    method: str = setting("metis", "the partitioner: metis, louvain, random, supernode, label-skew or node")
    partitions: str = setting(
        "",
        "a folder of part-<id>/ partitions written by `retexo-fl partition`, used instead of cutting dataset",
    )

    def validate(self) -> DataSettings:
        """Raise :class:`ValueError` naming the first bad setting; return ``self`` otherwise."""
        check_choices(self)
        if self.split_index < 0:
            raise ValueError(f"split-index must be >= 0, got {self.split_index}")
        if self.clients < 1:
            raise ValueError(f"clients must be >= 1, got {self.clients}")
        return self
