"""The ``fakequant`` benchmark suite: fake-quantization forward/backward throughput vs memory bandwidth and torch.

At each size (default 4K, 256K and 16M float32 elements; ``--quick``: 4K and
256K) one interleaved run measures:

* ``np.copyto`` (single thread): the memory limit, 8 bytes per element (read x, write y);
* forward via ``FakeQuantize.forward(x, out=buf)``, via the raw kernel ``fq_forward``,
  and the plain-numpy reference ``(clip(rint(x*inv_s)+zp, qmin, qmax) - zp) * s``;
* backward via ``FakeQuantize.backward(g, x, out=buf)`` for every SteKind
  (12 bytes per element: x and g read, dx written);
* forward+backward (clipped identity, what torch's fake-quantize backward computes);
* when torch imports: ``torch.fake_quantize_per_tensor_affine`` forward and
  forward+backward (autograd), once with ``torch.set_num_threads(1)`` and once
  with torch's default thread count, plus qatlab's speedup over each and
  whether qatlab's forward output equals torch's bit for bit.

Data: ``x, g ~ N(0, 1)`` float32, 8-bit symmetric, scale 3/127 (about 0.3 % of
x is clamped). The ``kernel`` rows run on one thread; ``FakeQuantize`` splits a tensor of at
least ``qatlab.runtime.parallel.MIN_ELEMENTS`` (262,144) elements across the cores (the 16M rows). Goals (issue 2) are printed
as PASS / MISS / SKIP lines from the medians; nothing is tuned per goal.
"""
from __future__ import annotations

import contextlib

import numpy as np

from .kit import BenchOptions, Column, Goal, SuiteResult, Table, measure_many, suite
from ..kernels import fakequant as K
from ..runtime import parallel
from ..quant import FakeQuantize
from ..quant.ste import SteKind

KI, MI = 2**10, 2**20
SIZES = (4 * KI, 256 * KI, 16 * MI)
QUICK_SIZES = (4 * KI, 256 * KI)
GOAL_N = 16 * MI        # the size the bandwidth and torch goals are judged at
CALL_N = 4 * KI         # the size the per-call latency goal is judged at

BITS = 8
SCALE = float(np.float32(3.0 / 127))
FWD_BYTES = 8           # x read, y written
BWD_BYTES = 12          # x and g read, dx written
FWD_BWD_BYTES = FWD_BYTES + BWD_BYTES

GOAL_FWD_PCT = 70.0
GOAL_BWD_PCT = 60.0
GOAL_TORCH_X = 10.0
GOAL_CALL_US = 10.0


def numpy_reference_forward(x, inv_s, s, zp, qmin, qmax):
    """Plain-numpy fake-quantize forward, float32: ``(clip(rint(x*inv_s) + zp, qmin, qmax) - zp) * s``."""
    q = np.clip(np.rint(x * inv_s) + zp, qmin, qmax)
    return (q - zp) * s


def size_label(n: int) -> str:
    """``4096 -> '4K'``, ``16777216 -> '16M'``, other counts as digits."""
    for unit, div in (("M", MI), ("K", KI)):
        if n >= div and n % div == 0:
            return f"{n // div}{unit}"
    return str(n)


def _import_torch():
    """torch, or None when it is not importable here."""
    try:
        import torch
    except Exception:  # ImportError, or a broken install raising OSError etc.
        return None
    return torch


@contextlib.contextmanager
def _torch_threads(torch, n):
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def _warm_kernels():
    """Compile (or load from cache) every kernel the suite times, with the exact argument types."""
    f32 = np.float32
    x = np.linspace(-2, 2, 64, dtype=f32)
    y = np.empty_like(x)
    K.fq_forward(x, f32(10.0), f32(0.1), f32(0.0), f32(-128), f32(127), y)
    for kind in SteKind:
        K.fq_backward(x, x, kind.code, f32(10.0), f32(0.0), f32(-128), f32(127), f32(0.0), f32(0.1), y)
        FakeQuantize(bits=BITS, scale=SCALE, ste=kind).backward(x, x, out=y)
    FakeQuantize(bits=BITS, scale=SCALE).forward(x, out=y)


def _row(n, op, impl, m, nbytes, copy_gbs=None, threads=1):
    gelem = n / m.median / 1e9
    gbs = n * nbytes / m.median / 1e9 if nbytes else None
    return {
        "n": n, "size": size_label(n), "op": op, "impl": impl, "threads": threads,
        "bytes_per_elem": nbytes, "us_per_call": m.median * 1e6, "gelem_s": gelem, "gb_s": gbs,
        "pct_copy": (100.0 * gbs / copy_gbs) if (gbs is not None and copy_gbs) else None,
        "spread_pct": 100.0 * m.rel_spread, "speedup": None, "equal_torch": None, **m.to_dict(),
    }


def _bench_size(n: int, opts: BenchOptions, torch, torch_default_threads: int | None) -> dict:
    """Measure every operation at ``n`` elements; returns {"rows": [...], "equal": {...}}."""
    f32 = np.float32
    rng = np.random.default_rng(12345 + n)
    x = rng.standard_normal(n, dtype=f32)
    g = rng.standard_normal(n, dtype=f32)
    y = np.empty_like(x)
    dx = np.empty_like(x)
    dst = np.empty_like(x)

    fq = FakeQuantize(bits=BITS, symmetric=True, scale=SCALE, zero_point=0, ste=SteKind.CLIPPED_IDENTITY)
    fqs = {kind: FakeQuantize(bits=BITS, symmetric=True, scale=SCALE, zero_point=0, ste=kind) for kind in SteKind}
    qmin, qmax = fq.quant_range()
    s, zp = f32(SCALE), f32(0.0)
    inv_s = f32(1.0) / s
    fqmin, fqmax = f32(qmin), f32(qmax)

    fns = {
        "copy": lambda: np.copyto(dst, x),
        "fwd": lambda: fq.forward(x, out=y),
        "fwd_kernel": lambda: K.fq_forward(x, inv_s, s, zp, fqmin, fqmax, y),
        "fwd_numpy": lambda: numpy_reference_forward(x, inv_s, s, zp, fqmin, fqmax),
    }
    for kind, q in fqs.items():
        fns[f"bwd_{kind.value}"] = (lambda q=q: q.backward(g, x, out=dx))
    fns["fwd_bwd"] = lambda: (fq.forward(x, out=y), fq.backward(g, x, out=dx))

    equal = {}
    torch_fns = {}
    if torch is not None:
        xt = torch.from_numpy(x)
        xt_grad = torch.from_numpy(x.copy()).requires_grad_(True)
        gt = torch.from_numpy(g)

        def torch_fwd():
            return torch.fake_quantize_per_tensor_affine(xt, SCALE, 0, qmin, qmax)

        def torch_fwd_bwd():
            xt_grad.grad = None
            torch.fake_quantize_per_tensor_affine(xt_grad, SCALE, 0, qmin, qmax).backward(gt)

        torch_fns = {"fwd": torch_fwd, "fwd_bwd": torch_fwd_bwd}
        # Bit-for-bit check of the forward outputs on this very data (not timed).
        ref = torch_fwd().numpy()
        equal["FakeQuantize.forward"] = bool(np.array_equal(fq.forward(x), ref))
        equal["kernel fq_forward"] = bool(np.array_equal(
            (K.fq_forward(x, inv_s, s, zp, fqmin, fqmax, y), y)[1], ref))
        equal["numpy reference"] = bool(np.array_equal(numpy_reference_forward(x, inv_s, s, zp, fqmin, fqmax), ref))
        del ref
        # torch's backward (cachemask) is clipped identity: check qatlab's gradient matches too.
        torch_fwd_bwd()
        equal["backward clipped_identity"] = bool(np.array_equal(
            fqs[SteKind.CLIPPED_IDENTITY].backward(g, x), xt_grad.grad.numpy()))

    kw = dict(repeats=opts.repeats, warmup=opts.warmup, min_time=opts.min_time)
    if torch is not None:
        with _torch_threads(torch, 1):
            ms = measure_many({**fns, **{f"torch1_{k}": f for k, f in torch_fns.items()}}, **kw)
        with _torch_threads(torch, torch_default_threads):
            ms.update(measure_many({f"torchN_{k}": f for k, f in torch_fns.items()}, **kw))
    else:
        ms = measure_many(fns, **kw)

    copy = _row(n, "copy", "np.copyto (1 thread)", ms["copy"], FWD_BYTES)
    cgbs = copy["gb_s"]
    rows = [copy]
    fwd = _row(n, "forward", "FakeQuantize.forward", ms["fwd"], FWD_BYTES, cgbs)
    rows += [fwd,
             _row(n, "forward", "kernel fq_forward", ms["fwd_kernel"], FWD_BYTES, cgbs),
             _row(n, "forward", "numpy reference", ms["fwd_numpy"], FWD_BYTES, cgbs)]
    for r in rows[1:]:
        r["equal_torch"] = equal.get(r["impl"])
    for kind in SteKind:
        rows.append(_row(n, f"backward {kind.value}", "FakeQuantize.backward", ms[f"bwd_{kind.value}"],
                         BWD_BYTES, cgbs))
    fwd_bwd = _row(n, "fwd+bwd clipped_identity", "FakeQuantize", ms["fwd_bwd"], FWD_BWD_BYTES, cgbs)
    fwd_bwd["equal_torch"] = equal.get("backward clipped_identity")
    rows.append(fwd_bwd)
    if torch is not None:
        for tag, threads, label in (("torch1", 1, "torch, 1 thread"),
                                    ("torchN", torch_default_threads,
                                     f"torch, default {torch_default_threads} threads")):
            for key, op, nbytes, mine in (("fwd", "forward", FWD_BYTES, fwd),
                                          ("fwd_bwd", "fwd+bwd clipped_identity", FWD_BWD_BYTES, fwd_bwd)):
                r = _row(n, op, label, ms[f"{tag}_{key}"], nbytes, cgbs, threads=threads)
                r["speedup"] = r["median_s"] / mine["median_s"]
                rows.append(r)
    return {"rows": rows, "equal": equal}


def _yes_no(v) -> str:
    return "yes" if v else "NO"


DETAIL_COLUMNS = [
    Column("op", "op"),
    Column("impl", "implementation"),
    Column("us_per_call", "us/call", "{:.2f}"),
    Column("gelem_s", "Gelem/s", "{:.3f}"),
    Column("bytes_per_elem", "B/el", "{:d}"),
    Column("gb_s", "GB/s", "{:.2f}"),
    Column("pct_copy", "% copy", "{:.1f}"),
    Column("spread_pct", "±IQR %", "{:.1f}"),
    Column("speedup", "qatlab x", "{:.1f}x"),
    Column("equal_torch", "= torch", _yes_no),
]

SUMMARY_COLUMNS = [
    Column("size", "n"),
    Column("copy_gb_s", "copy GB/s", "{:.2f}"),
    Column("fwd_gelem_s", "fwd Gelem/s", "{:.3f}"),
    Column("fwd_pct_copy", "fwd % copy", "{:.1f}"),
    Column("bwd_min_pct_copy", "bwd % copy (worst)", "{:.1f}"),
    Column("bwd_worst", "worst STE"),
    Column("fwd_us", "fwd us/call", "{:.2f}"),
    Column("x_torch1", "x torch 1t", "{:.1f}x"),
    Column("x_torchN", "x torch default", "{:.1f}x"),
    Column("fwd_bwd_x_torch1", "fwd+bwd x torch 1t", "{:.1f}x"),
    Column("equal_torch", "fwd = torch", _yes_no),
]


def _summary_row(n, rows):
    by = {(r["op"], r["impl"]): r for r in rows}
    fwd = by[("forward", "FakeQuantize.forward")]
    bwds = [by[(f"backward {k.value}", "FakeQuantize.backward")] for k in SteKind]
    worst = min(bwds, key=lambda r: r["pct_copy"] if r["pct_copy"] is not None else float("inf"))
    torch1 = next((r for r in rows if r["op"] == "forward" and r["impl"].startswith("torch") and r["threads"] == 1),
                  None)
    torchn = [r for r in rows if r["op"] == "forward" and r["impl"].startswith("torch, default")]
    tfb1 = next((r for r in rows if r["op"].startswith("fwd+bwd") and r["impl"] == "torch, 1 thread"), None)
    return {
        "n": n, "size": size_label(n), "copy_gb_s": by[("copy", "np.copyto (1 thread)")]["gb_s"],
        "fwd_gelem_s": fwd["gelem_s"], "fwd_pct_copy": fwd["pct_copy"],
        "bwd_min_pct_copy": worst["pct_copy"], "bwd_worst": worst["op"].split(" ", 1)[1],
        "fwd_us": fwd["us_per_call"],
        "x_torch1": torch1["speedup"] if torch1 else None,
        "x_torchN": torchn[0]["speedup"] if torchn else None,
        "fwd_bwd_x_torch1": tfb1["speedup"] if tfb1 else None,
        "equal_torch": fwd["equal_torch"],
    }


def _goals(per_size: dict[int, dict], torch_ok: bool, torch_default_threads) -> list[Goal]:
    goals = []
    big = per_size.get(GOAL_N)
    why_big = f"not measured: {size_label(GOAL_N)} not among the sizes of this run"
    by = {(r["op"], r["impl"]): r for r in big["rows"]} if big else {}

    name = f"forward at {size_label(GOAL_N)} >= {GOAL_FWD_PCT:.0f}% of copy bandwidth"
    if big:
        r, c = by[("forward", "FakeQuantize.forward")], by[("copy", "np.copyto (1 thread)")]
        goals.append(Goal(name, r["pct_copy"] >= GOAL_FWD_PCT,
                          f"{r['pct_copy']:.1f}% ({r['gb_s']:.2f} GB/s vs copy {c['gb_s']:.2f} GB/s)",
                          f">= {GOAL_FWD_PCT:.0f}%"))
    else:
        goals.append(Goal(name, None, why_big, f">= {GOAL_FWD_PCT:.0f}%"))

    for label in ("torch, 1 thread", f"torch, default {torch_default_threads} threads"):
        name = f"forward at {size_label(GOAL_N)} >= {GOAL_TORCH_X:.0f}x faster than torch fake-quantize ({label})"
        if not torch_ok:
            goals.append(Goal(name.replace(f"default {torch_default_threads}", "default"), None,
                              "torch not importable", f">= {GOAL_TORCH_X:.0f}x"))
            continue
        if big:
            t, q = by[("forward", label)], by[("forward", "FakeQuantize.forward")]
            goals.append(Goal(name, t["speedup"] >= GOAL_TORCH_X,
                              f"{t['speedup']:.1f}x (qatlab {q['us_per_call'] / 1e3:.2f} ms, "
                              f"torch {t['us_per_call'] / 1e3:.2f} ms)", f">= {GOAL_TORCH_X:.0f}x"))
        else:
            goals.append(Goal(name, None, why_big, f">= {GOAL_TORCH_X:.0f}x"))

    for kind in SteKind:
        name = f"backward {kind.value} at {size_label(GOAL_N)} >= {GOAL_BWD_PCT:.0f}% of copy bandwidth (12 B/elem)"
        if big:
            r = by[(f"backward {kind.value}", "FakeQuantize.backward")]
            goals.append(Goal(name, r["pct_copy"] >= GOAL_BWD_PCT, f"{r['pct_copy']:.1f}% ({r['gb_s']:.2f} GB/s)",
                              f">= {GOAL_BWD_PCT:.0f}%"))
        else:
            goals.append(Goal(name, None, why_big, f">= {GOAL_BWD_PCT:.0f}%"))

    small = per_size.get(CALL_N)
    for op, impl, label in (("forward", "FakeQuantize.forward", "FakeQuantize.forward"),
                            (None, "FakeQuantize.backward", "FakeQuantize.backward (slowest SteKind)")):
        name = f"{label} at {size_label(CALL_N)}: one call < {GOAL_CALL_US:.0f} us"
        if not small:
            goals.append(Goal(name, None, f"not measured: {size_label(CALL_N)} not among the sizes of this run",
                              f"< {GOAL_CALL_US:.0f} us"))
            continue
        cand = [r for r in small["rows"] if r["impl"] == impl and (op is None or r["op"] == op)]
        r = max(cand, key=lambda r: r["us_per_call"])
        extra = f" ({r['op'].split(' ', 1)[1]})" if op is None else ""
        goals.append(Goal(name, r["us_per_call"] < GOAL_CALL_US, f"{r['us_per_call']:.2f} us{extra}",
                          f"< {GOAL_CALL_US:.0f} us"))

    name = "forward equals torch.fake_quantize_per_tensor_affine bit for bit (every size)"
    if torch_ok:
        eq = {size_label(n): d["equal"].get("FakeQuantize.forward") for n, d in per_size.items()}
        goals.append(Goal(name, all(eq.values()), ", ".join(f"{k}: {_yes_no(v)}" for k, v in eq.items())))
    else:
        goals.append(Goal(name, None, "torch not importable"))
    return goals


@suite("fakequant", description="fake-quantize forward/backward vs copy bandwidth, numpy and torch")
def run(opts: BenchOptions) -> SuiteResult:
    """Run the fakequant suite (see the module docstring) and return its tables and goals."""
    sizes = opts.sizes or (QUICK_SIZES if opts.quick else SIZES)
    torch = _import_torch()
    torch_default_threads = torch.get_num_threads() if torch is not None else None
    _warm_kernels()

    per_size = {}
    tables = []
    for n in sizes:
        per_size[n] = _bench_size(n, opts, torch, torch_default_threads)
        mib = n * 4 / MI
        tables.append(Table(f"n = {size_label(n)} float32 ({n} elements, {mib:.3g} MiB per buffer)",
                            DETAIL_COLUMNS, per_size[n]["rows"]))
    summary = Table("summary (medians; speedups are torch time / qatlab time)", SUMMARY_COLUMNS,
                    [_summary_row(n, d["rows"]) for n, d in per_size.items()])
    tables.append(summary)

    notes = [
        f"data x, g ~ N(0,1) float32; {BITS}-bit symmetric, scale {SCALE:.6g}, zero-point 0",
        "np.copyto and the kernel rows run on one thread; FakeQuantize.forward/backward split tensors of "
        f">= {parallel.MIN_ELEMENTS:,} elements across {parallel.cores()} cores; "
        "% copy = GB/s / copy GB/s of the same size and run, "
        f"counting {FWD_BYTES} B/elem forward, {BWD_BYTES} B/elem backward, {FWD_BWD_BYTES} B/elem fwd+bwd",
        "backward identity only reads g (dx = g), so its nominal 12 B/elem overstates its traffic "
        "and its % copy can exceed 100",
        "all measurements of one size are interleaved round-robin; us/call is the median, ±IQR % its spread",
        "'= torch': output equal to torch.fake_quantize_per_tensor_affine bit for bit (np.array_equal) "
        "on this data; on the fwd+bwd row, dx equal to torch's autograd gradient",
    ]
    if torch is None:
        notes.append("torch is not importable here: torch rows and goals skipped (pip install 'torch==2.13.0')")
    else:
        notes.append(f"torch {torch.__version__}: measured with torch.set_num_threads(1) and with its default "
                     f"{torch_default_threads} threads; torch allocates its output on every call (it has no out=)")
    return SuiteResult(tables=tables, goals=_goals(per_size, torch is not None, torch_default_threads),
                       notes=notes,
                       extra={"sizes": list(sizes), "scale": SCALE, "bits": BITS,
                              "torch_default_threads": torch_default_threads,
                              "equal_torch": {size_label(n): d["equal"] for n, d in per_size.items()}})
