"""Load the graph a run configuration names (dataset, root, split) as one PyG ``Data``."""

from __future__ import annotations

from typing import Protocol

from torch_geometric.data import Data

from retexo_fl.data.datasets import load_dataset


class GraphSource(Protocol):
    """What :func:`load_graph` reads from a run configuration; :class:`~retexo_fl.config.TrainConfig`
    is one (so this package never imports the configuration module)."""

    dataset: str
    data_root: str
    split: str
    split_index: int
    seed: int


def load_graph(cfg: GraphSource) -> Data:
    r"""The whole graph of a run, with its ``train/val/test_mask`` split applied.

    Args:
        cfg (GraphSource): the run configuration (``dataset``, ``data_root``, ``split``,
            ``split_index``, and ``seed`` for random splits and synthetic graphs).

    Returns:
        ``Data`` with ``x`` ``[N, F]`` (float32), ``y`` ``[N]`` (int64, ``-1`` unlabeled),
        ``edge_index`` ``[2, E]`` and boolean ``train_mask``, ``val_mask``, ``test_mask`` ``[N]``.
    """
    return load_dataset(
        cfg.dataset, cfg.data_root, split=cfg.split, seed=cfg.seed, split_index=cfg.split_index
    )
