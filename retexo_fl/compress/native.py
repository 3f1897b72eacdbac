"""Fused CPU loops for the row codec and dropout masks, compiled from C on first use, with torch
ops as the fallback.

Encoding a row block in torch ops takes about seven passes over it (extremes, dither, scale,
offset, clamp, cast), each a separate kernel. The loops below do the same arithmetic in two
passes whose rows stay in L1: one for the row extremes, one for the codes, and one for decoding.
A dropout mask (:mod:`retexo_fl.models.dropout`) is hashed and written in one pass instead of
about ten integer passes.
They are compiled with the machine's C compiler (``cc``) into a shared library, cached per user,
and called through :mod:`ctypes`, which releases the GIL, so row chunks run on
``torch.get_num_threads()`` Python threads at once.

**Same numbers either way.** The C loops perform the fallback's float32 operations in the same
order, each rounded once (compiled with ``-ffp-contract=off``, so no fused multiply-add), and the
fallback in :mod:`retexo_fl.compress.quantize` is written as those single operations. Codes,
ranges and decoded values are therefore bit for bit equal with and without a compiler (checked by
``tests/compress/test_native.py``), and a run is reproducible across the two.

**When the loops are not used:** on tensors that are not on the CPU, when no compiler is found
or compiling fails (logged once at debug level), on systems other than POSIX ones, and when
``RETEXO_FL_NATIVE=0``; the loops that compute with floats (not the dropout mask, which only
writes two constants) also not while torch flushes denormals (``torch.set_flush_denormal(True)``,
which the loops' threads do not follow: each turns flushing off when it starts).

**Where the library is kept, and why it is trusted.** In ``$RETEXO_FL_KERNEL_CACHE``, else
``$XDG_CACHE_HOME/retexo-fl/kernels``, else ``~/.cache/retexo-fl/kernels``, named by a digest of
the source, the compiler and the CPU's flags. A library loaded from there runs as the user's
code, so it is loaded from there only if the folder is the user's and nobody else can write to
it, every folder above it belongs to the user or root and is writable by nobody else or sticky,
and the file itself is a regular file of the user's that nobody else can write (opened without
following links and checked). A file that fails is built over;
a folder that fails is not used: the library is built in a private temporary folder, loaded,
and the folder removed.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import stat
import subprocess
import tempfile
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from torch import Tensor

log = logging.getLogger(__name__)

NATIVE_ENV = "RETEXO_FL_NATIVE"
CACHE_ENV = "RETEXO_FL_KERNEL_CACHE"
# A loop's work, in its values times their cost (:func:`_over_rows`), from which its rows are
# split across the pool. Handing chunks to the pool and waiting on them costs about 90 us on
# 2 cores (Python futures, a wake-up per thread); the split pays once one thread would take about
# twice that. Measured single thread against the pool (2 threads, 2026-11-30): a dropout mask at
# 2^19 values 98 against 132 us, 2^20 189 against 173; fp16 ranges 2^18 113 / 128, 2^19 213 /
# 201; 8-bit codes 2^20 186 / 202, 2^21 370 / 309; decoding 2^21 206 / 212, 2^22 767 / 466. Each
# loop's cost puts its split between the last size where one thread won and the first where the
# pool did.
_PARALLEL_WORK = 1 << 20

SOURCE = r"""
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* lo[i], hi[i]: the extremes of row i of a [k, d] float32 block; bad[i] = 1 when the row holds
   NaN or Inf (read from the exponent bits, so the finite-math hint below cannot hide them). */
__attribute__((optimize("finite-math-only", "no-signed-zeros")))
void row_extremes(const float *x, int64_t k, int64_t d, float *lo, float *hi, uint8_t *bad) {
    for (int64_t i = 0; i < k; ++i) {
        const float *r = x + i * d;
        const uint32_t *u = (const uint32_t *)r;
        float mn = r[0], mx = r[0];
        uint32_t nonfinite = 0;
        for (int64_t j = 0; j < d; ++j) {
            float v = r[j];
            mn = v < mn ? v : mn;
            mx = v > mx ? v : mx;
            nonfinite |= (uint32_t)((u[j] & 0x7f800000u) == 0x7f800000u);
        }
        lo[i] = mn;
        hi[i] = mx;
        bad[i] = (uint8_t)nonfinite;
    }
}

/* Half-precision bits of a finite float, rounded to nearest even (an overflow gives inf), as
   torch's casts round: fp16 after F. Giesen's float_to_half_fast3_rtne, bf16 by the carry trick.
   The subnormal fp16 path rounds with one float addition, which needs denormals kept (usable()). */
static uint16_t to_half(float f, int bf16) {
    uint32_t x;
    memcpy(&x, &f, 4);
    if (bf16) return (uint16_t)((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
    const uint32_t sign = x & 0x80000000u;
    x ^= sign;
    uint16_t o;
    if (x >= (127u + 16u) << 23) {
        o = 0x7c00u;
    } else if (x < 113u << 23) {
        const uint32_t magic_u = ((127u - 15u) + (23u - 10u) + 1u) << 23;
        float magic, v;
        memcpy(&magic, &magic_u, 4);
        memcpy(&v, &x, 4);
        v += magic;
        uint32_t r;
        memcpy(&r, &v, 4);
        o = (uint16_t)(r - magic_u);
    } else {
        const uint32_t odd = (x >> 13) & 1u;
        x += ((uint32_t)(15 - 127) << 23) + 0xfffu + odd;
        o = (uint16_t)(x >> 13);
    }
    return (uint16_t)(o | (sign >> 16));
}

/* The float a half's bits stand for (exact). */
static float from_half(uint16_t h, int bf16) {
    uint32_t o;
    float f;
    if (bf16) {
        o = (uint32_t)h << 16;
    } else {
        const uint32_t exp_mask = 0x7c00u << 13;
        o = (uint32_t)(h & 0x7fffu) << 13;
        const uint32_t e = o & exp_mask;
        o += (127u - 15u) << 23;
        if (e == exp_mask) {
            o += (128u - 16u) << 23;
        } else if (e == 0) {
            const uint32_t magic_u = 113u << 23;
            float magic;
            memcpy(&magic, &magic_u, 4);
            o += 1u << 23;
            memcpy(&f, &o, 4);
            f -= magic;
            memcpy(&o, &f, 4);
        }
        o |= (uint32_t)(h & 0x8000u) << 16;
    }
    memcpy(&f, &o, 4);
    return f;
}

/* The next half toward -inf (down) or +inf, on the sign-magnitude bits, as torch.nextafter. */
static uint16_t half_step(uint16_t h, int down) {
    if (down) return h == 0x0000u ? 0x8001u : (h & 0x8000u) ? (uint16_t)(h + 1u) : (uint16_t)(h - 1u);
    return h == 0x8000u ? 0x0001u : (h & 0x8000u) ? (uint16_t)(h - 1u) : (uint16_t)(h + 1u);
}

static int half_finite(uint16_t h, int bf16) {
    return bf16 ? (h & 0x7f80u) != 0x7f80u : (h & 0x7c00u) != 0x7c00u;
}

/* Each row's range in fp16 / bf16 bits, rounded outward (lo toward -inf, hi toward +inf) from
   its extremes, -0.0 taken as 0.0: what quantize.py's torch ops give. status[i] is 0 for a row
   that can be coded, 1 for NaN / Inf in it, 2 for a range the half dtype cannot hold, 3 for a
   span float32 cannot step across; the caller leaves any row not 0 to the torch checks, which
   name its fault. */
void row_ranges(const float *x, int64_t k, int64_t d, int bf16, uint16_t *lo, uint16_t *hi,
                uint8_t *status) {
    /* The extremes of a chunk of rows in one call (not inlined: it is compiled with other
       flags), then their ranges: a call a row cost more than the row's values on short rows. */
    enum { CHUNK = 256 };
    float mns[CHUNK], mxs[CHUNK];
    uint8_t bads[CHUNK];
    for (int64_t i = 0; i < k; ++i) {
        if (i % CHUNK == 0) {
            const int64_t n = k - i < CHUNK ? k - i : CHUNK;
            row_extremes(x + i * d, n, d, mns, mxs, bads);
        }
        float mn = mns[i % CHUNK], mx = mxs[i % CHUNK];
        const uint8_t bad = bads[i % CHUNK];
        lo[i] = hi[i] = 0;
        if (bad) {
            status[i] = 1;
            continue;
        }
        if (mn == 0.0f) mn = 0.0f;
        if (mx == 0.0f) mx = 0.0f;
        uint16_t l = to_half(mn, bf16), h = to_half(mx, bf16);
        if (from_half(l, bf16) > mn) l = half_step(l, 1);
        if (from_half(h, bf16) < mx) h = half_step(h, 0);
        lo[i] = l;
        hi[i] = h;
        if (!half_finite(l, bf16) || !half_finite(h, bf16)) {
            status[i] = 2;
            continue;
        }
        const float span = from_half(h, bf16) - from_half(l, bf16);
        uint32_t span_bits;
        memcpy(&span_bits, &span, 4);  /* from the exponent bits: no compiler flag can hide Inf */
        status[i] = (uint8_t)((span_bits & 0x7f800000u) == 0x7f800000u ? 3 : 0);
    }
}

/* inv[i] = 1 / step (0 where step is 0) and offset[i] = lo * inv[i] of rows ranged [lo, hi] (half
   bits) at levels + 1 codes, step = (hi - lo) / levels: quantize.py's _scales, one rounding an
   operation. */
void row_scales(const uint16_t *lo, const uint16_t *hi, int64_t k, int bf16, float levels, float *inv,
                float *offset) {
    const float tiny = 1.17549435e-38f;
    for (int64_t i = 0; i < k; ++i) {
        const float l = from_half(lo[i], bf16), h = from_half(hi[i], bf16);
        const float step = (h - l) / levels;
        const float r = 1.0f / (step < tiny ? tiny : step);
        inv[i] = step > 0.0f ? r : 0.0f;
        offset[i] = l * inv[i];
    }
}

/* Rows [r0, r1) of a [k, d] block coded at one width of bits (1, 2, 4 or 8), packed densely
   (pack()'s layout), decoded: out[i, j] = lo + code * step, step = (hi - lo) / levels, from the
   rows' half ranges; unpack(), the ranges' float casts and dequantize() in one pass, one rounding
   an operation. */
#define UNPACK_SPAN(BITS)                                                          \
    for (int64_t b = b0; b < b1; ++b) {                                            \
        const uint32_t v = packed[b];                                              \
        for (int t = 0; t < 8 / BITS; ++t)                                         \
            buf[(b - b0) * (8 / BITS) + t] = (uint8_t)((v >> (t * BITS)) & ((1u << BITS) - 1u)); \
    }
int dequantize_packed(const uint8_t *packed, int bits, int64_t r0, int64_t r1, int64_t d,
                      const uint16_t *lo, const uint16_t *hi, int bf16, float levels, float *out) {
    const int64_t per = 8 / bits, e0 = r0 * d, e1 = r1 * d;
    const uint8_t *codes = packed + e0;
    uint8_t *buf = NULL;
    if (bits != 8) { /* the span's whole bytes unpacked first: two loops that vectorize */
        const int64_t b0 = e0 / per, b1 = (e1 + per - 1) / per;
        buf = (uint8_t *)malloc((size_t)((b1 - b0) * per + 1));  /* + 1: never malloc(0) */
        if (buf == NULL) return -1;
        if (bits == 4) { UNPACK_SPAN(4) } else if (bits == 2) { UNPACK_SPAN(2) } else { UNPACK_SPAN(1) }
        codes = buf + (e0 - b0 * per);
    }
    for (int64_t i = r0; i < r1; ++i) {
        const float l = from_half(lo[i], bf16), h = from_half(hi[i], bf16);
        const float s = (h - l) / levels;
        const uint8_t *c = codes + (i - r0) * d;
        float *o = out + i * d;
        for (int64_t j = 0; j < d; ++j) {
            float v = (float)c[j] * s;
            o[j] = l + v;
        }
    }
    free(buf);
    return 0;
}

/* codes[i, j] = (uint8) clamp(frac(table[(row0 + i) % block, j] + shift[i]) + x[i, j] * inv[i]
                               - offset[i], 0, levels), one rounding per operation. */
void quantize(const float *x, int64_t k, int64_t d, int64_t row0, const float *table,
              int64_t block, const float *shift, const float *inv, const float *offset,
              float levels, uint8_t *codes) {
    for (int64_t i = 0; i < k; ++i) {
        const float *r = x + i * d;
        const float *t = table + ((row0 + i) % block) * d;
        const float s = shift[i], a = inv[i], o = offset[i];
        uint8_t *c = codes + i * d;
        for (int64_t j = 0; j < d; ++j) {
            float u = t[j] + s;
            u = u - (float)(int32_t)u;       /* frac: u is in [0, 2) */
            float v = r[j] * a;
            v = u + v;
            v = v - o;
            v = v < 0.0f ? 0.0f : v;
            v = v > levels ? levels : v;
            c[j] = (uint8_t)(int32_t)v;      /* truncation is the floor: v >= 0 */
        }
    }
}

/* Bytes [b0, b1) of n codes < 2^bits packed densely, the first code in the low bits. The loop
   is written once per width so that its inner loop has a constant trip count and unrolls. */
#define PACK_LOOP(BITS)                                                            \
    for (int64_t b = b0; b < b1; ++b) {                                            \
        uint32_t v = 0;                                                            \
        if ((b + 1) * (8 / BITS) <= n) {                                           \
            for (int i = 0; i < 8 / BITS; ++i)                                     \
                v |= (uint32_t)codes[b * (8 / BITS) + i] << (i * BITS);            \
        } else {                                                                   \
            for (int i = 0; b * (8 / BITS) + i < n; ++i)                           \
                v |= (uint32_t)codes[b * (8 / BITS) + i] << (i * BITS);            \
        }                                                                          \
        out[b] = (uint8_t)v;                                                       \
    }
void pack(const uint8_t *codes, int64_t n, int64_t b0, int64_t b1, int bits, uint8_t *out) {
    if (bits == 1) { PACK_LOOP(1) } else if (bits == 2) { PACK_LOOP(2) } else { PACK_LOOP(4) }
}

/* Codes of bytes [b0, b1) of a packed block, (8 / bits) per byte, into codes[b0 * 8 / bits...]. */
#define UNPACK_LOOP(BITS)                                                          \
    for (int64_t b = b0; b < b1; ++b) {                                            \
        const uint32_t v = packed[b];                                              \
        for (int i = 0; i < 8 / BITS; ++i)                                         \
            codes[b * (8 / BITS) + i] = (uint8_t)((v >> (i * BITS)) & ((1u << BITS) - 1u)); \
    }
void unpack(const uint8_t *packed, int64_t b0, int64_t b1, int bits, uint8_t *codes) {
    if (bits == 1) { UNPACK_LOOP(1) } else if (bits == 2) { UNPACK_LOOP(2) } else { UNPACK_LOOP(4) }
}

/* out[i, j] = lo[i] + codes[i, j] * step[i], one rounding per operation. */
void dequantize(const uint8_t *codes, int64_t k, int64_t d, const float *lo, const float *step,
                float *out) {
    for (int64_t i = 0; i < k; ++i) {
        const uint8_t *c = codes + i * d;
        float *o = out + i * d;
        const float l = lo[i], s = step[i];
        for (int64_t j = 0; j < d; ++j) {
            float v = (float)c[j] * s;
            o[j] = l + v;
        }
    }
}

/* A dropout mask's elements [4 w0, min(4 w1, n)): element 4 w + j takes the 16-bit lane j (bits
   16 j to 16 j + 15, read as a signed value s) of splitmix64's output for the counter
   key + (w + 1) * golden, and is scale when s >= lo, else 0. */
static inline uint64_t mask_word(uint64_t key, int64_t w) {
    uint64_t z = key + (uint64_t)(w + 1) * 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}
#define LANE(z, j) ((int32_t)(int16_t)(uint16_t)((z) >> (16 * (j))) >= lo ? scale : 0.0f)

/* Whole words are written out four lanes at a time, no count, one loop for the mask and one for
   the product, no branch inside: such loops vectorize (20x a loop with a count or a branch); the
   last, partly used word goes lane by lane. */
void dropout_mask(const int64_t *key, int64_t w0, int64_t w1, int64_t n, int32_t lo, float scale,
                  float *out) {
    const uint64_t k = (uint64_t)key[0];
    const int64_t whole = n / 4 < w1 ? n / 4 : w1;
    for (int64_t w = w0; w < whole; ++w) {
        const uint64_t z = mask_word(k, w);
        float *o = out + 4 * w;
        o[0] = LANE(z, 0); o[1] = LANE(z, 1); o[2] = LANE(z, 2); o[3] = LANE(z, 3);
    }
    for (int64_t w = whole > w0 ? whole : w0; w < w1; ++w) {
        const uint64_t z = mask_word(k, w);
        for (int64_t e = 4 * w, j = 0; e + j < n && j < 4; ++j) out[e + j] = LANE(z, j);
    }
}

/* out[e] = x[e] * m[e] for dropout_mask's m, the mask never written: one multiply each, as
   torch's x * m. */
void dropout_apply(const float *x, const int64_t *key, int64_t w0, int64_t w1, int64_t n,
                   int32_t lo, float scale, float *out) {
    const uint64_t k = (uint64_t)key[0];
    const int64_t whole = n / 4 < w1 ? n / 4 : w1;
    for (int64_t w = w0; w < whole; ++w) {
        const uint64_t z = mask_word(k, w);
        const float *i = x + 4 * w;
        float *o = out + 4 * w;
        o[0] = i[0] * LANE(z, 0); o[1] = i[1] * LANE(z, 1);
        o[2] = i[2] * LANE(z, 2); o[3] = i[3] * LANE(z, 3);
    }
    for (int64_t w = whole > w0 ? whole : w0; w < w1; ++w) {
        const uint64_t z = mask_word(k, w);
        for (int64_t e = 4 * w, j = 0; e + j < n && j < 4; ++j) out[e + j] = x[e + j] * LANE(z, j);
    }
}

/* Whether the calling thread flushes denormals (torch.set_flush_denormal sets it there): 1 or 0,
   -1 where this is not known. keep_denormals() turns flushing off in the calling thread: each
   pool thread calls it when it starts, since a new thread takes on the mode of the thread that
   started it, and a pool started while torch flushed would flush for good. */
#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
int denormals_flushed(void) { return (_mm_getcsr() & 0x8040u) != 0; }
void keep_denormals(void) { _mm_setcsr(_mm_getcsr() & ~0x8040u); }
#elif defined(__aarch64__)
int denormals_flushed(void) {
    uint64_t fpcr;
    __asm__ volatile("mrs %0, fpcr" : "=r"(fpcr));
    return (int)((fpcr >> 24) & 1u);
}
void keep_denormals(void) {
    uint64_t fpcr;
    __asm__ volatile("mrs %0, fpcr" : "=r"(fpcr));
    fpcr &= ~((uint64_t)1 << 24);
    __asm__ volatile("msr fpcr, %0" : : "r"(fpcr));
}
#else
int denormals_flushed(void) { return -1; }
void keep_denormals(void) {}
#endif
"""

# -ffp-contract=off: no fused multiply-add, so each operation rounds once, as torch's do.
# -fno-strict-aliasing: row_extremes reads the floats' bits through a uint32_t pointer.
_FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fno-strict-aliasing", "-fPIC", "-shared")

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False
_pool: ThreadPoolExecutor | None = None
_pool_threads = 0


def _after_fork_in_child() -> None:
    # A forked child inherits the executor but not its threads (submitting would hang), and a
    # lock another thread held at the fork stays held forever: both start afresh.
    global _pool, _lock
    _pool = None
    _lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return os.uname().machine


def _trusted_folder(folder: Path) -> bool:
    """Whether only this user (and root) can change what ``folder`` holds.

    The folder must be the user's own and writable by nobody else; every folder above it must
    belong to the user or root and be writable by nobody else, or be sticky (``/tmp``), so that
    no one can swap a component of the path between this check and the load. No component may be
    a symbolic link: a link's target is decided by whoever owns the folder the link is in, and
    can change between this check and the load.
    """
    path = Path(os.path.abspath(folder))
    for part in (path, *path.parents):
        if stat.S_ISLNK(os.lstat(part).st_mode):
            return False
    real = folder.resolve()
    uid = os.getuid()
    st = real.stat()
    if st.st_uid != uid or st.st_mode & 0o022:
        return False
    for parent in real.parents:
        st = parent.stat()
        if st.st_uid not in (uid, 0) or (st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX):
            return False
    return True


def _open_trusted(path: Path) -> int | None:
    """A descriptor of ``path`` if it is a regular file of this user's that nobody else can write."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o022:
        os.close(fd)
        return None
    return fd


def cache_folder() -> Path:
    """Where compiled loops are kept: ``$RETEXO_FL_KERNEL_CACHE``, else the user's cache folder."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "retexo-fl" / "kernels"


def _build(cc: str, folder: Path) -> Path:
    """Compile :data:`SOURCE` into ``folder`` (once: the name is a digest) and return the library.

    A file of that name that is not the user's own, or that others can write, is built over.
    """
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    digest = hashlib.sha256("\0".join([SOURCE, cc, version, " ".join(_FLAGS), _cpu_flags()]).encode())
    target = folder / f"rows-{digest.hexdigest()[:16]}.so"
    fd = _open_trusted(target)
    if fd is not None:
        os.close(fd)
        return target
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        src = Path(tmp) / "rows.c"
        src.write_text(SOURCE)
        built = Path(tmp) / "rows.so"
        done = subprocess.run(
            [cc, *_FLAGS, str(src), "-o", str(built)], capture_output=True, text=True, timeout=120
        )
        if done.returncode != 0:
            raise OSError(f"{cc} failed: {done.stderr.strip()[:500]}")
        os.chmod(built, 0o700)
        os.replace(built, target)  # atomic: processes compiling at once each land a whole file
    return target


def _open_library(path: Path) -> ctypes.CDLL:
    """Load ``path``, a file of this user's that nobody else can write, in a trusted folder.

    Loaded by its path, not through ``/proc/self/fd``: the loader takes a name it has loaded
    before for that library, and descriptor numbers are reused. The folders above it being
    trusted, nobody else can swap the file between the check and the load.
    """
    fd = _open_trusted(path)
    if fd is None:
        raise OSError(f"{path} is not a file of this user's that only this user can write")
    os.close(fd)
    return ctypes.CDLL(str(path))


def _load() -> ctypes.CDLL | None:
    cc = _compiler()
    if cc is None or not hasattr(os, "getuid"):
        log.debug("native row codec: no C compiler found (or not a POSIX system); using torch ops")
        return None
    folder = cache_folder()
    try:
        try:
            folder.mkdir(parents=True, exist_ok=True, mode=0o700)
            trusted = _trusted_folder(folder)
        except OSError:  # a cache folder this user cannot make: build in a temp folder
            trusted = False
        if trusted:
            lib = _open_library(_build(cc, folder))
        else:
            log.debug("native row codec: %s is not this user's alone; building in a temp folder", folder)
            with tempfile.TemporaryDirectory(prefix="retexo-fl-kernels-") as tmp:
                lib = _open_library(_build(cc, Path(tmp)))  # loaded, the file can go
    except (OSError, subprocess.SubprocessError) as err:
        log.debug("native row codec unavailable (%s); using torch ops", err)
        return None
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.row_extremes.argtypes = [p, i64, i64, p, p, p]
    lib.row_ranges.argtypes = [p, i64, i64, ctypes.c_int, p, p, p]
    lib.row_scales.argtypes = [p, p, i64, ctypes.c_int, ctypes.c_float, p, p]
    lib.dequantize_packed.argtypes = [p, ctypes.c_int, i64, i64, i64, p, p, ctypes.c_int, ctypes.c_float, p]
    lib.dequantize_packed.restype = ctypes.c_int
    lib.quantize.argtypes = [p, i64, i64, i64, p, i64, p, p, p, ctypes.c_float, p]
    lib.dequantize.argtypes = [p, i64, i64, p, p, p]
    lib.pack.argtypes = [p, i64, i64, i64, ctypes.c_int, p]
    lib.unpack.argtypes = [p, i64, i64, ctypes.c_int, p]
    lib.dropout_mask.argtypes = [p, i64, i64, i64, ctypes.c_int32, ctypes.c_float, p]
    lib.dropout_apply.argtypes = [p, p, i64, i64, i64, ctypes.c_int32, ctypes.c_float, p]
    lib.denormals_flushed.argtypes = []
    lib.denormals_flushed.restype = ctypes.c_int
    lib.keep_denormals.argtypes = []
    lib.keep_denormals.restype = None
    for fn in (
        lib.row_extremes,
        lib.row_ranges,
        lib.row_scales,
        lib.quantize,
        lib.dequantize,
        lib.pack,
        lib.unpack,
        lib.dropout_mask,
        lib.dropout_apply,
    ):
        fn.restype = None
    return lib


def library() -> ctypes.CDLL | None:
    """The compiled loops, or ``None`` when they are switched off or cannot be built."""
    global _lib, _tried
    if os.environ.get(NATIVE_ENV, "1") == "0":
        return None
    with _lock:
        if not _tried:
            _lib = _load()
            _tried = True  # after _lib: _required() reads _lib without the lock once this is set
    return _lib


def _flushing_denormals() -> bool:
    # torch.set_flush_denormal(True) flushes in torch's threads, not in the pool's: results
    # would then differ in rows with denormal values, so the torch ops serve. The control
    # register is read where it can be (a tenth of a tensor operation and its read-back).
    lib = _lib if _tried else None
    flag = lib.denormals_flushed() if lib is not None else -1
    return bool(flag) if flag >= 0 else bool(_DENORMAL.mul(1.0).item() == 0.0)


_DENORMAL = torch.tensor(1e-40)


def usable(*tensors: Tensor) -> bool:
    """Whether the compiled loops can serve these tensors.

    They can when every tensor is on the CPU, the loops are built, and torch does not flush
    denormals (``torch.set_flush_denormal``), which the loops' threads would not follow.
    """
    on_cpu = all(t.device.type == "cpu" for t in tensors)
    return on_cpu and library() is not None and not _flushing_denormals()


def _pool_thread_start() -> None:
    # The loops are used only while the caller does not flush denormals (usable(),
    # denormals_flushed()); a thread started while it did would have taken the mode on.
    lib = _lib if _tried else library()  # started by a loop call: the switch was read then
    if lib is not None:
        lib.keep_denormals()


def _over_rows(k: int, d: int, run: Callable[[int, int], None], cost: float = 1.0) -> None:
    """Call ``run(start, stop)`` on row chunks, on up to ``torch.get_num_threads()`` threads.

    Args:
        k (int): rows.
        d (int): values a row.
        run (Callable[[int, int], None]): the loop over rows ``[start, stop)``.
        cost (float, optional): a value's time in the loop against a dropout mask's (about
            0.18 ns on these machines): the rows are split once ``k * d * cost`` reaches
            :data:`_PARALLEL_WORK`. (default: :obj:`1.0`)
    """
    global _pool, _pool_threads
    threads = max(1, torch.get_num_threads())
    if threads == 1 or k * d * cost < _PARALLEL_WORK or k < 2:
        run(0, k)
        return
    with _lock:
        if _pool is None or _pool_threads != threads:
            _pool = ThreadPoolExecutor(
                threads, thread_name_prefix="retexo-rows", initializer=_pool_thread_start
            )
            _pool_threads = threads
        pool = _pool
    chunk = -(-k // threads)
    for future in [pool.submit(run, s, min(k, s + chunk)) for s in range(0, k, chunk)]:
        future.result()


def _required() -> ctypes.CDLL:
    # The loaded library as it is, without reading the switch again: a caller reaches the loops
    # only after usable() or library() said yes, and a codec call makes dozens of these (the
    # environment lookup was 6% of a small client's round).
    lib = _lib if _tried else library()
    if lib is None:
        raise RuntimeError("the compiled loops are not available here; check library() first")
    return lib


def _ptr(t: Tensor, offset: int = 0) -> int:
    return t.data_ptr() + offset * t.element_size()


def _per_row(k: int, **vectors: Tensor) -> list[Tensor]:
    """Contiguous float32 CPU copies (or views) of per-row vectors, each checked to hold ``k`` values."""
    out = []
    for name, v in vectors.items():
        if v.device.type != "cpu" or v.numel() != k:
            raise ValueError(f"{name}: {v.numel()} values on {v.device}, expected {k} on the CPU")
        out.append(v.contiguous().float().view(-1))
    return out


def _cpu_block(t: Tensor, dtype: torch.dtype, name: str) -> Tensor:
    if t.device.type != "cpu" or t.dtype != dtype or t.dim() != 2:
        raise ValueError(f"{name}: expected a 2-D {dtype} CPU block, got {t.dim()}-D {t.dtype} on {t.device}")
    return t.contiguous()


def row_extremes(x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Each row's minimum and maximum, and whether it holds NaN or Inf.

    Args:
        x (Tensor): a float32 CPU block.

    Shapes:
        - **input:** ``[k, d]``, ``d >= 1``
        - **output:** ``[k]`` float32, ``[k]`` float32, ``[k]`` bool
    """
    lib = _required()
    x = _cpu_block(x, torch.float32, "rows")
    k, d = x.shape
    if d == 0:
        raise ValueError(f"row extremes need rows of one value or more, got shape {tuple(x.shape)}")
    lo, hi = torch.empty(k), torch.empty(k)
    bad = torch.empty(k, dtype=torch.uint8)

    def run(s: int, e: int) -> None:
        lib.row_extremes(_ptr(x, s * d), e - s, d, _ptr(lo, s), _ptr(hi, s), _ptr(bad, s))

    _over_rows(k, d, run, cost=0.5)
    return lo, hi, bad.bool()


def row_ranges(x: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor] | None:
    """Each row's ``[lo, hi]`` in ``dtype`` (``float16`` or ``bfloat16``), rounded outward from its
    extremes, in one pass: the ranges ``quantize.py``'s torch ops give, or ``None`` when a row
    holds NaN / Inf or a range ``dtype`` (or a float32 step) cannot hold. The torch ops then take
    the block, to name the fault or widen it to bf16.

    Args:
        x (Tensor): a float32 CPU block.
        dtype (torch.dtype): ``torch.float16`` or ``torch.bfloat16``.

    Shapes:
        - **input:** ``[k, d]``, ``d >= 1``
        - **output:** ``[k]`` ``dtype``, ``[k]`` ``dtype``
    """
    lib = _required()
    if dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"row ranges: dtype must be float16 or bfloat16, got {dtype}")
    x = _cpu_block(x, torch.float32, "rows")
    k, d = x.shape
    if d == 0:
        raise ValueError(f"row ranges need rows of one value or more, got shape {tuple(x.shape)}")
    lo, hi = torch.empty(k, dtype=torch.int16), torch.empty(k, dtype=torch.int16)
    status = torch.empty(k, dtype=torch.uint8)
    bf16 = int(dtype == torch.bfloat16)

    def run(s: int, e: int) -> None:
        lib.row_ranges(_ptr(x, s * d), e - s, d, bf16, _ptr(lo, s), _ptr(hi, s), _ptr(status, s))

    _over_rows(k, d, run, cost=2.0)
    if bool(status.any()):
        return None
    return lo.view(dtype), hi.view(dtype)


def row_scales(lo: Tensor, hi: Tensor, levels: float) -> tuple[Tensor, Tensor]:
    """``(inv, offset)`` of rows ranged ``[lo, hi]`` at ``levels + 1`` codes: ``1 / step`` (0 where
    the step is 0) and ``lo / step``, with ``step = (hi - lo) / levels``, as
    ``quantize.py``'s torch ops compute them.

    Args:
        lo (Tensor): each row's lower end, float16 or bfloat16 on the CPU.
        hi (Tensor): each row's upper end, of ``lo``'s dtype.
        levels (float): the largest code, ``2^bits - 1``.

    Shapes:
        - **input:** ``lo``, ``hi`` ``[k]``
        - **output:** ``[k]`` float32, ``[k]`` float32
    """
    lib = _required()
    if lo.dtype not in (torch.float16, torch.bfloat16) or hi.dtype != lo.dtype or lo.shape != hi.shape:
        raise ValueError(f"row scales: expected [k] float16 or bfloat16 ranges, got {lo.dtype}, {hi.dtype}")
    if lo.device.type != "cpu" or hi.device.type != "cpu":
        raise ValueError("row scales: the ranges must be on the CPU")
    lo, hi = lo.contiguous().view(-1), hi.contiguous().view(-1)
    k = lo.numel()
    inv, offset = torch.empty(k), torch.empty(k)
    lib.row_scales(_ptr(lo), _ptr(hi), k, int(lo.dtype == torch.bfloat16), levels, _ptr(inv), _ptr(offset))
    return inv, offset


def quantize(x: Tensor, table: Tensor, shift: Tensor, inv: Tensor, offset: Tensor, levels: float) -> Tensor:
    """uint8 codes of a block, with the dither ``frac(table[i % block] + shift[i])``.

    Args:
        x (Tensor): a float32 CPU block.
        table (Tensor): the dither table, float32 ``[block, d]``.
        shift (Tensor): one dither shift per row.
        inv (Tensor): one ``1 / step`` per row (0 for a constant row).
        offset (Tensor): one ``lo / step`` per row.
        levels (float): the largest code, ``2^bits - 1``.

    Shapes:
        - **input:** ``x`` ``[k, d]``; ``shift``, ``inv``, ``offset`` ``[k]`` float32
        - **output:** ``[k, d]`` uint8
    """
    lib = _required()
    x, table = _cpu_block(x, torch.float32, "rows"), _cpu_block(table, torch.float32, "table")
    k, d = x.shape
    block = table.shape[0]
    if block == 0 or table.shape[1] != d:
        raise ValueError(f"table: shape {tuple(table.shape)}, expected [block >= 1, {d}]")
    shift, inv, offset = _per_row(k, shift=shift, inv=inv, offset=offset)
    codes = torch.empty(k, d, dtype=torch.uint8)

    def run(s: int, e: int) -> None:
        lib.quantize(
            _ptr(x, s * d), e - s, d, s, _ptr(table), block,
            _ptr(shift, s), _ptr(inv, s), _ptr(offset, s), levels, _ptr(codes, s * d),
        )  # fmt: skip

    _over_rows(k, d, run, cost=0.7)
    return codes


def dequantize(codes: Tensor, lo: Tensor, step: Tensor) -> Tensor:
    """``lo[i] + codes[i, j] * step[i]`` as float32.

    Args:
        codes (Tensor): uint8 CPU codes.
        lo (Tensor): one float32 lower end per row.
        step (Tensor): one float32 step per row.

    Shapes:
        - **input:** ``codes`` ``[k, d]``; ``lo``, ``step`` ``[k]``
        - **output:** ``[k, d]`` float32
    """
    lib = _required()
    codes = _cpu_block(codes, torch.uint8, "codes")
    k, d = codes.shape
    lo, step = _per_row(k, lo=lo, step=step)
    out = torch.empty(k, d)

    def run(s: int, e: int) -> None:
        lib.dequantize(_ptr(codes, s * d), e - s, d, _ptr(lo, s), _ptr(step, s), _ptr(out, s * d))

    _over_rows(k, d, run, cost=0.35)
    return out


def dequantize_packed(packed: Tensor, bits: int, k: int, d: int, lo: Tensor, hi: Tensor) -> Tensor:
    """A ``[k, d]`` block coded at one width, packed densely (:func:`pack`), decoded from its
    rows' half ranges: :func:`unpack` and :func:`dequantize` with ``step = (hi - lo) / levels``,
    the values ``quantize.py``'s torch ops give, in one pass.

    Args:
        packed (Tensor): uint8 CPU bytes, at least ``ceil(k * d * bits / 8)`` of them.
        bits (int): 1, 2, 4 or 8.
        k (int): rows.
        d (int): columns.
        lo (Tensor): each row's lower end, float16 or bfloat16 on the CPU.
        hi (Tensor): each row's upper end, of ``lo``'s dtype.

    Shapes:
        - **input:** ``packed`` ``[m]``; ``lo``, ``hi`` ``[k]``
        - **output:** ``[k, d]`` float32
    """
    lib = _required()
    if packed.device.type != "cpu" or packed.dtype != torch.uint8 or bits not in (1, 2, 4, 8):
        raise ValueError(f"dequantize: expected uint8 CPU bytes of 1-8 bits, got {packed.dtype}, {bits} bits")
    if lo.dtype not in (torch.float16, torch.bfloat16) or hi.dtype != lo.dtype:
        raise ValueError(f"dequantize: expected float16 or bfloat16 ranges, got {lo.dtype}, {hi.dtype}")
    if lo.numel() != k or hi.numel() != k or lo.device.type != "cpu" or hi.device.type != "cpu":
        raise ValueError(f"dequantize: {lo.numel()} and {hi.numel()} ranges for {k} rows (on the CPU)")
    if packed.numel() < (k * d * bits + 7) // 8:
        raise ValueError(f"{packed.numel()} bytes hold fewer than {k * d} codes of {bits} bits")
    packed = packed.contiguous().view(-1)
    lo, hi = lo.contiguous().view(-1), hi.contiguous().view(-1)
    out = torch.empty(k, d)
    bf16, levels = int(lo.dtype == torch.bfloat16), float((1 << bits) - 1)

    def run(s: int, e: int) -> None:
        if lib.dequantize_packed(_ptr(packed), bits, s, e, d, _ptr(lo), _ptr(hi), bf16, levels, _ptr(out)):
            raise MemoryError(f"dequantize: no memory to unpack rows {s} to {e} of {k}")

    _over_rows(k, d, run, cost=0.5)
    return out


def pack(codes: Tensor, bits: int) -> Tensor:
    """Flat uint8 codes below ``2^bits`` packed densely, the first code in the low bits.

    Args:
        codes (Tensor): flat uint8 CPU codes.
        bits (int): 1, 2 or 4.

    Shapes:
        - **input:** ``[n]``
        - **output:** ``[ceil(n * bits / 8)]`` uint8
    """
    lib = _required()
    if codes.device.type != "cpu" or codes.dtype != torch.uint8 or bits not in (1, 2, 4):
        raise ValueError(f"pack: expected uint8 CPU codes of 1, 2 or 4 bits, got {codes.dtype}, {bits}")
    codes = codes.contiguous().view(-1)
    n = codes.numel()
    out = torch.empty((n * bits + 7) // 8, dtype=torch.uint8)
    _over_rows(out.numel(), 8 // bits, lambda s, e: lib.pack(_ptr(codes), n, s, e, bits, _ptr(out)), cost=4.0)
    return out


def unpack(packed: Tensor, bits: int, count: int) -> Tensor:
    """The first ``count`` codes of a densely packed block (:func:`pack`'s inverse).

    Args:
        packed (Tensor): uint8 CPU bytes, at least ``ceil(count * bits / 8)`` of them.
        bits (int): 1, 2 or 4.
        count (int): codes to read.

    Shapes:
        - **input:** ``[m]``
        - **output:** ``[count]`` uint8
    """
    lib = _required()
    if packed.device.type != "cpu" or packed.dtype != torch.uint8 or bits not in (1, 2, 4):
        raise ValueError(f"unpack: expected uint8 CPU bytes of 1, 2 or 4 bits, got {packed.dtype}, {bits}")
    per = 8 // bits
    size = -(-count // per)
    if packed.numel() < size:
        raise ValueError(f"{packed.numel()} bytes hold fewer than {count} codes of {bits} bits")
    packed = packed.view(-1)[:size].contiguous()
    codes = torch.empty(size * per, dtype=torch.uint8)  # whole bytes; the padding is cut off
    _over_rows(size, per, lambda s, e: lib.unpack(_ptr(packed), s, e, bits, _ptr(codes)), cost=0.125)
    codes = codes[:count]
    return codes


def dropout_mask(key: Tensor, n: int, lo: int, scale: float) -> Tensor:
    """A flat float32 dropout mask of ``n`` elements, :func:`retexo_fl.models.dropout.keep_mask`'s
    lanes hashed in C (its torch ops give the same values).

    Only integers are compared and two constants written, so unlike the codec's loops this one
    does not depend on torch's denormal flushing.

    Args:
        key (Tensor): the mask's counter key, one int64 on the CPU.
        n (int): the mask's elements.
        lo (int): an element is kept when its signed 16-bit lane is at least ``lo``.
        scale (float): a kept element's value.

    Shapes:
        - **output:** ``[n]`` float32
    """
    lib = _required()
    if key.device.type != "cpu" or key.dtype != torch.int64 or key.numel() != 1:
        raise ValueError(f"dropout mask key: expected one int64 on the CPU, got {key.dtype}, {key.shape}")
    key = key.contiguous()
    out = torch.empty(n)
    _over_rows(-(-n // 4), 4, lambda s, e: lib.dropout_mask(_ptr(key), s, e, n, lo, scale, _ptr(out)))
    return out


def denormals_flushed() -> bool | None:
    """Whether this thread flushes denormals (``torch.set_flush_denormal``), read from the FPU's
    control register without touching a tensor; ``None`` where that is not known."""
    flag = _required().denormals_flushed()
    return None if flag < 0 else bool(flag)


def dropout_apply(x: Tensor, key: Tensor, lo: int, scale: float) -> Tensor:
    """``x * mask`` for :func:`dropout_mask`'s mask of ``x.numel()`` elements, the mask never
    written: the same values as that product, bit for bit, while denormals are not flushed
    (:func:`denormals_flushed`; the caller checks).

    Args:
        x (Tensor): a float32 CPU tensor (made contiguous).
        key (Tensor): the mask's counter key, one int64 on the CPU.
        lo (int): an element is kept when its signed 16-bit lane is at least ``lo``.
        scale (float): a kept element's factor.

    Shapes:
        - **input:** ``x`` any shape
        - **output:** the shape of ``x``
    """
    lib = _required()
    if x.device.type != "cpu" or x.dtype != torch.float32:
        raise ValueError(f"dropout apply: expected a float32 CPU tensor, got {x.dtype} on {x.device}")
    if key.device.type != "cpu" or key.dtype != torch.int64 or key.numel() != 1:
        raise ValueError(f"dropout apply key: expected one int64 on the CPU, got {key.dtype}, {key.shape}")
    x, key = x.contiguous(), key.contiguous()
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    n = x.numel()
    _over_rows(
        -(-n // 4), 4, lambda s, e: lib.dropout_apply(_ptr(x), _ptr(key), s, e, n, lo, scale, _ptr(out))
    )
    return out
