"""Codec throughput: encode + decode of a 1,000,000 x 64 float32 block at each width, against torch.clone.

The clone of the same tensor, timed in the same run, is the memory-bandwidth limit; the table
gives each width's encode + decode time as a multiple of it. Writes JSON. Example::

    python bench/codec.py --out bench/results/codec.json
    python bench/codec.py --rows 100000 --device cuda
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

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
    rows = []
    for bits in ALL_BITS:
        enc = _time(lambda b=bits: quantize_rows(x, b, generator=gen), args.repeats, device)
        q = quantize_rows(x, bits, generator=gen)
        dec = _time(lambda q=q: dequantize_rows(q), args.repeats, device)
        rows.append(
            {
                "bits": bits,
                "encode_s": enc,
                "decode_s": dec,
                "encode_gbps": gb / enc,
                "decode_gbps": gb / dec,
                "vs_clone": (enc + dec) / clone,
                "frame_bytes": frame_size(args.rows, args.cols, bits),
            }
        )
    head = f"{'bits':>4} {'encode GB/s':>12} {'decode GB/s':>12} {'enc+dec / clone':>16} {'frame MB':>9}"
    threads = torch.get_num_threads()
    print(f"{args.rows} x {args.cols} float32 on {device} ({threads} threads); clone {gb / clone:.2f} GB/s")
    print(head)
    print("-" * len(head))
    for r in rows:
        print(
            f"{r['bits']:>4} {r['encode_gbps']:>12.2f} {r['decode_gbps']:>12.2f} {r['vs_clone']:>15.2f}x "
            f"{r['frame_bytes'] / 1e6:>9.1f}"
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "rows": args.rows,
        "cols": args.cols,
        "device": str(device),
        "threads": torch.get_num_threads(),
        "clone_s": clone,
        "clone_gbps": gb / clone,
        "codecs": rows,
    }
    out.write_text(json.dumps(record, indent=2))
    print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
