"""Many one-node devices on one machine: ``retexo-fl devices`` against one SuperNode per device.

At one node per party every device is a party and its own Flower node. Emulated with one
``retexo-fl supernode`` per device (the reference), a device is a SuperNode, its SuperExec with a
fork server, a node worker with torch and a ClientApp process per message. ``retexo-fl devices``
holds many devices in one process, each still its own node on the SuperLink. Both run the same
whole deployed run on a generated graph cut one node per party (``sbm:N,3,4,0.7``), on 127.0.0.1
with an in-memory SuperLink, one after the other in this process:

- wall: the run from ``flwr run`` to its end;
- memory: the peak resident memory of everything that holds the devices (every process of the
  reference's SuperNode groups, sampled every 0.2 s; the host's own ``VmHWM``), and per device;
- SuperLink CPU: seconds of CPU its process used over the whole federation's life.

Prints a table, writes JSON. Example (about 6 minutes on 2 cores)::

    python bench/device_host.py --devices 12,100 --reference 12 --out bench/results/device_host.json
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "deploy"))
from federation import FederationProcesses  # noqa: E402

RUN = "method='node' stages=2 rounds='3' hidden=16 seed=1"
TICKS = os.sysconf("SC_CLK_TCK")


def _status_kb(pid: int, field: str) -> int:
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0
    for line in text.splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def _cpu_seconds(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / TICKS  # utime + stime


def _group_rss_kb(groups: set[int]) -> int:
    """The summed resident memory of every process in the process groups ``groups``."""
    total = 0
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            pgid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[2])
        except (OSError, IndexError, ValueError):
            continue
        if pgid in groups:
            total += _status_kb(int(proc.name), "VmRSS")
    return total


class GroupPeak:
    """Samples the summed resident memory of some process groups every ``every`` seconds."""

    def __init__(self, groups: set[int], every: float = 0.2) -> None:
        self.groups, self.every, self.peak_kb = groups, every, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            self.peak_kb = max(self.peak_kb, _group_rss_kb(self.groups))

    def __enter__(self) -> GroupPeak:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def one_run(kind: str, devices: int, tmp: Path, timeout: float) -> dict:
    """The whole run with ``devices`` one-node parties held by ``kind`` (``supernodes``/``host``)."""
    from retexo_fl.cli import main as cli

    base = tmp / f"{kind}-{devices}"
    parts = base / "parts"
    argv = ["partition", "--dataset", f"sbm:{devices},3,4,0.7", "--clients", str(devices), "--method", "node"]
    with contextlib.redirect_stdout(io.StringIO()):  # a line per device
        assert cli([*argv, "--out", str(parts), "--seed", "0"]) == 0
    fed = FederationProcesses(base / "work", database=False)
    out = base / "run"
    try:
        fed.start_superlink()
        if kind == "host":
            procs = [fed.start_device_host(0, parts, list(range(devices)))]
        else:
            procs = [fed.start_supernode(i, parts / f"part-{i}") for i in range(devices)]
        with GroupPeak({p.pid for p in procs}) as sampled:
            t0 = time.monotonic()
            record = fed.run(f"clients={devices} out-dir='{out}' {RUN}", timeout)
            wall = time.monotonic() - t0
        host_peak_kb = _status_kb(procs[0].pid, "VmHWM") if kind == "host" else 0
        superlink_cpu = _cpu_seconds(fed.procs["superlink"].pid)
    finally:
        fed.stop_all()
    if record.get("status") != "finished:completed":
        raise RuntimeError(f"{kind} with {devices} devices ended {record.get('status')}; see {base}")
    summary = json.loads((out / "summary.json").read_text())
    peak_mb = max(host_peak_kb, sampled.peak_kb) / 1024
    return {
        "held_by": "one retexo-fl devices process" if kind == "host" else "a retexo-fl supernode each",
        "devices": devices,
        "wall_seconds": round(wall, 1),
        "peak_mb": round(peak_mb, 1),
        "mb_per_device": round(peak_mb / devices, 2),
        "superlink_cpu_seconds": round(superlink_cpu, 1),
        "test_accuracy": summary.get("test_accuracy"),
        "messages": summary.get("messages"),
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--devices", default="12,100", help="device counts held by one retexo-fl devices")
    parser.add_argument("--reference", default="12", help="device counts run as a retexo-fl supernode each")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds one run may take")
    parser.add_argument("--out", default="bench/results/device_host.json")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="retexo-devices-"))
    plan = [("supernodes", int(n)) for n in args.reference.split(",") if n]
    plan += [("host", int(n)) for n in args.devices.split(",") if n]
    rows = []
    for kind, n in plan:
        print(f"{n} devices, {kind} ...", flush=True)
        rows.append(one_run(kind, n, tmp, args.timeout))
    columns = ("devices", "held by", "wall s", "peak MB", "MB/device", "SuperLink CPU s")
    print("{:>7}  {:<30} {:>7} {:>8} {:>9} {:>15}".format(*columns))
    for r in rows:
        print(
            f"{r['devices']:>7}  {r['held_by']:<30} {r['wall_seconds']:>7.1f} {r['peak_mb']:>8.0f} "
            f"{r['mb_per_device']:>9.2f} {r['superlink_cpu_seconds']:>15.1f}"
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"run_config": RUN, "superlink": "in memory", "runs": rows}, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
