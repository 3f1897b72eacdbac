"""Codec throughput: encode + decode of a 1,000,000 x 64 float32 block at each width, against torch.clone.

The clone of the same tensor, timed in the same run, is the memory-bandwidth limit; the table
gives each width's encode + decode time as a multiple of it, with the compiled CPU loops
(``retexo_fl/compress/native.py``) and, beside them, with torch ops alone (``RETEXO_FL_NATIVE=0``,
what a machine without a C compiler runs). Writes JSON. Example::

    python bench/codec.py --out bench/results/codec.json
    python bench/codec.py --rows 100000 --device cuda

``--updates`` times a small client's model update instead: encode (with its error-feedback
residual) and decode of whole states the size a lazy stage sends on a small graph, per update,
where a block's fixed cost, not its bandwidth, is what a round pays::

    python bench/codec.py --updates --out bench/results/codec-updates.json

``--generated`` asks whether generated code could replace the hand-written loops on the CPU: each
of the row codec's three loops (fp16 ranges rounded outward, 8-bit codes with their scales, the
decode) as the torch ops the loops stand for, compiled by ``torch.compile`` (inductor's C++),
against the loops and against the same ops uncompiled, on the 1,000,000 x 64 block and on a block
the size of stage 0's weight on Chameleon (32 x 2,325); each generated kernel's output is compared
with the loop's, bit for bit::

    python bench/codec.py --generated --out bench/results/codec-generated.json
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from retexo_fl.compress import native
from retexo_fl.compress.payload import frame_size
from retexo_fl.compress.quantize import ALL_BITS, RANGE_DTYPES, dequantize_rows, quantize_rows
from retexo_fl.compress.updates import UpdateCodec

#: ``--updates``: the states a lazy stage sends on Chameleon (2,325 features, 5 classes) at the
#: default hidden width of 32: stage 0's MLP and a GCN stage, as (name, {tensor: shape}).
UPDATE_STATES = (
    (
        "stage 0 MLP, 2325 -> 32 -> 5",
        {"body.weight": (32, 2325), "body.bias": (32,), "head.weight": (5, 32), "head.bias": (5,)},
    ),
    (
        "GCN stage, 32 -> 32 -> 5",
        {"body.lin.weight": (32, 32), "body.bias": (32,), "head.weight": (5, 32), "head.bias": (5,)},
    ),
)


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


def _per_call(fn: Callable[[], object], calls: int, repeats: int) -> float:
    """Median over ``repeats`` of the mean seconds of one of ``calls`` calls of ``fn``."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t0) / calls)
    return statistics.median(times)


def _time_updates(args: argparse.Namespace, compiled: bool) -> list[dict]:
    """One row per state of :data:`UPDATE_STATES` and width: its encode and decode ms, with the
    compiled loops and (where they are built) with torch ops alone. Sets the switch as it goes."""
    gen = torch.Generator().manual_seed(0)
    rows = []
    for name, shapes in UPDATE_STATES:
        base = {k: torch.randn(*shape, generator=gen) * 0.1 for k, shape in shapes.items()}
        new = {k: v + torch.randn(v.shape, generator=gen) * 1e-3 for k, v in base.items()}
        for bits in (4, 8):
            codec = UpdateCodec(bits)
            row = {
                "state": name,
                "bits": bits,
                "tensors": len(shapes),
                "values": sum(v.numel() for v in base.values()),
            }
            for path in ("native", "torch") if compiled else ("torch",):
                os.environ[native.NATIVE_ENV] = "1" if path == "native" else "0"
                frames, residual = codec.encode(new, base, None, gen)
                enc = _per_call(
                    lambda c=codec, r=residual, n=new, b=base: c.encode(n, b, r, gen),
                    args.calls,
                    args.repeats,
                )
                dec = _per_call(
                    lambda c=codec, f=frames, b=base: c.decode(f, b, "client"), args.calls, args.repeats
                )
                prefix = "" if path == ("native" if compiled else "torch") else "torch_ops_"
                row.update({f"{prefix}encode_ms": enc * 1e3, f"{prefix}decode_ms": dec * 1e3})
            rows.append(row)
    return rows


def updates(args: argparse.Namespace) -> int:
    """``--updates``: per-update encode and decode time of :data:`UPDATE_STATES`, with the
    compiled loops and with torch ops alone, side by side."""
    compiled = native.usable(torch.zeros(1))
    user_setting = os.environ.get(native.NATIVE_ENV)
    try:
        rows = _time_updates(args, compiled)
    finally:  # the switch as the user had it, whatever happened
        if user_setting is None:
            os.environ.pop(native.NATIVE_ENV, None)
        else:
            os.environ[native.NATIVE_ENV] = user_setting
    head = f"{'state':<30} {'bits':>4} {'encode ms':>10} {'decode ms':>10} {'torch ops: enc':>15} {'dec':>7}"
    loops = "compiled loops" if compiled else "torch ops (no compiled loops here)"
    print(
        f"one update, encode (residual kept) and decode, on the CPU "
        f"({torch.get_num_threads()} threads, {loops})"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        alone = f"{r['torch_ops_encode_ms']:>15.3f} {r['torch_ops_decode_ms']:>7.3f}" if compiled else ""
        print(f"{r['state']:<30} {r['bits']:>4} {r['encode_ms']:>10.3f} {r['decode_ms']:>10.3f} {alone}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    record = {"threads": torch.get_num_threads(), "compiled_loops": compiled, "updates": rows}
    out.write_text(json.dumps(record, indent=2))
    print(f"wrote {out}", file=sys.stderr)
    return 0


#: ``--generated``: the blocks its kernels run on, (name, rows, cols).
GENERATED_BLOCKS = (("1,000,000 x 64 block", 1_000_000, 64), ("stage-0 weight, 32 x 2325", 32, 2325))


def _ranges_ops(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's fp16 range rounded outward: the torch ops ``native.row_ranges`` stands for
    (``quantize._row_ranges`` on finite rows in range)."""
    mn, mx = torch.aminmax(x, dim=1)
    mn, mx = mn + 0.0, mx + 0.0
    out = []
    for values, down in ((mn, True), (mx, False)):
        half = values.to(torch.float16)
        bad = half.float() > values if down else half.float() < values
        toward = torch.full_like(half, float("-inf") if down else float("inf"))
        out.append(torch.where(bad, torch.nextafter(half, toward), half))
    return out[0], out[1]


def _codes_ops(
    x: torch.Tensor, table: torch.Tensor, shift: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor
) -> torch.Tensor:
    """8-bit codes with their scales: the torch ops ``native.row_scales`` and ``native.quantize``
    stand for (``quantize._scales`` and ``_group_codes``); row ``i`` reads dither row ``i mod
    block``."""
    levels = 255.0
    step = (hi.float() - lo.float()) / levels
    inv = torch.where(step > 0, 1.0 / step.clamp_min(torch.finfo(torch.float32).tiny), 0.0)
    offset = lo.float() * inv
    rows = torch.arange(x.shape[0], device=x.device)
    u = torch.add(table[rows % table.shape[0]], shift[:, None]).frac()
    v = torch.mul(x, inv[:, None]).add(u).sub(offset[:, None])
    return v.clamp(0.0, levels).to(torch.uint8)


def _loop_codes(
    x: torch.Tensor, table: torch.Tensor, shift: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor
) -> torch.Tensor:
    """8-bit codes with their scales, by the compiled loops."""
    return native.quantize(x, table, shift, *native.row_scales(lo, hi, 255.0), 255.0)


def _decode_ops(codes: torch.Tensor, lo: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """Rows from 8-bit codes: the torch ops ``native.dequantize`` stands for."""
    return torch.mul(codes.float(), step[:, None]).add(lo[:, None])


def generated(args: argparse.Namespace) -> int:
    """``--generated``: the row codec's three loops against the same torch ops compiled by
    ``torch.compile`` and uncompiled, per block of :data:`GENERATED_BLOCKS`; each generated
    output compared with the loop's bit for bit."""
    if not native.usable(torch.zeros(1)):
        print(
            "the compiled loops are not built here: nothing to compare generated code with", file=sys.stderr
        )
        return 1
    import torch._inductor.config as inductor_config

    # Inductor may elide a float32 -> fp16 -> float32 round trip unless told to emulate the casts:
    # the ranges' outward step needs the fp16 value. Exact-eager mode, for the comparison.
    inductor_config.emulate_precision_casts = True
    fp16 = RANGE_DTYPES["fp16"]
    rows = []
    for block_name, k, d in GENERATED_BLOCKS:
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(k, d, generator=gen)
        block = max(1, min(k, (1 << 20) // d))
        table, shift = torch.rand(block, d, generator=gen), torch.rand(k, generator=gen)
        lo, hi = native.row_ranges(x, fp16)
        inv, offset = native.row_scales(lo, hi, 255.0)
        codes = native.quantize(x, table, shift, inv, offset, 255.0).view(k, d)
        step = (hi.float() - lo.float()) / 255.0
        kernels = (
            ("fp16 ranges", functools.partial(native.row_ranges, x, fp16), _ranges_ops, (x,)),
            (
                "8-bit codes",
                functools.partial(_loop_codes, x, table, shift, lo, hi),
                _codes_ops,
                (x, table, shift, lo, hi),
            ),
            (
                "8-bit decode",
                functools.partial(native.dequantize, codes, lo.float(), step),
                _decode_ops,
                (codes, lo.float(), step),
            ),
        )
        for name, loop, ops, inputs in kernels:
            torch._dynamo.reset()
            compiled_ops = torch.compile(ops, dynamic=False)
            t0 = time.perf_counter()
            out = compiled_ops(*inputs)
            compile_s = time.perf_counter() - t0
            want = loop()
            got = out if isinstance(out, tuple) else (out,)
            want = want if isinstance(want, tuple) else (want,)
            equal = all(torch.equal(g.reshape(-1), w.reshape(-1)) for g, w in zip(got, want, strict=True))
            row = {"block": block_name, "kernel": name, "rows": k, "cols": d, "generated_equal": equal}
            for label, fn in (
                ("loops", loop),
                ("generated", lambda f=compiled_ops, i=inputs: f(*i)),
                ("torch_ops", lambda f=ops, i=inputs: f(*i)),
            ):
                calls = 3 if k * d > 1 << 22 else args.calls
                row[f"{label}_ms"] = _per_call(fn, calls, args.repeats) * 1e3
            row["compile_s"] = compile_s
            rows.append(row)
    head = (
        f"{'block':<26} {'kernel':<13} {'loops ms':>9} {'generated ms':>13} {'torch ops ms':>13} "
        f"{'gen / loops':>11} {'equal':>6} {'compile s':>10}"
    )
    print(
        "the row codec's loops against torch.compile's code for the same ops, CPU, "
        f"{torch.get_num_threads()} threads"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        print(
            f"{r['block']:<26} {r['kernel']:<13} {r['loops_ms']:>9.3f} {r['generated_ms']:>13.3f} "
            f"{r['torch_ops_ms']:>13.3f} {r['generated_ms'] / r['loops_ms']:>10.2f}x "
            f"{r['generated_equal']!s:>6} {r['compile_s']:>10.1f}"
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {"threads": torch.get_num_threads(), "torch": torch.__version__, "kernels": rows}, indent=2
        )
    )
    print(f"wrote {out}", file=sys.stderr)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--cols", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", default="bench/results/codec.json")
    parser.add_argument("--updates", action="store_true", help="a small client's model updates instead")
    parser.add_argument("--calls", type=int, default=200, help="--updates, --generated: calls a timing")
    parser.add_argument(
        "--generated", action="store_true", help="the loops against torch.compile's code for the same ops"
    )
    args = parser.parse_args()
    if args.updates:
        return updates(args)
    if args.generated:
        return generated(args)
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
