"""Partitioners that assign a graph's nodes to clients, and the split of a graph into partitions."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pymetis
import torch

from retexo_fl.data.edges import coalesced, coalesced_facts, undirected_coalesced
from retexo_fl.data.partition import CROSS_BOTH, CROSS_IN, CROSS_OUT, Partition

PARTITIONERS: dict[str, Callable[..., np.ndarray]] = {}
#: The method a cut along a file of each node's party records (``partition --owners``): the
#: nodes stay where they are, no partitioner places them.
OWNERS_METHOD = "owners"


def _register(name: str):
    def wrap(fn):
        PARTITIONERS[name] = fn
        return fn

    return wrap


def _undirected_csr(edge_index: torch.Tensor, num_nodes: int) -> tuple[np.ndarray, np.ndarray]:
    _, undirected = coalesced_facts(edge_index, num_nodes)
    # A graph that is already symmetric and coalesced (every generated one) is used as it is.
    ei = edge_index if undirected else undirected_coalesced(edge_index, num_nodes)
    counts = torch.bincount(ei[0], minlength=num_nodes)
    xadj = torch.zeros(num_nodes + 1, dtype=torch.long)
    xadj[1:] = torch.cumsum(counts, 0)
    return xadj.numpy(), ei[1].numpy().astype(np.int64, copy=False)


def _metis(edge_index: torch.Tensor, num_nodes: int, nparts: int, seed: int) -> np.ndarray:
    if nparts == 1:
        return np.zeros(num_nodes, dtype=np.int64)
    xadj, adjncy = _undirected_csr(edge_index, num_nodes)
    result = pymetis.part_graph(
        nparts, adjacency=pymetis.CSRAdjacency(xadj, adjncy), options=pymetis.Options(seed=seed)
    )
    return np.asarray(result.vertex_part, dtype=np.int64)


@_register("metis")
def metis(data, nparts: int, seed: int = 0, **_) -> np.ndarray:
    """Min edge-cut balanced parts (METIS k-way).

    Args:
        data (Data): the graph (``edge_index``, ``num_nodes``).
        nparts (int): the number of clients.
        seed (int, optional): METIS's seed. (default: :obj:`0`)
        **_ (optional): other partitioners' options, ignored.

    Returns:
        ``[N]`` int64 owner of each node.
    """
    return _metis(data.edge_index, data.num_nodes, nparts, seed)


@_register("random")
def random(data, nparts: int, seed: int = 0, **_) -> np.ndarray:
    """Uniform random assignment (RandomTMA).

    Args:
        data (Data): the graph (``num_nodes``).
        nparts (int): the number of clients.
        seed (int, optional): the generator's seed. (default: :obj:`0`)
        **_ (optional): other partitioners' options, ignored.

    Returns:
        ``[N]`` int64 owner of each node.
    """
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(nparts, (data.num_nodes,), generator=gen).numpy().astype(np.int64)


@_register("supernode")
def supernode(data, nparts: int, seed: int = 0, clusters: int | None = None, **_) -> np.ndarray:
    """Many small METIS clusters dealt out to clients at random (SuperTMA).

    Args:
        data (Data): the graph (``edge_index``, ``num_nodes``).
        nparts (int): the number of clients.
        seed (int, optional): seed of METIS and of the deal. (default: :obj:`0`)
        clusters (int | None, optional): number of METIS clusters; ``None`` for
            ``max(10 * nparts, N // 50)``, capped at N either way. (default: :obj:`None`)
        **_ (optional): other partitioners' options, ignored.

    Returns:
        ``[N]`` int64 owner of each node.
    """
    n = data.num_nodes
    k = min(n, clusters or max(10 * nparts, n // 50))
    cluster = _metis(data.edge_index, n, k, seed)
    gen = torch.Generator().manual_seed(seed)
    # Deal clusters round-robin after a shuffle so every client gets k / nparts clusters.
    deal = torch.empty(k, dtype=torch.long)
    deal[torch.randperm(k, generator=gen)] = torch.arange(k) % nparts
    return deal.numpy()[cluster]


@_register("louvain")
def louvain(data, nparts: int, seed: int = 0, **_) -> np.ndarray:
    """Louvain communities packed into ``nparts`` balanced parts.

    Communities larger than ``ceil(N / nparts)`` are cut into chunks of that size (so a graph with
    fewer communities than clients still fills every client), then chunks go largest first to the
    currently smallest part.

    Args:
        data (Data): the graph (``edge_index``, ``num_nodes``).
        nparts (int): the number of clients.
        seed (int, optional): the Louvain method's seed. (default: :obj:`0`)
        **_ (optional): other partitioners' options, ignored.

    Returns:
        ``[N]`` int64 owner of each node.
    """
    import networkx as nx  # ~0.3 s to import, and only this partitioner needs it

    xadj, adjncy = _undirected_csr(data.edge_index, data.num_nodes)
    graph = nx.Graph()
    graph.add_nodes_from(range(data.num_nodes))
    src = np.repeat(np.arange(data.num_nodes), np.diff(xadj))
    graph.add_edges_from(zip(src.tolist(), adjncy.tolist(), strict=True))
    communities = nx.community.louvain_communities(graph, seed=seed)
    cap = -(-data.num_nodes // nparts)
    chunks = [sorted(c)[i : i + cap] for c in communities for i in range(0, len(c), cap)]
    communities = sorted(chunks, key=lambda c: (-len(c), c[0]))
    sizes = np.zeros(nparts, dtype=np.int64)
    out = np.empty(data.num_nodes, dtype=np.int64)
    for c in communities:
        target = int(np.argmin(sizes))
        out[c] = target
        sizes[target] += len(c)
    return out


@_register("label-skew")
def label_skew(data, nparts: int, seed: int = 0, alpha: float = 0.5, **_) -> np.ndarray:
    """Label-skewed assignment: each class spread over clients by Dirichlet(``alpha``) shares.

    Unlabeled nodes go to uniform clients. Draws are repeated (up to 100 times, from the same
    seeded stream) until every client owns at least one node, as is usual for Dirichlet splits.

    Args:
        data (Data): the graph (``y``, ``-1`` for unlabeled).
        nparts (int): the number of clients.
        seed (int, optional): the generator's seed. (default: :obj:`0`)
        alpha (float, optional): the Dirichlet concentration; smaller is more skewed.
            (default: :obj:`0.5`)
        **_ (optional): other partitioners' options, ignored.

    Returns:
        ``[N]`` int64 owner of each node (after 100 draws, possibly with an empty client).
    """
    rng = np.random.default_rng(seed)
    y = data.y.view(-1).numpy()
    for _ in range(100):
        out = rng.integers(nparts, size=y.shape[0])  # unlabeled nodes: uniform
        for c in np.unique(y[y >= 0]):
            idx = np.flatnonzero(y == c)
            rng.shuffle(idx)
            shares = rng.dirichlet(np.full(nparts, alpha))
            cuts = (np.cumsum(shares)[:-1] * idx.size).astype(np.int64)
            for p, chunk in enumerate(np.split(idx, cuts)):
                out[chunk] = p
        if np.unique(out).size == nparts:
            break
    return out.astype(np.int64)


@_register("node")
def one_node_per_client(data, nparts: int, seed: int = 0, **_) -> np.ndarray:
    """Node-level decentralization: client i owns node i (``nparts`` must equal N).

    Args:
        data (Data): the graph (``num_nodes``).
        nparts (int): the number of clients, ``N``.
        seed (int, optional): unused. (default: :obj:`0`)
        **_ (optional): other partitioners' options, ignored.

    Returns:
        ``[N]`` int64, ``arange(N)``.

    Raises:
        ValueError: if ``nparts != N``.
    """
    if nparts != data.num_nodes:
        raise ValueError(f"method 'node' needs clients == num_nodes ({data.num_nodes}), got {nparts}")
    return np.arange(data.num_nodes, dtype=np.int64)


def assign_nodes(data, nparts: int, method: str = "metis", seed: int = 0, **options) -> np.ndarray:
    """Assign every node to one of ``nparts`` clients with a named partitioner.

    Args:
        data (Data): the graph.
        nparts (int): the number of clients, at least 1.
        method (str, optional): a key of :data:`PARTITIONERS` (``metis``, ``random``,
            ``supernode``, ``louvain``, ``label-skew``, ``node``). (default: :obj:`"metis"`)
        seed (int, optional): the partitioner's seed. (default: :obj:`0`)
        **options (optional): the partitioner's own options (``clusters``, ``alpha``).

    Returns:
        ``[N]`` int64 owner of each node, every client owning at least one node.

    Raises:
        ValueError: on an unknown method, ``nparts < 1``, or a client left without nodes.
    """
    if method not in PARTITIONERS:
        raise ValueError(f"unknown partition method {method!r}; known: {', '.join(PARTITIONERS)}")
    if nparts < 1:
        raise ValueError(f"clients must be >= 1, got {nparts}")
    owner = PARTITIONERS[method](data, nparts, seed=seed, **options)
    empty = np.setdiff1d(np.arange(nparts), owner)
    if empty.size:
        raise ValueError(
            f"partition method {method!r} left client(s) {empty.tolist()} without nodes; "
            "use fewer clients or another method"
        )
    return owner


def split_graph(data, owner: np.ndarray, nparts: int, *, method: str = "", seed: int = 0) -> list[Partition]:
    """Cut ``data`` into one :class:`Partition` per client along the node assignment ``owner``.

    Self loops are dropped; a graph is directed unless every edge appears both ways.

    Args:
        data (Data): the graph, with ``train/val/test_mask`` set.
        owner (np.ndarray): the client of each node.
        nparts (int): the number of clients.
        method (str, optional): the partitioner's name, recorded in each partition's ``meta``.
            (default: :obj:`""`)
        seed (int, optional): its seed, recorded likewise. (default: :obj:`0`)

    Shapes:
        - **input:** ``owner`` ``[N]`` int64

    Raises:
        ValueError: if the graph has no split masks or ``owner`` is not of shape ``[N]``.
    """
    n = data.num_nodes
    missing = [k for k in ("train_mask", "val_mask", "test_mask") if getattr(data, k, None) is None]
    if missing:
        raise ValueError(
            f"graph has no {', '.join(missing)}: give it a split first (e.g. random:0.6,0.2,0.2)"
        )
    if owner.shape != (n,):
        raise ValueError(f"owner must have one entry per node ({n}), got shape {owner.shape}")
    is_coalesced, undirected = coalesced_facts(data.edge_index, n)
    ei = data.edge_index if is_coalesced else coalesced(data.edge_index, n)
    directed = not (undirected if is_coalesced else coalesced_facts(ei, n)[1])
    src, dst = ei[0].numpy().astype(np.int64, copy=False), ei[1].numpy().astype(np.int64, copy=False)
    # Owners as the narrowest integer that holds them: two per-edge arrays of them are held.
    owner = owner.astype(np.int16 if nparts <= np.iinfo(np.int16).max else np.int64)
    own_src, own_dst = owner[src], owner[dst]
    x, y = data.x.numpy(), data.y.view(-1).numpy()
    name = str(getattr(data, "name", "unknown"))
    num_classes = int(y.max()) + 1
    masks = {k: data[k].numpy() for k in ("train_mask", "val_mask", "test_mask")}
    cut = own_src != own_dst
    cut_src, cut_dst = src[cut], dst[cut]
    cut_os, cut_od = own_src[cut], own_dst[cut]
    # A user's graph read from files names its nodes and classes: each party keeps its own
    # nodes' names beside node_ids.npy, row for row, and the classes' (the model's outputs).
    names = getattr(data, "node_names", None)
    classes = getattr(data, "class_names", None)

    parts = []
    for p in range(nparts):
        ids = np.flatnonzero(owner == p).astype(np.int64)
        local = (own_src == p) & (own_dst == p)
        # Incoming cross edges (remote src -> owned dst) and outgoing ones (owned src -> remote dst).
        inc = np.stack([cut_dst[cut_od == p], cut_src[cut_od == p], cut_os[cut_od == p]], 1)
        out = np.stack([cut_src[cut_os == p], cut_dst[cut_os == p], cut_od[cut_os == p]], 1)
        if directed:
            rows = np.concatenate([inc, out])
            flags = np.concatenate([np.full(len(inc), CROSS_IN), np.full(len(out), CROSS_OUT)])
            uniq, inv = np.unique(rows, axis=0, return_inverse=True)
            dirs = np.zeros(len(uniq), dtype=np.int64)
            np.bitwise_or.at(dirs, inv.reshape(-1), flags)
            cross = np.concatenate([uniq, dirs[:, None]], 1) if len(uniq) else np.zeros((0, 4), np.int64)
        else:
            cross = np.concatenate([inc, np.full((len(inc), 1), CROSS_BOTH)], 1)
            cross = cross[np.lexsort((cross[:, 1], cross[:, 0]))] if len(cross) else cross
        parts.append(
            Partition(
                partition_id=p,
                num_partitions=nparts,
                num_global_nodes=n,
                num_classes=num_classes,
                node_ids=ids,
                x=x[ids],
                y=y[ids],
                train_mask=masks["train_mask"][ids],
                val_mask=masks["val_mask"][ids],
                test_mask=masks["test_mask"][ids],
                edges=np.stack([src[local], dst[local]]).astype(np.int64),
                cross_edges=cross.astype(np.int64).reshape(-1, 4),
                dataset=name,
                directed=directed,
                meta={
                    "method": method,
                    "seed": seed,
                    **({"node_names": [names[i] for i in ids]} if names is not None else {}),
                    **({"class_names": list(classes)} if classes is not None else {}),
                },
            )
        )
    return parts


def partition_graph(data, nparts: int, method: str = "metis", seed: int = 0, **options) -> list[Partition]:
    """Assign nodes with ``method`` and split ``data`` into ``nparts`` partitions.

    Args:
        data (Data): the graph, with ``train/val/test_mask`` set.
        nparts (int): the number of clients.
        method (str, optional): the partitioner (see :func:`assign_nodes`).
            (default: :obj:`"metis"`)
        seed (int, optional): the partitioner's seed. (default: :obj:`0`)
        **options (optional): the partitioner's own options.

    Raises:
        ValueError: as :func:`assign_nodes` and :func:`split_graph` do.
    """
    owner = assign_nodes(data, nparts, method, seed, **options)
    return split_graph(data, owner, nparts, method=method, seed=seed)
