"""The ``retexo-fl`` command line: ``partition`` a dataset, ``train`` a model, run a ``supernode``."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from importlib.metadata import entry_points
from pathlib import Path
from typing import TYPE_CHECKING

from retexo_fl.config import (
    EDGE_PROFILE,
    EXACT_PROFILE,
    LAZY_PARTITION_DEFAULTS,
    MODE_DEFAULTS,
    NODE_LEVEL_DEFAULTS,
    SECTIONS,
    TrainConfig,
    ignored_settings,
    settings,
)
from retexo_fl.metrics import CHECKPOINT_FILE
from retexo_fl.setting import SettingInfo, settings_of
from retexo_fl.summary import RunSummary

if TYPE_CHECKING:
    from torch_geometric.data import Data

    from retexo_fl.data.partition import Partition

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
    """One flag per declared setting, its help the setting's doc, grouped by section."""
    for section, cls in SECTIONS.items():
        group = parser.add_argument_group(f"{section} settings")
        for info in settings_of(cls):
            _add_flag(group, info)
    parser.add_argument("--out", dest="out_dir", default=None, action=_OneFolder, help="alias of --out-dir")


def _shown(value: object) -> str:
    """A default as the flag takes it: ``adam,avg``, not ``['adam', 'avg']``."""
    if isinstance(value, list | tuple):
        return ",".join(_shown(v) for v in value)
    return str(value).lower() if isinstance(value, bool) else str(value)


def _defaults_of(info: SettingInfo) -> str:
    """``default X``, and the value each mode or level sets in its place (:meth:`TrainConfig.resolve`)."""
    where = [
        *((f"{mode} mode", table) for mode, table in MODE_DEFAULTS.items()),
        ("a lazy run at one node per client (method node)", NODE_LEVEL_DEFAULTS),
        (
            "a lazy run over partitions (not the exact profile, secure aggregation, DP or boundary noise)",
            LAZY_PARTITION_DEFAULTS,
        ),
        ("the exact profile", EXACT_PROFILE),
        ("the edge profile", EDGE_PROFILE),
    ]
    others = [f"{label}: {_shown(table[info.name])}" for label, table in where if info.name in table]
    read = []  # where the run reads it at all (setting's modes and needs)
    if info.modes:
        read.append(f"in {' and '.join(info.modes)} mode")
    if info.needs:
        read.append(info.needs_phrase)
    return "; ".join(
        [f"default {_shown(info.default)}", *others, *([f"read only {', '.join(read)}"] if read else [])]
    )


def _add_flag(parser: argparse._ArgumentGroup, info: SettingInfo) -> None:
    flag = "--" + info.key
    if info.per_stage:
        help_ = f"{info.doc}; one value or a comma list per stage ({_defaults_of(info)})"
        parser.add_argument(flag, default=None, help=help_)
    elif isinstance(info.default, bool):
        # ``--flag`` alone means true; ``--flag false`` also works (run-config style).
        parser.add_argument(
            flag,
            default=None,
            nargs="?",
            const=True,
            type=_flag_value,
            help=f"{info.doc} ({_defaults_of(info)})",
        )
    else:
        parser.add_argument(
            flag,
            default=None,
            type=type(info.default),
            choices=info.choices or None,
            help=f"{info.doc} ({_defaults_of(info)})",
            **({"action": _OneFolder} if info.name == "out_dir" else {}),
        )


class _OneFolder(argparse.Action):
    """``--out-dir`` and its alias ``--out``: two different folders are refused, where the last
    given was taken without a word."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: object,
        option_string: str | None = None,
    ) -> None:
        given = getattr(namespace, self.dest, None)
        if given is not None and given != values:
            parser.error(f"{option_string} {values}: the run folder is already given as {given}")
        setattr(namespace, self.dest, values)


#: What a true / false flag takes after it (``--encrypt false``); anything else is refused, since
#: a misspelt ``--secure-aggregation on`` read as false would run without what it asked for.
FLAG_WORDS = {
    **dict.fromkeys(("1", "true", "yes", "on"), True),
    **dict.fromkeys(("0", "false", "no", "off"), False),
}


def _flag_value(text: str) -> bool:
    try:
        return FLAG_WORDS[text.strip().lower()]
    except KeyError:
        raise argparse.ArgumentTypeError(
            f"expected true or false (or yes / no, on / off, 1 / 0), got {text!r}"
        ) from None


def _config_from_args(args: argparse.Namespace) -> TrainConfig:
    values = {
        info.name: getattr(args, info.name)
        for info in settings()
        if getattr(args, info.name, None) is not None
    }
    return TrainConfig.from_mapping(values)


def _owners_cut(args: argparse.Namespace, data: Data) -> list[Partition]:
    """``partition --owners``: one partition a party of the owners file, each its own nodes."""
    from retexo_fl.data.files import read_owners
    from retexo_fl.data.partitioners import OWNERS_METHOD, split_graph

    placing = (("--method", args.method is not None), ("--clusters", args.clusters))
    given = [flag for flag, value in placing if value]
    if given:
        raise ValueError(f"{', '.join(given)} with --owners: the owners file places every node")
    names = getattr(data, "node_names", None) or [str(i) for i in range(data.num_nodes)]
    owner, parties = read_owners(
        Path(args.owners).expanduser(), names, args.owner_id_column, args.owner_column
    )
    if args.clients is not None and args.clients != len(parties):
        raise ValueError(
            f"--clients {args.clients}, but {args.owners} names {len(parties)} parties: with --owners "
            "the file sets the partitions (leave --clients out)"
        )
    parts = split_graph(data, owner, len(parties), method=OWNERS_METHOD, seed=args.seed)
    for p in parts:
        p.meta["party"] = parties[p.partition_id]  # one name: a list of every party would grow each manifest
    return parts


def cmd_partition(args: argparse.Namespace) -> int:
    # The subcommands import torch and PyG only when they run: `retexo-fl --help` stays instant.
    from retexo_fl.data.datasets import load_dataset
    from retexo_fl.data.partition import save_partition
    from retexo_fl.data.partitioners import partition_graph

    out = Path(args.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        # A second cut into the folder would leave the first's extra part-<id>/ folders behind.
        raise ValueError(f"--out {out}: exists and is not an empty folder; partitions go to a new one")
    if args.owners is None and args.method is None:  # not given: metis (with --owners, none)
        args.method = "metis"
    if args.method == "supernode" and args.clusters < 0:
        raise ValueError(f"--clusters must be >= 0 (0: the partitioner's own), got {args.clusters}")
    if args.method == "label-skew" and not (math.isfinite(args.alpha) and args.alpha > 0):
        raise ValueError(f"--alpha must be a finite number > 0, got {args.alpha}")
    if args.owners is None and args.clients is None:
        raise ValueError(
            "--clients is needed: how many partitions to cut (or --owners: a file of each node's party)"
        )
    data = load_dataset(
        args.dataset, args.root, split=args.split, seed=args.seed, split_index=args.split_index
    )
    if args.owners is not None:
        parts = _owners_cut(args, data)
    else:
        options = {"alpha": args.alpha} if args.method == "label-skew" else {}
        if args.method == "supernode" and args.clusters:
            options["clusters"] = args.clusters
        parts = partition_graph(data, args.clients, args.method, seed=args.seed, **options)
    if args.residency == "free":
        parts = [dataclasses.replace(p, residency_bound=False) for p in parts]
    for p in parts:  # so that a run over the folders records the split it trains on
        p.meta.update(split=args.split, split_index=args.split_index)
    # Written to a staging folder and moved into place when whole: an interrupted or failed cut
    # leaves no partial set that a later train would read as a cut with folders missing. The
    # staging folder is beside --out, or, where --out is an existing (empty) folder, inside it
    # ("." or a mount point cannot be replaced), whose part folders then move up one by one.
    out = out.resolve()
    inside = out.is_dir()
    home = out if inside else out.parent
    home.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.incomplete-", dir=home))
    umask = os.umask(0)
    os.umask(umask)
    staging.chmod(0o777 & ~umask)  # as a folder made the usual way (mkdtemp's is private)
    try:
        for p in parts:
            save_partition(p, staging / f"part-{p.partition_id}")
            c = p.counts()
            print(
                f"part-{p.partition_id}: {c['nodes']} nodes, {c['edges']} local edges, "
                f"{c['cross_edges']} cross edges, train/val/test {c['train']}/{c['val']}/{c['test']}"
            )
        if inside:
            for folder in sorted(staging.iterdir()):
                folder.replace(out / folder.name)
            staging.rmdir()
        else:
            staging.replace(out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    how = f"one a party of {args.owners}" if args.owners else f"{args.method}, seed {args.seed}"
    print(f"wrote {len(parts)} partitions of {data.name} ({how}) to {args.out}")
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    from retexo_fl.runner import partitions_config, train

    cfg = _config_from_args(args)
    given = [info.name for info in settings() if getattr(args, info.name, None) is not None]
    for line in ignored_settings(cfg, given):
        print(f"retexo-fl: warning: --{line}", file=sys.stderr)
    if cfg.mode not in ("centralized", "datacenter") and not cfg.resume:  # else not read here
        cfg = partitions_config(cfg, clients_given="clients" in given)
    unread = [f"--{name.replace('_', '-')}" for name in given if name not in ("resume", "out_dir")]
    if cfg.resume and unread:
        print(
            f"retexo-fl: warning: {', '.join(unread)}: a resumed run trains with the settings it "
            f"started with ({Path(cfg.resume) / 'config.json'}): ignored",
            file=sys.stderr,
        )
    if args.engine != "in-process":
        from retexo_fl.runner import preflight

        preflight(cfg, in_process=False)  # before Flower starts and the server writes the folder
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
    p.add_argument(
        "--dataset", required=True, help="the graph, as train's --dataset (a name, files:..., .npz, .pt)"
    )
    p.add_argument("--root", default="data", help="folder of the datasets' raw files (default: data)")
    p.add_argument(
        "--split",
        default="public",
        help="public, random:TRAIN,VAL,TEST or per-class:K,VAL,TEST (default: public)",
    )
    p.add_argument("--split-index", type=int, default=0, help="which of a dataset's splits (default: 0)")
    p.add_argument("--clients", type=int, default=None, help="the partitions to cut (not with --owners)")
    p.add_argument(
        "--method",
        default=None,
        help="the partitioner: metis, louvain, random, supernode, label-skew or node (default: metis; "
        "not with --owners)",
    )
    p.add_argument(
        "--owners",
        default=None,
        help="a CSV of each node's party (a header line; the node id, then the party): each party "
        "keeps the nodes it holds, one partition a party, instead of --method placing them",
    )
    p.add_argument("--owner-column", default=None, help="--owners' party column (default: the other of two)")
    p.add_argument(
        "--owner-id-column",
        default=None,
        help="--owners' node id column (default: the one named id, node or node_id, else the first)",
    )
    p.add_argument("--seed", type=int, default=0, help="the partitioner's and the split's seed (default: 0)")
    p.add_argument("--alpha", type=float, default=0.5, help="Dirichlet concentration (label-skew)")
    p.add_argument("--clusters", type=int, default=0, help="METIS clusters (supernode)")
    p.add_argument(
        "--residency",
        choices=["bound", "free"],
        default="bound",
        help="bound (default): the owners' data may not be pooled; free: data-center mode may pool it",
    )
    p.add_argument("--out", required=True, help="a new (or empty) folder for the part-<id>/ folders")
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
    except (ValueError, OSError, RuntimeError) as exc:  # OSError: an --out that cannot be written
        print(f"retexo-fl: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        out = getattr(args, "out_dir", None) or getattr(args, "resume", None)
        if out and (Path(out) / CHECKPOINT_FILE).is_file():
            where = f"; {out} holds the run so far: --resume {out} --engine simulation continues it"
        elif out:
            # The in-process engine keeps no checkpoint: a hint to resume would send the user
            # through a simulation's start-up to be told so.
            where = (
                f"; {out} holds what was written so far, and no checkpoint to resume from (lazy "
                "runs of the Flower engines keep one: --engine simulation)"
            )
        else:
            where = ""
        print(f"retexo-fl: interrupted{where}", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
