"""``torchrun ... -m retexo_fl.datacenter --dataset ... --algorithm 2d``: one process of a multi-host job."""

from __future__ import annotations

import argparse
import os
import sys

from retexo_fl.cli import _add_config_flags, _config_from_args
from retexo_fl.datacenter.graph import check_residency
from retexo_fl.datacenter.launch import run_process


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m retexo_fl.datacenter", description=__doc__)
    parser.add_argument("--summary", default="", help="where rank 0 writes summary.json")
    _add_config_flags(parser)
    args = parser.parse_args(argv)
    args.mode = "datacenter"
    if "WORLD_SIZE" in os.environ:  # torchrun's world is the process count
        args.procs = int(os.environ["WORLD_SIZE"])
    cfg = _config_from_args(args)
    check_residency(cfg)
    run_process(cfg, args.summary or None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
