"""The ``retexo-fl`` command line: ``partition`` a dataset, ``train`` a model, run a ``supernode``."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Callable
from importlib.metadata import entry_points
from pathlib import Path

from retexo_fl.config import PER_STAGE, TrainConfig
from retexo_fl.summary import RunSummary

_HELP = {
    "mode": "lazy (RETEXO), eager (standard federated GNN), local (no cross edges, TMA), centralized, "
    "or datacenter (CAGNET full-graph training on torch.distributed, trusted clusters only)",
    "dataset": "PyG dataset name, sbm:N,C[,deg,homophily], the path of a saved Data file or an npz "
    "graph, or files:edges=E.csv,features=F,labels=L.csv[,id-column=C][,label-column=C]",
    "data_root": "folder with the dataset's raw/ files (PyG downloads there if it can)",
    "split": "public | random:TRAIN,VAL,TEST | per-class:K,VAL,TEST",
    "clients": "number of clients (partitions)",
    "method": "partitioner: metis, louvain, random, supernode, label-skew, node",
    "partitions": "train on partitions written by `retexo-fl partition` instead of cutting the dataset",
    "model": "conv of stages >= 1: gcn, sage, sage-max, gat (centralized mode also: mlp, no edges)",
    "stages": "number of stages (stage 0 is the MLP; K stages = K-1 GNN layers)",
    "central_layers": "layers of the centralized (end-to-end) reference GNN",
    "eager_model": "eager / local model of stages-1 GNN layers: standard (the reference GNN, "
    "split so peers get X W, never X; gcn, sage, 2+ layers), layered (MLP encoder, convs, head) "
    "or auto (standard where it applies)",
    "pass_embedding": "what the next stage receives: hidden or logits",
    "root_weight": "gcn and gat stages add a linear map of each node's own input to what they "
    "aggregate (as SAGE's root weight)",
    "first_stage": "stage 0: mlp (own features) or local (one model layer over the client's own "
    "edges; no boundary traffic, but stage 0 then depends on the partitioning)",
    "self_training": "extra passes over all stages, each client training on its own confident "
    "predictions as labels (lazy, centralized)",
    "pseudo_threshold": "softmax confidence a prediction needs to become a self-training label",
    "pseudo_per_class": "the most self-training labels a client takes per predicted class, most "
    "confident first (0: no cap)",
    "pass_init": "where a self-training pass's stages start: warm (the previous pass's kept "
    "weights) or fresh (new initial weights)",
    "patience": "early stopping: rounds without a validation gain before a stage stops (0: never)",
    "min_rounds": "rounds a stage from fresh weights runs before early stopping may end it",
    "warm_min_rounds": "rounds a stage warm-started from the previous self-training pass runs "
    "before early stopping may end it",
    "stop_metric": "what early stopping counts as progress: accuracy (a higher validation "
    "accuracy) or accuracy-or-loss (that, or a lower validation loss)",
    "precompute": "gcn and sage stages aggregate their frozen inputs once a stage, so a round is "
    "a dense step (exact without input dropout)",
    "drift_correction": "none, or scaffold: correct each local step by control variates so many "
    "local steps a round do not drift on skewed partitions (one more state sent down a round)",
    "halo_gradients": "eager: return each halo row's gradient to its owner, one round stale "
    "(PipeGCN; on by default in eager mode; peers' gradients tell of the sender's labels)",
    "server_optimizer": "avg (FedAvg) or adam (FedAdam on the averaged update)",
    "out_dir": "run folder for config.json, events.jsonl and summary.json",
    "algorithm": "data-center product: 1d, 1.5d, 2d (P a square) or 3d (P a cube)",
    "procs": "data-center processes started on this host (torchrun sets its own)",
    "replication": "1.5d's replication factor c (divides procs)",
    "trusted_cluster": "let data-center mode pool partitions marked residency-bound",
    "secure_aggregation": "mask every round reply so that the server learns only the survivors' sum",
    "secagg_threshold": "shares that rebuild a self seed, and the fewest survivors a round decodes with "
    "(0: (clients + 1) // 2 + 1)",
}

#: The entry-point group that names the engines ``train --engine`` offers besides ``in-process``
#: (pyproject.toml registers Flower's simulation engine, ``server.simulation:simulate``, here).
ENGINE_GROUP = "retexo_fl.engines"


def engines() -> list[str]:
    """The names of the installed engines of :data:`ENGINE_GROUP`, sorted."""
    return sorted({ep.name for ep in entry_points(group=ENGINE_GROUP)})


def load_engine(name: str) -> Callable[[TrainConfig], RunSummary]:
    """The engine registered as ``name``: a callable that trains a config and returns its summary.

    Args:
        name (str): an entry point of :data:`ENGINE_GROUP`, e.g. ``"simulation"``.

    Raises:
        ValueError: no installed package registers ``name`` (a checkout that was never
            ``pip install``-ed registers none).
    """
    found = [ep for ep in entry_points(group=ENGINE_GROUP) if ep.name == name]
    if not found:
        raise ValueError(
            f"engine {name!r}: no installed package registers it in the {ENGINE_GROUP!r} entry points "
            f"(installed: {', '.join(engines()) or 'none'}); run `pip install -e .` in the checkout"
        )
    return found[0].load()


#: The entry-point group of commands that live outside the library (pyproject.toml registers
#: ``supernode = clients.supernode:main``, Flower's SuperNode with a node worker, there). Each takes
#: its own argv and returns an exit code.
COMMAND_GROUP = "retexo_fl.commands"


def commands() -> dict[str, str]:
    """The installed commands of :data:`COMMAND_GROUP`: name -> the first line of its doc."""
    return {ep.name: ep.value for ep in entry_points(group=COMMAND_GROUP)}


def _add_config_flags(parser: argparse.ArgumentParser) -> None:
    for f in dataclasses.fields(TrainConfig):
        if f.name == "extra":
            continue
        flag = "--" + f.name.replace("_", "-")
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        help_ = _HELP.get(f.name, "")
        if f.name in PER_STAGE:
            parser.add_argument(
                flag,
                default=None,
                help=f"{help_} one value or a comma list per stage (default {default})".strip(),
            )
        elif isinstance(default, bool):
            # ``--flag`` alone means true; ``--flag false`` also works (run-config style).
            parser.add_argument(
                flag,
                default=None,
                nargs="?",
                const=True,
                type=lambda v: v.lower() in ("1", "true", "yes"),
                help=f"{help_} (default {str(default).lower()})".strip(),
            )
        else:
            parser.add_argument(flag, default=None, type=type(default), help=f"{help_} (default {default})")
    parser.add_argument("--out", dest="out_dir", default=None, help="alias of --out-dir")


def _config_from_args(args: argparse.Namespace) -> TrainConfig:
    values = {
        f.name: getattr(args, f.name)
        for f in dataclasses.fields(TrainConfig)
        if f.name != "extra" and getattr(args, f.name, None) is not None
    }
    return TrainConfig.from_mapping(values)


def cmd_partition(args: argparse.Namespace) -> int:
    # The subcommands import torch and PyG only when they run: `retexo-fl --help` stays instant.
    from retexo_fl.data.datasets import load_dataset
    from retexo_fl.data.partition import save_partition
    from retexo_fl.data.partitioners import partition_graph

    data = load_dataset(
        args.dataset, args.root, split=args.split, seed=args.seed, split_index=args.split_index
    )
    options = {"alpha": args.alpha} if args.method == "label-skew" else {}
    if args.method == "supernode" and args.clusters:
        options["clusters"] = args.clusters
    parts = partition_graph(data, args.clients, args.method, seed=args.seed, **options)
    if args.residency == "free":
        parts = [dataclasses.replace(p, residency_bound=False) for p in parts]
    out = Path(args.out)
    for p in parts:
        save_partition(p, out / f"part-{p.partition_id}")
        c = p.counts()
        print(
            f"part-{p.partition_id}: {c['nodes']} nodes, {c['edges']} local edges, "
            f"{c['cross_edges']} cross edges, train/val/test {c['train']}/{c['val']}/{c['test']}"
        )
    print(f"wrote {len(parts)} partitions of {data.name} ({args.method}, seed {args.seed}) to {out}")
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    from retexo_fl.runner import train

    cfg = _config_from_args(args)
    summary = train(cfg) if args.engine == "in-process" else load_engine(args.engine)(cfg)
    print(
        json.dumps(
            {
                "test_accuracy": summary.test_accuracy,
                "val_accuracy": summary.val_accuracy,
                "bytes_total": summary.bytes_total,
                "bytes_boundary": summary.bytes_boundary,
                "bytes_model": summary.bytes_model,
                "wall_seconds": summary.wall_seconds,
            }
        )
    )
    return 0


def cmd_keys(args: argparse.Namespace) -> int:
    from retexo_fl.secure.keys import (
        collect_pins,
        fingerprint,
        pin_digest,
        write_identities,
        write_own_identity,
    )

    if args.client is not None:  # one party, on its own machine
        key, pub = write_own_identity(args.client, args.out)
        public = bytes.fromhex(json.loads(pub.read_text())["public"])
        print(
            f"client {args.client}: private key {key} (mode 0600; it never leaves this machine), "
            f"public key {pub}\nfingerprint {fingerprint(public)}: read it to the other parties "
            "out of band; send them only the .pub file"
        )
        return 0
    if args.pins:  # any party, from the .pub files the others sent
        pins = collect_pins(args.pins, args.out)
        for client, public in sorted(pins.items()):
            print(f"client {client}: fingerprint {fingerprint(public)}")
        print(
            f"wrote {args.out} ({len(pins)} parties, pin set {pin_digest(pins)}): check every "
            "fingerprint with its party out of band, and the pin set with every party"
        )
        return 0
    out = write_identities(args.clients, args.out)
    print(
        f"wrote {args.clients} identity keys (client-<id>.key, mode 0600) and pins.json to {out}: "
        "one machine holds every private key, so this is for simulation and tests; in deployment "
        "each party runs `retexo-fl keys --client ID` itself"
    )
    return 0


def cmd_audit(args: argparse.Namespace) -> int:
    from retexo_fl.secure.audit import check_audit

    figures, findings = check_audit(args.run_dir, args.partitions or None)
    for cid, f in sorted(figures.items()):
        print(
            f"client {cid}: {f['messages']} messages, {f['arrays']} arrays, {f['payloads']} relayed payloads "
            f"checked against {f['partition']}"
        )
    for finding in findings:
        print(f"LEAK {finding}")
    print(
        f"audit {'FAILED' if findings else 'passed'}: {len(findings)} finding(s) in "
        f"{sum(f['messages'] for f in figures.values())} messages of {len(figures)} clients"
    )
    return 1 if findings else 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="retexo-fl", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("partition", help="cut a dataset into fixed per-client partition folders")
    p.add_argument("--dataset", required=True)
    p.add_argument("--root", default="data")
    p.add_argument("--split", default="public")
    p.add_argument("--split-index", type=int, default=0)
    p.add_argument("--clients", type=int, required=True)
    p.add_argument("--method", default="metis")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--alpha", type=float, default=0.5, help="Dirichlet concentration (label-skew)")
    p.add_argument("--clusters", type=int, default=0, help="METIS clusters (supernode)")
    p.add_argument(
        "--residency",
        choices=["bound", "free"],
        default="bound",
        help="bound (default): the owners' data may not be pooled; free: data-center mode may pool it",
    )
    p.add_argument("--out", required=True)
    p.set_defaults(func=cmd_partition)

    k = sub.add_parser(
        "keys",
        help="identity keys and pins: one party's own key (--client), the pins file from the parties' "
        "public keys (--pins), or every party's at once for simulation (--clients)",
    )
    which = k.add_mutually_exclusive_group(required=True)
    which.add_argument("--client", type=int, default=None, help="make this party's own key in --out")
    which.add_argument("--pins", nargs="+", default=None, help="client-<id>.pub files -> the pins file --out")
    which.add_argument("--clients", type=int, default=None, help="every party's key and pins.json in --out")
    k.add_argument("--out", required=True)
    k.set_defaults(func=cmd_keys)

    a = sub.add_parser(
        "audit", help="search a run's audit records for each client's raw data (copies and re-encodings)"
    )
    a.add_argument(
        "run_dir", help="the audit folder (client-<id>/ sub-folders) of a run started with --audit"
    )
    a.add_argument("--partitions", default="", help="compare against these part-<id>/ folders instead")
    a.set_defaults(func=cmd_audit)

    t = sub.add_parser("train", help="train a model (federated, centralized or data-center)")
    t.add_argument(
        "--engine",
        choices=["in-process", *engines()],
        default="in-process",
        help="the in-process reference engine, or Flower's simulation engine (lazy, eager, local)",
    )
    t.add_argument("--root", dest="data_root", default=None, help="alias of --data-root")
    _add_config_flags(t)
    t.set_defaults(func=cmd_train)

    for name in sorted(commands()):  # listed for --help; main() hands them their argv whole
        sub.add_parser(name, help=f"{name} (see `retexo-fl {name} --help`)", add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in commands():  # e.g. `supernode`: every flag after it is Flower's
        found = [ep for ep in entry_points(group=COMMAND_GROUP) if ep.name == argv[0]]
        return int(found[0].load()(argv[1:]) or 0)
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, RuntimeError) as exc:
        print(f"retexo-fl: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
