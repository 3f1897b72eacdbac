"""Codec throughput: encode + decode of a 1,000,000 x 64 float32 block at each width, against torch.clone.

The clone of the same tensor, timed in the same run, is the memory-bandwidth limit; the table
gives each width's encode + decode time as a multiple of it, with the compiled CPU loops
(``retexo_fl/compress/native.py``) and, beside them, with torch ops alone (``RETEXO_FL_NATIVE=0``,
what a machine without a C compiler runs). Writes JSON. Example::

    python bench/codec.py --out bench/results/codec.json
    python bench/codec.py --rows 100000 --device cuda
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from retexo_fl.compress import native
from retexo_fl.compress.payload import frame_size
from retexo_fl.compress.quantize import ALL_BITS, dequantize_rows, quantize_rows


def _time(fn, repeats: int, device: torch.device) -> float:
    """Median seconds of ``fn`` over ``repeats`` runs after one warm-up."""
    fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--cols", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", default="bench/results/codec.json")
    args = parser.parse_args()
    device = torch.device(args.device)
    x = torch.randn(args.rows, args.cols, device=device)
    gen = torch.Generator(device=device).manual_seed(0)
    gb = x.numel() * 4 / 1e9
    clone = _time(lambda: x.clone(), args.repeats, device)
    compiled = native.usable(x)
    user_setting = os.environ.get(native.NATIVE_ENV)
    rows = []
    for bits in ALL_BITS:
        row = {"bits": bits, "frame_bytes": frame_size(args.rows, args.cols, bits)}
        for path in ("native", "torch") if compiled else ("torch",):
            os.environ[native.NATIVE_ENV] = "1" if path == "native" else "0"
            enc = _time(lambda b=bits: quantize_rows(x, b, generator=gen), args.repeats, device)
            q = quantize_rows(x, bits, generator=gen)
            dec = _time(lambda q=q: dequantize_rows(q), args.repeats, device)
            prefix = "" if path == ("native" if compiled else "torch") else "torch_ops_"
            row.update(
                {
                    f"{prefix}encode_s": enc,
                    f"{prefix}decode_s": dec,
                    f"{prefix}encode_gbps": gb / enc,
                    f"{prefix}decode_gbps": gb / dec,
                    f"{prefix}vs_clone": (enc + dec) / clone,
                }
            )
        rows.append(row)
    if user_setting is None:
        os.environ.pop(native.NATIVE_ENV, None)
    else:
        os.environ[native.NATIVE_ENV] = user_setting
    head = (
        f"{'bits':>4} {'encode GB/s':>12} {'decode GB/s':>12} {'enc+dec / clone':>16} "
        f"{'torch ops alone':>16} {'frame MB':>9}"
    )
    threads = torch.get_num_threads()
    loops = "compiled loops" if compiled else "torch ops (no compiled loops here)"
    where = f"{device} ({threads} threads, {loops})"
    print(f"{args.rows} x {args.cols} float32 on {where}; clone {gb / clone:.2f} GB/s")
    print(head)
    print("-" * len(head))
    for r in rows:
        alone = f"{r['torch_ops_vs_clone']:>15.2f}x" if compiled else f"{'':>16}"
        print(
            f"{r['bits']:>4} {r['encode_gbps']:>12.2f} {r['decode_gbps']:>12.2f} {r['vs_clone']:>15.2f}x "
            f"{alone} {r['frame_bytes'] / 1e6:>9.1f}"
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "rows": args.rows,
        "cols": args.cols,
        "device": str(device),
        "threads": torch.get_num_threads(),
        "compiled_loops": compiled,
        "clone_s": clone,
        "clone_gbps": gb / clone,
        "codecs": rows,
    }
    out.write_text(json.dumps(record, indent=2))
    print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
