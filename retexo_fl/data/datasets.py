"""Dataset registry: PyG datasets by name, a user's saved ``Data`` file, synthetic SBM graphs, splits."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import torch
import torch_geometric.datasets as pygd
from torch_geometric.data import Data

from retexo_fl.data.edges import undirected_coalesced
from retexo_fl.data.errors import DatasetError
from retexo_fl.data.files import (
    MAX_CLASSES,
    FileGraphError,
    load_files_graph,
    load_heterophilous_npz,
)

_FAMILIES: dict[str, tuple[str, tuple[str, ...]]] = {
    # class name -> names it serves (lower case)
    "Planetoid": ("Planetoid", ("cora", "citeseer", "pubmed")),
    "Amazon": ("Amazon", ("computers", "photo")),
    "Coauthor": ("Coauthor", ("cs", "physics")),
    "CitationFull": ("CitationFull", ("cora_ml", "dblp", "cora-full")),
    "WebKB": ("WebKB", ("cornell", "texas", "wisconsin")),
    "Airports": ("Airports", ("usa", "brazil", "europe")),
    "HeterophilousGraphDataset": (
        "HeterophilousGraphDataset",
        ("roman-empire", "amazon-ratings", "minesweeper", "tolokers", "questions"),
    ),
}
_SINGLE = {"wikics": "WikiCS", "actor": "Actor", "flickr": "Flickr", "reddit": "Reddit"}
_SPELLING = {"citeseer": "CiteSeer", "pubmed": "PubMed", "cora": "Cora", "cs": "CS"}


def known_datasets() -> list[str]:
    """The dataset names :func:`load_dataset` knows, sorted (besides saved ``Data`` files)."""
    names = [n for _, (_, ns) in _FAMILIES.items() for n in ns]
    return sorted(
        [
            *names,
            *_SINGLE,
            "ogbn-arxiv",
            "ogbn-products",
            "sbm:N,C[,deg,homophily]",
            "files:edges=...,features=...,labels=...",
            "PATH.npz",
        ]
    )


def load_dataset(
    name: str,
    root: str | Path = "data",
    *,
    split: str = "public",
    seed: int = 0,
    split_index: int = 0,
):
    """Load a graph as a ``torch_geometric.data.Data`` with ``train/val/test_mask`` set.

    Args:
        name (str): a PyG dataset name (``Cora``, ``CiteSeer``, ``Computers``, ``CS``, ``WikiCS``,
            ``ogbn-arxiv`` ...), ``sbm:N,C[,avg_degree,homophily]`` for a synthetic graph, the
            path of a ``torch.save``-d ``Data`` object, ``files:edges=E.csv,features=F,labels=L.csv``
            for a graph as plain files, or an npz in ``HeterophilousGraphDataset``'s format
            (:mod:`retexo_fl.data.files`).
        root (str | Path, optional): folder holding PyG's ``raw/`` files; PyG downloads into it
            where the network allows. (default: :obj:`"data"`)
        split (str, optional): ``public`` (the dataset's own split), ``random:TRAIN,VAL,TEST``
            fractions, or ``per-class:K,VAL,TEST`` (K training nodes per class, VAL and TEST node
            counts). (default: :obj:`"public"`)
        seed (int, optional): seed for random splits and synthetic graphs. (default: :obj:`0`)
        split_index (int, optional): which column to use where a dataset ships several splits
            (``[N, S]`` masks). (default: :obj:`0`)

    Shapes:
        - **output:** ``x`` ``[N, F]``, ``y`` ``[N]``, ``edge_index`` ``[2, E]``, masks ``[N]``

    Returns:
        ``Data`` with ``x`` (float32), ``y`` (int64, ``-1`` for unlabeled), ``edge_index``,
        boolean ``train_mask``, ``val_mask``, ``test_mask`` (labeled nodes only) and ``name``.

    Raises:
        DatasetError: on an unknown name, an unreadable file, a bad split, ``public`` for a
            graph without split masks, a graph without a labelled node, or a split that leaves
            its training set (or a set it gives a share) empty.
    """
    data = _load_raw(name, Path(root), seed)
    data.x = data.x.float()
    data.y = data.y.view(-1).long()
    suffix = Path(name).suffix.lower()
    if suffix in (".pt", ".pth"):
        data.name = Path(name).stem
    elif not name.startswith("files:") and suffix != ".npz":
        data.name = name
    if not bool((data.y >= 0).any()):
        raise DatasetError(f"{name}: no node is labelled (every label is -1 or empty)")
    if split == "public":
        if getattr(data, "train_mask", None) is None:
            raise DatasetError(
                f"dataset {name!r} has no split masks of its own: pass a split such as "
                "'random:0.6,0.2,0.2' or 'per-class:20,500,1000'"
            )
        absent = [key for key in ("train_mask", "val_mask", "test_mask") if getattr(data, key, None) is None]
        if absent:  # a saved Data or an npz may carry some masks and not others
            raise DatasetError(
                f"{name}: split 'public' needs train, validation and test masks, and it has no "
                f"{', '.join(absent)}: pass a split such as 'random:0.6,0.2,0.2'"
            )
        for key in ("train_mask", "val_mask", "test_mask"):
            mask = data[key]
            if mask.dim() == 2:
                if not 0 <= split_index < mask.size(1):
                    raise DatasetError(f"{name}: split_index {split_index} not in [0, {mask.size(1)})")
                mask = mask[:, split_index]
            data[key] = mask.bool() & (data.y >= 0)
        for a, b in (("train_mask", "val_mask"), ("train_mask", "test_mask"), ("val_mask", "test_mask")):
            both = int((data[a] & data[b]).sum())
            if both:  # a node trained on and validated or tested on: every figure would be inflated
                raise DatasetError(
                    f"{name}: its {a} and {b} overlap on {both} node(s) (split index {split_index}); "
                    "give disjoint masks, or pass a split such as 'random:0.6,0.2,0.2'"
                )
    else:
        try:
            apply_split(data, split, seed)
        except DatasetError as exc:
            raise DatasetError(f"{name}: {exc}") from None
    if not bool(data.train_mask.any()):
        raise DatasetError(f"{name}: split {split!r} leaves no labelled training node")
    return data


def _load_raw(name: str, root: Path, seed: int):
    try:
        return _load_any(name, root, seed)
    except OSError as exc:
        own = name.startswith("files:") or Path(name).suffix.lower() in (".npz", ".pt", ".pth")
        if own or Path(name).is_file():
            # A user's own file: name it, not a download.
            raise DatasetError(f"{exc.filename or name}: cannot be read ({exc.strerror or exc})") from exc
        # PyG's download without a network, or a raw file it cannot read
        raise DatasetError(
            f"{name}: cannot be read or downloaded under --data-root {root} ({exc}); without "
            f"internet, copy its raw files there first{_raw_folder_hint(name, root)}"
        ) from exc


def _raw_folder_hint(name: str, root: Path) -> str:
    """Where PyG reads a Planetoid graph's raw files under ``root`` (a copy one level off, in
    ``root/Cora/raw``, is the usual miss), as a clause of the error; empty for other graphs."""
    key = name.lower()
    if key not in _FAMILIES["Planetoid"][1]:
        return ""
    return f" (PyG reads them from {root / 'Planetoid' / _SPELLING.get(key, name) / 'raw'})"


def _load_any(name: str, root: Path, seed: int):
    if name.startswith("files:"):
        return load_files_graph(name[len("files:") :])
    path = Path(name).expanduser()
    if path.suffix.lower() == ".npz":
        if path.is_dir():
            raise FileGraphError(path, "is a folder; --dataset PATH.npz takes an npz file")
        if not path.is_file():
            raise FileGraphError(path, "no such file")
        return load_heterophilous_npz(path)
    if path.suffix.lower() in (".pt", ".pth") or path.is_file():
        return _load_user_graph(path)
    key = name.lower()
    if key.startswith("sbm:"):
        return synthetic_sbm_from_spec(key[4:], seed)
    if key.startswith("ogbn-"):
        try:  # ogb is an optional extra (retexo-fl[ogb]): only OGB datasets import it
            from ogb.nodeproppred import PygNodePropPredDataset
        except ImportError as exc:
            raise DatasetError(f"{name} needs the optional 'ogb' package: pip install ogb") from exc
        ds = PygNodePropPredDataset(name=key, root=str(root))
        data = ds[0]
        idx = ds.get_idx_split()
        n = data.num_nodes
        for split, field in (("train", "train_mask"), ("valid", "val_mask"), ("test", "test_mask")):
            mask = torch.zeros(n, dtype=torch.bool)
            mask[idx[split]] = True
            data[field] = mask
        return data
    for cls_name, names in _FAMILIES.values():
        if key in names:
            cls: Callable = getattr(pygd, cls_name)
            spelled = _SPELLING.get(key, name)
            if cls_name == "Planetoid":
                return cls(root=str(root / "Planetoid"), name=spelled)[0]
            if cls_name == "HeterophilousGraphDataset":
                return cls(root=str(root / cls_name), name=key)[0]
            return cls(root=str(root / cls_name), name=spelled)[0]
    if key in _SINGLE:
        cls = getattr(pygd, _SINGLE[key])
        return cls(root=str(root / _SINGLE[key]))[0]
    forms = "files:edges=E.csv,features=F,labels=L.csv for a graph in plain files, or PATH.npz / PATH.pt"
    if path.is_dir():
        raise DatasetError(f"--dataset {name!r} is a folder, not a dataset name: give {forms}")
    if path.suffix.lower() in (".csv", ".tsv", ".txt", ".json") or len(path.parts) > 1:
        raise DatasetError(
            f"--dataset {name!r}: no such file, and not a dataset name; a graph's files go as {forms}"
        )
    raise DatasetError(f"unknown dataset {name!r}; known: {', '.join(known_datasets())}")


def _data_globals() -> list:
    """The classes a saved ``Data`` is made of, which a ``weights_only`` load may build."""
    from torch_geometric.data.data import DataEdgeAttr, DataTensorAttr
    from torch_geometric.data.storage import GlobalStorage

    return [Data, DataEdgeAttr, DataTensorAttr, GlobalStorage]


def _load_user_graph(path: Path):
    if not path.is_file():
        raise DatasetError(f"{path}: no such file")
    if Path(path).suffix.lower() in (".csv", ".tsv", ".txt", ".json"):  # one of a graph's files
        raise DatasetError(
            f"{path}: a text file is not a graph on its own; give a graph's plain files as "
            "files:edges=E.csv,features=F,labels=L.csv (docs/cli.md)"
        )
    try:
        # weights_only: a pickle builds what it names, so a file that names anything else could
        # run code; the path may come from a run config, which a server writes.
        with torch.serialization.safe_globals(_data_globals()):
            obj = torch.load(path, weights_only=True, map_location="cpu")
    except Exception as exc:  # any unpickling failure is a bad file
        if "Unsupported global" in str(exc) or "weights_only" in str(exc).lower():
            raise DatasetError(
                f"{path}: refused: it holds more than a torch_geometric Data of tensors, and loading "
                "it could run code; save Data(x=..., edge_index=..., y=...) of tensors, or the graph "
                "as an npz or plain files"
            ) from None
        raise DatasetError(f"{path}: cannot be read as a saved torch_geometric Data ({exc})") from exc
    if not isinstance(obj, Data):
        raise DatasetError(f"{path}: holds a {type(obj).__name__}, expected torch_geometric Data")
    for key in ("x", "y", "edge_index"):
        if getattr(obj, key, None) is None:
            raise DatasetError(f"{path}: field '{key}' is missing")
    if obj.edge_index.dim() != 2 or obj.edge_index.size(0) != 2:
        raise DatasetError(f"{path}: field 'edge_index' must have shape [2, E]")
    x, y, ei = obj.x, obj.y, obj.edge_index
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise DatasetError(f"{path}: field 'x' must be a [N, F] tensor, got {_shape(x)}")
    if x.layout != torch.strided:
        raise DatasetError(f"{path}: field 'x' must be a dense tensor, got {x.layout} (use x.to_dense())")
    if not isinstance(y, torch.Tensor) or y.view(-1).size(0) != x.size(0):
        raise DatasetError(f"{path}: field 'y' has {_shape(y)} labels for {x.size(0)} nodes")
    if not isinstance(ei, torch.Tensor) or ei.dim() != 2 or ei.size(0) != 2:
        raise DatasetError(f"{path}: field 'edge_index' must have shape [2, E]")
    if ei.is_floating_point() or ei.dtype == torch.bool or ei.is_complex():
        raise DatasetError(f"{path}: field 'edge_index' must hold integer node ids, got {ei.dtype}")
    if ei.numel() and (int(ei.min()) < 0 or int(ei.max()) >= x.size(0)):
        raise DatasetError(
            f"{path}: field 'edge_index' names node {int(ei.min()) if int(ei.min()) < 0 else int(ei.max())}, "
            f"outside 0..{x.size(0) - 1}"
        )
    if x.is_complex() or (x.is_floating_point() and not bool(torch.isfinite(x).all())):
        raise DatasetError(f"{path}: field 'x' holds a value that is not a finite real number")
    if y.is_floating_point() and not bool((y == y.round()).all()):
        raise DatasetError(f"{path}: field 'y' must hold integer class indices, got a fraction")
    if y.numel() and (float(y.min()) < -1 or float(y.max()) >= MAX_CLASSES):
        raise DatasetError(
            f"{path}: field 'y' must hold class indices in -1..{MAX_CLASSES - 1} (-1: unlabeled)"
        )
    return obj


def _shape(value: object) -> str:
    return str(list(value.shape)) if isinstance(value, torch.Tensor) else type(value).__name__


_SPLIT_RE = re.compile(r"^(random|per-class):([0-9.,]+)$")


def check_split(spec: str) -> None:
    """Raise :class:`DatasetError` unless ``spec`` is ``public`` or a split form
    :func:`apply_split` takes (checked before a run writes anything)."""
    if spec == "public":
        return
    m = _SPLIT_RE.match(spec.replace(" ", ""))
    parts = m.group(2).split(",") if m else []
    try:
        [float(v) for v in parts]
    except ValueError:
        parts = []
    if len(parts) != 3:
        raise DatasetError(f"bad split {spec!r}: use public, random:TRAIN,VAL,TEST or per-class:K,VAL,TEST")
    nums = [float(v) for v in parts]
    if m and m.group(1) == "per-class" and not all(v == int(v) for v in nums):
        raise DatasetError(f"bad split {spec!r}: per-class:K,VAL,TEST takes whole numbers of nodes")
    if nums[1] <= 0:
        # Rounds, stages and early stopping are chosen on validation nodes: without any, every
        # stage read a validation accuracy of 0 and kept its first round.
        raise DatasetError(
            f"bad split {spec!r}: VAL is 0; a run chooses its rounds and stages on validation nodes"
        )


def split_without_test(spec: str) -> bool:
    """Whether split ``spec`` gives the test set no share (``random:0.6,0.4,0``): a run over it
    has no test accuracy to report."""
    m = _SPLIT_RE.match(spec.replace(" ", ""))
    return bool(m) and float(m.group(2).split(",")[2]) == 0


def apply_split(data, spec: str, seed: int) -> None:
    """Set ``train/val/test_mask`` on ``data`` from a split spec, seeded; unlabeled nodes stay out.

    ``random:a,b,c``: fractions of the labeled nodes. ``per-class:k,v,t``: ``k`` training nodes
    per class, then ``v`` validation and ``t`` test nodes drawn from the rest.

    Args:
        data (Data): the graph; its ``y`` (``-1`` for unlabeled) is read, its masks replaced.
        spec (str): ``random:TRAIN,VAL,TEST`` or ``per-class:K,VAL,TEST``.
        seed (int): the shuffle's seed.

    Shapes:
        - **input:** ``data.y`` ``[N]``
        - **output:** ``data.train_mask``, ``data.val_mask``, ``data.test_mask`` ``[N]`` bool

    Raises:
        DatasetError: on another form, not three numbers, fractions that are negative or sum to
            more than 1, or a set given a share (or K) that gets no labelled node.
    """
    check_split(spec)
    m = _SPLIT_RE.match(spec.replace(" ", ""))
    if not m:  # "public": the dataset's own masks, nothing to draw
        raise DatasetError(f"bad split {spec!r}: use random:TRAIN,VAL,TEST or per-class:K,VAL,TEST")
    kind, nums = m.group(1), [float(v) for v in m.group(2).split(",")]
    y = data.y.view(-1)
    n = y.size(0)
    gen = torch.Generator().manual_seed(seed)
    labeled = torch.nonzero(y >= 0).view(-1)
    labeled = labeled[torch.randperm(labeled.numel(), generator=gen)]
    masks = [torch.zeros(n, dtype=torch.bool) for _ in range(3)]
    if kind == "random":
        if any(v < 0 for v in nums) or sum(nums) > 1 + 1e-9:
            raise DatasetError(f"bad split {spec!r}: fractions must be >= 0 and sum to <= 1")
        sizes = [round(v * labeled.numel()) for v in nums]
        sizes[2] = min(sizes[2], labeled.numel() - sizes[0] - sizes[1])
        start = 0
        for mask, size in zip(masks, sizes, strict=True):
            mask[labeled[start : start + size]] = True
            start += size
    else:
        k, nval, ntest = (int(v) for v in nums)
        chosen = []
        for c in torch.unique(y[labeled]).tolist():
            chosen.append(labeled[y[labeled] == c][:k])
        train = torch.cat(chosen)
        masks[0][train] = True
        rest = labeled[~masks[0][labeled]]
        masks[1][rest[:nval]] = True
        masks[2][rest[nval : nval + ntest]] = True
    for name, share, mask in zip(("training", "validation", "test"), nums, masks, strict=True):
        if share > 0 and not bool(mask.any()):  # asked for, and rounded away: accuracy would read 0
            raise DatasetError(
                f"split {spec!r} over {labeled.numel()} labelled nodes leaves the {name} set empty"
            )
    data.train_mask, data.val_mask, data.test_mask = masks


def synthetic_sbm_from_spec(spec: str, seed: int):
    """A synthetic graph (:func:`synthetic_sbm`) from a spec, with a ``random:0.6,0.2,0.2`` split.

    The spec is what follows ``sbm:`` in a dataset name such as ``sbm:100000,10,40,0.8``.

    Args:
        spec (str): ``N,C[,avg_degree,homophily]``; the average degree defaults to 10, the
            homophily to 0.8.
        seed (int): seed of the graph and its split.

    Raises:
        DatasetError: on a malformed spec.
    """
    parts = [p for p in spec.split(",") if p]
    if not 2 <= len(parts) <= 4:
        raise DatasetError(f"bad synthetic spec {spec!r}: use sbm:N,C[,avg_degree,homophily]")
    try:
        n, c = int(parts[0]), int(parts[1])
        deg = float(parts[2]) if len(parts) > 2 else 10.0
        hom = float(parts[3]) if len(parts) > 3 else 0.8
    except ValueError as exc:
        raise DatasetError(f"bad synthetic spec {spec!r}: {exc}") from exc
    data = synthetic_sbm(n, c, avg_degree=deg, homophily=hom, seed=seed)
    apply_split(data, "random:0.6,0.2,0.2", seed)
    return data


def synthetic_sbm(
    num_nodes: int,
    num_classes: int,
    *,
    avg_degree: float = 10.0,
    homophily: float = 0.8,
    num_features: int = 64,
    feature_signal: float = 0.5,
    seed: int = 0,
):
    """A stochastic-block-model graph whose blocks are classes, with class-correlated features.

    Edges are drawn vectorized: ``N * avg_degree / 2`` endpoint pairs, each joining a node to a
    uniform node of its own class with probability ``homophily`` and of any class otherwise; the
    graph is made undirected and loop-free (duplicates merged). Features are
    ``feature_signal * mu[y] + N(0, 1)`` with one random mean vector per class, so structure and
    features both carry the label, neither alone perfectly.

    Args:
        num_nodes (int): ``N``.
        num_classes (int): ``C``, blocks of near-equal size.
        avg_degree (float, optional): expected degree (each undirected edge counts at both ends).
            (default: :obj:`10.0`)
        homophily (float, optional): probability that an edge stays inside a class.
            (default: :obj:`0.8`)
        num_features (int, optional): feature dimension ``F``. (default: :obj:`64`)
        feature_signal (float, optional): class-mean scale. (default: :obj:`0.5`)
        seed (int, optional): generator seed; the graph is a pure function of the arguments.
            (default: :obj:`0`)

    Shapes:
        - **output:** ``x`` ``[N, F]``, ``y`` ``[N]``, ``edge_index`` ``[2, E]``

    Returns:
        ``Data`` with ``x``, ``y``, ``edge_index`` and ``name`` (no split masks).

    Raises:
        DatasetError: unless ``num_nodes >= num_classes >= 1``.
    """
    if num_nodes < num_classes or num_classes < 1:
        raise DatasetError("synthetic graph needs num_nodes >= num_classes >= 1")
    gen = torch.Generator().manual_seed(seed)
    y = torch.randperm(num_nodes, generator=gen) % num_classes
    order = torch.argsort(y, stable=True)  # node ids grouped by class
    counts = torch.bincount(y, minlength=num_classes)
    starts = torch.cumsum(counts, 0) - counts
    m = int(num_nodes * avg_degree / 2)
    # The draws are those of one [m] tensor each, in this order (the graph stays a function of
    # the seed); temporaries are narrow and freed early, so a products-sized graph (62M pairs)
    # peaks at a few copies of its edge list, not a dozen.
    src = torch.randint(num_nodes, (m,), generator=gen)
    same = torch.rand(m, generator=gen) < homophily
    cls = y.to(torch.int32)[src]  # class ids index as int32 (half the bytes)
    offset = torch.rand(m, generator=gen).mul_(counts.float()[cls]).long()  # float32, as before
    offset += starts[cls]
    del cls
    dst = order[offset]
    del offset
    dst_any = torch.randint(num_nodes, (m,), generator=gen)
    dst.masked_scatter_(~same, dst_any[~same])
    del dst_any, same
    edge_index = undirected_coalesced(torch.stack([src, dst]), num_nodes)
    del src, dst
    mu = torch.randn(num_classes, num_features, generator=gen)
    x = torch.randn(num_nodes, num_features, generator=gen)
    chunk = max(1, (1 << 22) // max(num_features, 1))
    for start in range(0, num_nodes, chunk):  # x = signal * mu[y] + noise, a block of rows at a time
        x[start : start + chunk] += feature_signal * mu[y[start : start + chunk]]
    data = Data(x=x, y=y, edge_index=edge_index)
    data.name = f"sbm-{num_nodes}-{num_classes}"
    return data
