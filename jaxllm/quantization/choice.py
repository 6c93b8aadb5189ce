"""The quantized-matmul path per weight layout and row count, chosen by measurement at warm-up.

On a GPU, one device, the runner's warm-up calls `measure` with the model's quantized linears
and its token buckets before any step is compiled; the decode-sized ones (up to qmatmul's
MAX_ROWS) are measured. For each distinct layout (kind, activation mode, group, nibble run,
K, N) and row count it runs every candidate path of `kernels.py` on random rows: "xla";
"pallas/<tiling>" for each of qmatmul's tilings that takes the layout (int4, int8, and fp8
weight-only: x is not rounded to fp8 there), all of them at the fewest rows and the fastest
of those at the other row counts; on Hopper "mosaic/<tiling>" for per-channel fp8 W8A8
(`kernels/qmatmul_mosaic.py`, the same fewest-rows rule), "mosaic_nk/<tiling>" for int4 g128
and per-channel int8 (`kernels/qmatmul_int_mosaic.py`, on weights re-laid out [N, K] where it
wins over the decode buckets: `relayout`) and "mgpu" for per-channel int8.
It drops any whose
output differs from x @ the dequantized weight by more than 2e-2 (relative; 5e-2 for fp8
W8A8), times the rest (median of a few jitted loops of dependent calls, `timing.chained`) and
keeps the fastest (XLA's own dot only when clearly so: `fastest`). `kernels.matmul` then
reads the choice at trace time (`measured_path`); a shape never measured (prefill-sized
buckets, tensor parallelism, CPU) keeps the static `TUNING` table. The choices and the
figures are logged.
"""

from __future__ import annotations

import logging
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.kernels.qmatmul import MAX_ROWS
from jaxllm.kernels.timing import UNROLL, copies, loop_floor, time_checked, turns
from jaxllm.quantization.qarray import QArray

log = logging.getLogger("jaxllm")
_MEASURED: dict[tuple, str] = {}  # layout_key(...) -> path
TIMINGS: dict[tuple, dict[str, float]] = {}  # the figures behind each choice (tests, logs)
NK_LAYOUTS: set[tuple] = set()  # int layouts (layout_key without rows) re-laid out for "mosaic_nk"
GEMM_FROM: dict[tuple, tuple[int, str]] = {}  # fp8 W8A8 layout (no rows) -> (fewest rows, tiling) of "ws/"
GEMM_TIMINGS: dict[tuple, dict[str, float]] = {}  # layout_key -> path -> seconds, prefill-sized rows


def layout_key(x_shape: tuple[int, ...], w: QArray) -> tuple:
    rows = int(np.prod(x_shape[:-1]))
    return (w.kind, w.act, w.group if w.kind != "fp8" else 0, w.pack, *w.shape[-2:], rows)


def measured_path(x_shape: tuple[int, ...], w: QArray) -> str | None:
    return _MEASURED.get(layout_key(x_shape, w))


def gemm_tiling(x_shape: tuple[int, ...], w: QArray) -> str | None:
    """The warp-specialized fp8 GEMM's tiling where the warm-up measured it faster than XLA's fp8
    GEMM for this layout at these rows and at every larger row count it measured, else None."""
    k = layout_key(x_shape, w)
    hit = GEMM_FROM.get(k[:-1])
    return hit[1] if hit is not None and k[-1] >= hit[0] else None


def clear() -> None:
    _MEASURED.clear()
    TIMINGS.clear()
    NK_LAYOUTS.clear()
    GEMM_FROM.clear()
    GEMM_TIMINGS.clear()


def two_d(w: QArray) -> QArray:
    """One layer's slice of a stacked QArray ([L, ...] -> the matrix a step multiplies by)."""
    while w.values.ndim > 2:
        w = w[0]
    return w


def candidates(x_shape: tuple[int, ...], w: QArray, tilings: list[str] | None = None) -> list[str]:
    """The paths to measure: "xla", "pallas/<name>" for each qmatmul tiling that takes the
    layout, "mosaic/<name>" for each Mosaic fp8 tiling that takes it on Hopper (of both, only
    those in `tilings` when given; every Mosaic one that fits when none given does),
    "mosaic_nk/<name>" for int4 g128 and per-channel int8 on Hopper (the same rule; timed on
    the [N, K] layout it needs), "mgpu" for per-channel int8 on Hopper."""
    from jaxllm.kernels import prefill_choice, qmatmul
    from jaxllm.kernels import qmatmul_int_mosaic as qi
    from jaxllm.kernels import qmatmul_mosaic as qm
    from jaxllm.quantization.kernels import NK_PATH

    keep = (lambda name: True) if tilings is None else (lambda name: name in tilings)  # noqa: E731
    out = ["xla"]
    if w.kind in ("int4", "int8", "fp8"):
        out += [f"pallas/{t.name}" for t in qmatmul.TILINGS
                if qmatmul.unsupported(x_shape, w, t) is None and keep(t.name)]
    hopper = prefill_choice.is_hopper()
    if qm.takes(w) and hopper:
        fits = qm.tilings_for(int(np.prod(x_shape[:-1])), *w.shape[-2:], num_sms())
        out += [f"mosaic/{t.name}" for t in ([t for t in fits if keep(t.name)] or fits)]
    if hopper and qi.takes(w):
        fits = qi.tilings_for(int(np.prod(x_shape[:-1])), *w.shape[-2:], num_sms(), w.kind)
        out += [NK_PATH + t.name for t in ([t for t in fits if keep(t.name)] or fits)]
    if w.kind == "int8" and w.group == w.shape[-2] and hopper:
        out.append("mgpu")
    family = decode_family()
    if family != "measured":
        out = [p for p in out if p == family or p.startswith(family + "/")] or ["xla"]
    return out


DECODE_FAMILIES = ("measured", "xla", "pallas", "mosaic", "mosaic_nk", "mgpu")


def decode_family() -> str:
    """JAXLLM_DECODE_MATMUL: "measured" (default) times every candidate path of a decode-sized
    quantized matmul; a family name keeps only that family's paths (its tilings still timed;
    "xla" where it has none). A step-level experiment: the warm-up times each matmul alone,
    where a Mosaic kernel's custom call and a Triton one cost the same launch, but in the step
    XLA cannot put a Mosaic custom call in a command buffer (CUDA graph) and can a Triton one
    (session 29: 160 custom calls cut an fp8 Llama-3-8B batch-1 step into 321 host launches
    even with graphs for everything else; bf16's has 65)."""
    from jaxllm.envs import env_choice
    return env_choice("JAXLLM_DECODE_MATMUL", "measured", DECODE_FAMILIES)


def num_sms() -> int:
    from jaxllm.kernels.qmatmul_mosaic import device_sms
    return device_sms()


def time_paths(x: jax.Array, w: QArray, paths: list[str], reps: int = 5, chain: int = 20,
               ref_rows: int | None = None, compiler_options: dict | None = None,
               unroll: int = UNROLL) -> dict[str, float]:
    """Seconds per call of each path (median of `reps` loops of `chain` dependent calls: a
    decode-sized matmul is shorter than a dispatch) after a check against x @ the dequantized
    weight (within 2e-2; 5e-2 for fp8 W8A8, whose "xla" path also rounds x to fp8: 2.7% measured),
    on x's first `ref_rows` rows where given (a prefill-sized reference is one more large GEMM
    to compile and autotune). `compiler_options`: XLA's, for each path's compile. `unroll`:
    calls per iteration of the timing loop (`timing.UNROLL`)."""
    from jaxllm.kernels.qmatmul import reference
    from jaxllm.quantization.kernels import NK_PATH, matmul

    fns = {p: (lambda x, w, nk, p=p: matmul(x, nk if p.startswith(NK_PATH) else w, p)) for p in paths}
    nk = None
    if any(p.startswith(NK_PATH) for p in paths):  # timed on the layout it would run on
        from jaxllm.kernels.qmatmul_int_mosaic import to_nk
        try:
            nk = jax.jit(to_nk)(w)
        except Exception as e:  # noqa: BLE001 - then the kernel is not a candidate
            log.info("quantized matmul %s: no [N, K] layout (%s); %s not timed",
                     layout_key(x.shape, w), str(e)[:200], NK_PATH)
            paths = [p for p in paths if not p.startswith(NK_PATH)]
            fns = {p: fns[p] for p in paths}
    ref = jax.jit(reference)(x if ref_rows is None else x[:ref_rows], w)
    tol = 5e-2 if w.act == "fp8" else 2e-2
    # decode-sized rows read the weight from HBM in a step: copies in turn beyond the L2
    n = turns(sum(a.nbytes for a in jax.tree.leaves(w))) if x.shape[0] <= MAX_ROWS else 1
    return time_checked(fns, (x, w, nk), reps, "quantized matmul", f" {layout_key(x.shape, w)}", tol=tol,
                        catch=True, ref=ref, chain=chain, compiler_options=compiler_options, unroll=unroll,
                        more=tuple(copies((w, nk), n - 1)))


# "xla" is taken only when at least this much faster than the fastest kernel. Timed alone, a
# matmul through XLA's dot is what XLA compiles for that dot; inside the step XLA rewrites it
# with its neighbours, which a custom call is spared: session 28's H100 took XLA's path for
# gate/up, q and o at 8 rows (43.3 us against the kernels' 43.7-44.2, the loop's own overhead
# 27.9 of each), and its decode step then spent 2.55 ms concatenating gate's and up's weights
# (XLA merged the two dots) and 0.54 ms in weight-sized transposes, 1.28x the bf16 step.
XLA_MARGIN = 0.9


def fastest(times: dict[str, float]) -> str:
    """The path to take from checked timings (seconds): the fastest kernel, unless "xla" is
    faster than it by XLA_MARGIN (or there is no kernel)."""
    kernels = {p: t for p, t in times.items() if p != "xla"}
    best = min(kernels, key=kernels.get) if kernels else "xla"
    return "xla" if "xla" in times and times["xla"] < XLA_MARGIN * times.get(best, float("inf")) else best


def measure(weights: list[QArray], rows: list[int], dtype, reps: int = 5) -> dict[tuple, str]:
    """Choose a path for each distinct layout of `weights` at each row count (module docstring)."""
    from jaxllm.quantization.kernels import NK_PATH

    seen: dict[tuple, QArray] = {}
    for w in weights:
        w = two_d(w)
        seen.setdefault(layout_key((1, w.shape[-2]), w)[:-1], w)
    key = jax.random.key(0)
    floors: dict[int, float] = {}  # rows -> a trivial chained call's time (overhead, not kernel)
    for w in seen.values():
        best = None  # per kernel family, the fastest tiling at the fewest rows: the only ones timed at the others
        for M in sorted(r for r in set(rows) if r <= MAX_ROWS):  # decode-sized buckets
            x = jax.random.normal(key, (M, w.shape[-2]), jnp.float32).astype(dtype)
            paths = candidates(x.shape, w, best)
            if len(paths) == 1:  # nothing to time: no kernel takes it, or one path asked for
                if paths[0] != "xla":
                    _MEASURED[layout_key(x.shape, w)] = paths[0]
                    if paths[0].startswith(NK_PATH):  # the kernel's layout, made once at warm-up
                        NK_LAYOUTS.add(layout_key(x.shape, w)[:-1])
                continue
            t0 = time.perf_counter()
            times = time_paths(x, w, paths, reps)
            log.info("quantized matmul %s: %d paths timed in %.1f s", layout_key(x.shape, w), len(paths),
                     time.perf_counter() - t0)
            if M not in floors:
                floors[M] = loop_floor(x, reps, unroll=UNROLL)
            if times:
                k = layout_key(x.shape, w)
                _MEASURED[k] = fastest(times)
                TIMINGS[k] = times
                if best is None:
                    best = []
                    for family in ("pallas/", "mosaic/", NK_PATH):
                        tiled = {p: t for p, t in times.items() if p.startswith(family)}
                        if tiled:
                            best.append(min(tiled, key=tiled.get).partition("/")[2])
    for w in seen.values():
        measure_gemm(w, rows, dtype, reps)
    _choose_layouts()
    if GEMM_TIMINGS:
        log.info("fp8 W8A8 prefill-sized matmuls, XLA's fp8 GEMM vs the warp-specialized one "
                 "((kind, act, group, pack, K, N, rows) -> us): %s; the kernel taken (layout -> from rows, "
                 "tiling): %s", {k: {p: round(t * 1e6, 1) for p, t in v.items()} for k, v in GEMM_TIMINGS.items()},
                 GEMM_FROM or "nowhere")
    if TIMINGS:
        log.info("quantized matmuls by measurement ((kind, act, group, pack, K, N, rows) -> path): %s",
                 {k: f"{_MEASURED[k]} " + ", ".join(f"{p} {t * 1e6:.1f}us" for p, t in v.items())
                  for k, v in TIMINGS.items()})
        log.info("quantized matmuls' timing overhead (a trivial call timed the same way, rows -> "
                 "us per call; the same in every candidate's figure): %s",
                 {m: round(t * 1e6, 1) for m, t in floors.items()})
    return dict(_MEASURED)


# The prefill-sized timings compile XLA's fp8 GEMM without autotuning (cuBLASLt's heuristic
# algorithm): autotuned, each (layout, rows) compile took tens of seconds, and a fresh H100's
# fp8 start-up did not finish its path timing in 300 s (session 27; session 26's H200 had the
# autotuning results cached from earlier runs). This can only favour the kernel over XLA's
# best; session 26 measured the kernel 1.07-1.18x faster than autotuned XLA at 8,192 rows.
GEMM_TIMING_OPTIONS = {"xla_gpu_autotune_level": 0}
REF_ROWS = 64  # rows of the prefill-sized check against the dequantized weight


def measure_gemm(w: QArray, rows: list[int], dtype, reps: int = 5) -> None:
    """On Hopper, for a per-channel fp8 W8A8 layout, unless JAXLLM_FP8_GEMM decides: XLA's fp8
    GEMM against the warp-specialized GEMM (`kernels/fp8_gemm_ws.py`, its first tiling), each
    with the activations' per-token quantization, at the smallest, a middle and the largest
    prefill-sized row count (> the decode kernels' 64). The kernel is taken from the fewest rows
    at which it was faster there and at every larger count measured (GEMM_FROM); rows between
    two measured counts follow the next larger one's verdict."""
    from jaxllm.kernels import fp8_gemm_tiling, prefill_choice
    from jaxllm.kernels.fp8_gemm_ws import TILINGS
    from jaxllm.kernels.qmatmul_mosaic import MAX_ROWS as DECODE_ROWS
    from jaxllm.quantization.kernels import FP8_GEMM_PATH

    if w.kind != "fp8" or w.act != "fp8" or fp8_gemm_tiling() or not prefill_choice.is_hopper():
        return
    big = sorted(r for r in set(rows) if r > DECODE_ROWS)
    t = TILINGS[0]
    N, K = w.values.shape
    if not big or t.unsupported(big[-1], K, N) is not None:
        return
    wins = {}
    for M in sorted({big[0], big[len(big) // 2], big[-1]}):
        x = jax.random.normal(jax.random.key(M), (M, K), jnp.float32).astype(dtype)
        t0 = time.perf_counter()
        times = time_paths(x, w, ["xla", FP8_GEMM_PATH + t.name], reps, chain=5, ref_rows=REF_ROWS,
                           compiler_options=GEMM_TIMING_OPTIONS, unroll=1)
        log.info("fp8 GEMM %s: XLA's and the ws kernel timed in %.1f s", layout_key(x.shape, w),
                 time.perf_counter() - t0)
        GEMM_TIMINGS[layout_key(x.shape, w)] = times
        wins[M] = FP8_GEMM_PATH + t.name in times and times[FP8_GEMM_PATH + t.name] < times.get("xla", np.inf)
    start = None
    for M in sorted(wins, reverse=True):
        if not wins[M]:
            break
        start = M
    if start is not None:
        lost = [M for M in wins if M < start and not wins[M]]
        GEMM_FROM[layout_key((1, K), w)[:-1]] = (max(lost) + 1 if lost else big[0], t.name)


def _choose_layouts() -> None:
    """Layouts whose int4 / int8 weights are better re-laid out for the Mosaic kernel: summed
    over the decode-sized row counts measured, its fastest tiling beats the fastest path on the
    stored layout. Those weights can then take no other path, so each of their row counts gets
    the kernel's fastest tiling there (or "xla", x @ the dequantized weight, where it was not
    timed)."""
    from jaxllm.quantization.kernels import NK_PATH

    nk_path = lambda p: p.startswith(NK_PATH)  # noqa: E731
    layouts: dict[tuple, dict[int, dict[str, float]]] = {}
    for k, times in TIMINGS.items():
        layouts.setdefault(k[:-1], {})[k[-1]] = times
    for layout, per_rows in layouts.items():
        nk = {M: min((t, p) for p, t in v.items() if nk_path(p))
              for M, v in per_rows.items() if any(nk_path(p) for p in v)}
        if not nk:
            continue
        stored = {M: min((t, p) for p, t in v.items() if not nk_path(p)) for M, v in per_rows.items()}
        if sum(nk[M][0] for M in nk) < sum(stored[M][0] for M in nk):
            NK_LAYOUTS.add(layout)
            for M in per_rows:
                _MEASURED[(*layout, M)] = nk[M][1] if M in nk else "xla"
        else:
            for M in per_rows:  # the stored layout's fastest
                _MEASURED[(*layout, M)] = stored[M][1]


def relayout(tree):
    """`tree` with each int4 / int8 QArray of a layout in NK_LAYOUTS replaced by its re-laid-out
    form (`to_nk`; stacked layers included), one weight at a time."""
    if not NK_LAYOUTS:
        return tree
    from jaxllm.kernels.qmatmul_int_mosaic import takes, to_nk

    convert = jax.jit(to_nk)

    def one(a):
        if isinstance(a, QArray) and takes(a) and layout_key((1, a.shape[-2]), two_d(a))[:-1] in NK_LAYOUTS:
            return convert(a)
        return a
    return jax.tree.map(one, tree, is_leaf=lambda a: isinstance(a, QArray))


def quantized_leaves(*trees) -> list[QArray]:
    """Every QArray in the given pytrees (params, per-layer params)."""
    out = []
    for tree in trees:
        if tree is None:
            continue
        out += [x for x in jax.tree.leaves(tree, is_leaf=lambda a: isinstance(a, QArray))
                if isinstance(x, QArray)]
    return out
