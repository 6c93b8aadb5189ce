"""Hopper (Mosaic GPU) fp8 W8A8 matmul for decode-sized steps: the weight streamed once, as stored.

`fp8_matmul(xq [M, K] e4m3, w [N, K] e4m3) -> [N, Mp] float32 = W @ xq^T` for up to MAX_ROWS
rows, the unscaled product; `kernels.py` applies the per-token and per-channel scales in the
XLA fusion that follows (it fuses with the step's next elementwise work).

At decode a matmul is a stream of W (a few rows of x against every weight byte), so the
schedule is a bandwidth kernel's, not a GEMM's: the roles are swapped so that the weight is
wgmma's M side (out^T = W x^T; the weight's [N, K] rows, fp8 and K-major as stored, are the A
operand straight from shared memory) and the M <= 64 rows of x, padded only to a multiple of
8, are its N side (the K-major B operand: a transposed view of the [Mp, bk] x tile). Nothing
is converted in registers and no tensor-core work is spent on padding rows beyond 8, where
a GEMM would pad M to 64 or 128 (cuBLASLt's fp8 GEMM at 8 rows ran at 2.7-18x its bytes'
time on the H200 of session 22).

Grid (N / bn strips, k_splits): each CTA TMA-pipelines its strip's [bn, bk] weight tiles and
the matching [Mp, bk] x tiles through `stages` shared-memory slots into fp8 wgmmas
(float32 accumulator [bn, Mp]), then TMA-stores the accumulator to its [bn, Mp] block of a
[k_splits, N, Mp] float32 partial; the K splits (enough CTAs to fill every SM when N / bn is
small) are summed by the XLA epilogue. A `persistent` tiling instead runs one CTA per SM over
an even share of the (strip, K chunk) units in a single pipeline (`_body_persistent`), so no
CTA drains and refills its pipeline between units; which schedule streams faster is left to
the warm-up's measurement. Checked in Mosaic GPU's CPU interpreter (simulated
TMA, barriers and wgmma, with its race detector) against the plain product in
tests/test_qmatmul_mosaic.py, and lowered for cuda there.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxllm.kernels import mgpu_compat

MAX_ROWS = 64  # as qmatmul.MAX_ROWS: larger steps are compute-bound (XLA's fp8 GEMM)
KERNEL_NAME = "jaxllm_fp8_matmul"  # as profiles name it
SWIZZLE_K = 128  # fp8 elements per 128-byte swizzle row: bk is a multiple of it


@dataclasses.dataclass(frozen=True)
class Tiling:
    block_n: int = 128  # weight rows (outputs) per CTA: wgmma's M, a multiple of 64
    block_k: int = 256  # K per pipeline step
    stages: int = 6  # pipeline slots in flight per CTA
    k_splits: int = 1  # K chunks per strip (float32 partials summed by XLA)
    persistent: bool = False  # one CTA per SM walking a run of (strip, K chunk) units, below

    @property
    def name(self) -> str:
        return f"mq_{self.block_n}x{self.block_k}s{self.stages}k{self.k_splits}" + ("p" if self.persistent else "")

    @classmethod
    def parse(cls, name: str) -> "Tiling":
        """The tiling `name` names ("mq_128x256s4k8", "mq_64x256s6k4p")."""
        persistent = name.endswith("p")
        bn, rest = name.removeprefix("mq_").removesuffix("p").split("x")
        bk, rest = rest.split("s")
        st, ks = rest.split("k")
        return cls(int(bn), int(bk), int(st), int(ks), persistent)

    def smem_bytes(self, rows: int) -> int:
        """Shared memory at `rows` rows: the pipeline's slots and the f32 output tile (after the
        pipeline, reusing its memory; persistent: beside it)."""
        Mp = padded_rows(rows)
        slots, out = self.stages * (self.block_n + Mp) * self.block_k, self.block_n * Mp * 4
        return slots + out if self.persistent else max(slots, out)


# The tile shapes offered (x k_splits chosen per matrix by `tilings_for`); ~16-32 KB of weight
# per slot and 4-8 slots: 64-256 KB of loads in flight per SM, the decode attention kernel's
# regime (0.92 of copy bandwidth).
SHAPES = ((64, 256, 6), (128, 256, 4), (128, 128, 8))
SMEM_LIMIT = 224 * 1024  # Hopper's 227 KB a CTA, less room for barriers and alignment


def padded_rows(M: int) -> int:
    """Rows of x as the kernel takes them: a multiple of 8 (wgmma's N granule)."""
    return max(8, -(-M // 8) * 8)


def unsupported(M: int, K: int, N: int, t: Tiling) -> str | None:
    """Why (M rows, K, N) cannot take tiling t, or None when it can."""
    if M > MAX_ROWS:
        return f"{M} rows (decode-sized steps only, <= {MAX_ROWS})"
    if t.block_n % 64 or N % t.block_n:
        return f"N={N} is not a multiple of block_n={t.block_n} (itself a multiple of 64)"
    if t.block_k % SWIZZLE_K or K % (t.block_k * t.k_splits):
        return f"K={K} is not a multiple of block_k={t.block_k} x k_splits={t.k_splits}"
    if t.smem_bytes(M) > SMEM_LIMIT:
        return f"{t.smem_bytes(M)} bytes of shared memory at {M} rows"
    return None


def persistent_ctas(N: int, t: Tiling, num_sms: int) -> int:
    """CTAs of a persistent tiling: the most <= num_sms that divide its units evenly (every CTA
    then walks the same static number of units)."""
    units = N // t.block_n * t.k_splits
    return max(c for c in range(1, min(units, num_sms) + 1) if units % c == 0)


def grid_splits(strips: int, k_steps: int, num_sms: int) -> tuple[int, int]:
    """K splits to offer a grid of `strips` column strips over `k_steps` K steps: the fewest (a
    power of two dividing k_steps) that give one CTA per SM, and twice that."""
    ks = 1
    while strips * ks < num_sms and k_steps % (ks * 2) == 0:
        ks *= 2
    return ks, 2 * ks


def tilings_for(M: int, K: int, N: int, num_sms: int = 132) -> list[Tiling]:
    """The candidates for one matrix: each shape with the fewest K splits (a power of two) that
    gives one CTA per SM; and each shape persistent, with the fewest K splits whose units spread
    over >= 90% of the SMs (at least two units a CTA, so that its pipeline runs on across a
    unit's end). Six at most: each costs a compile and a timing at warm-up, per layout."""
    out = []
    for bn, bk, st in SHAPES:
        if N % bn:
            continue
        t = Tiling(bn, bk, st, grid_splits(N // bn, K // bk, num_sms)[0])
        if unsupported(M, K, N, t) is None:
            out.append(t)
        ks = 1
        while K % (bk * ks) == 0:
            t = Tiling(bn, bk, st, ks, persistent=True)
            ctas = persistent_ctas(N, t, num_sms)
            if ctas >= 0.9 * num_sms and (N // bn * ks) // ctas >= 2:
                if unsupported(M, K, N, t) is None:
                    out.append(t)
                break
            ks *= 2
    return out


def _body(x_gmem, w_gmem, o_gmem, *scratch, t: Tiling, K: int, interpret: bool):
    j, ks = lax.axis_index("n"), lax.axis_index("k")
    steps = K // (t.block_k * t.k_splits)
    Mp = x_gmem.shape[0]

    def step(acc_ref, w_smem, x_smem):
        """acc += W tile @ x tile^T: wgmma's B operand x^T [bk, Mp] is K-major as 8-bit wgmma
        requires, a transposed view of the [Mp, bk] tile (jax 0.10's interpreter cannot read
        such views: there it is a staged copy, waited on before the next step overwrites it)."""
        if not interpret or mgpu_compat.INTERPRETER_TRANSPOSES:
            plgpu.wgmma(acc_ref, w_smem, x_smem.transpose((1, 0)))
            return
        scratch[0][...] = x_smem[...].T
        plgpu.wgmma(acc_ref, w_smem, scratch[0])
        plgpu.wgmma_wait(0)

    def acc_scope(acc_ref):
        plgpu.emit_pipeline(
            lambda _, w_smem, x_smem: step(acc_ref, w_smem, x_smem),
            grid=(steps,),
            in_specs=[plgpu.BlockSpec((t.block_n, t.block_k), lambda k: (j, ks * steps + k),
                                      delay_release=1),
                      plgpu.BlockSpec((Mp, t.block_k), lambda k: (0, ks * steps + k),
                                      delay_release=1)],
            max_concurrent_steps=t.stages,
        )(w_gmem, x_gmem)
        return acc_ref[...]

    acc = pl.run_scoped(acc_scope, plgpu.ACC((t.block_n, Mp)))

    @functools.partial(pl.run_scoped, o_smem=plgpu.SMEM((t.block_n, Mp), jnp.float32))
    def _(o_smem):
        o_smem[...] = acc
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, o_gmem.at[ks, pl.ds(j * t.block_n, t.block_n)])
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def device_sms() -> int:
    """Streaming multiprocessors of the first device (132 on an H100 / H200 SXM)."""
    return int(getattr(jax.devices()[0], "core_count", 0) or 132)


def fp8_w8a8(x: jax.Array, w, tiling: Tiling, interpret: bool = False,
             num_sms: int | None = None) -> jax.Array:
    """x [..., K] @ an fp8 W8A8 QArray (values [N, K], per-channel scale [N, 1]) -> [..., N] in
    x's dtype: x quantized per token (as `quantization.kernels.fp8_w8a8`), the kernel, then the
    two scales in one XLA fusion."""
    from jaxllm.quantization.kernels import quantize_rows_fp8

    lead, K = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, K)
    M = x2.shape[0]
    # Rows padded before quantizing (zero rows quantize to zero): the pad fuses into the two
    # quantization fusions instead of a third kernel over the fp8 rows (session 25's profile:
    # reduce, pad and convert were ~1.3 us each, four matmuls a layer).
    pad = ((0, padded_rows(M) - M), (0, 0))
    if isinstance(x2, jax.Array):
        xq, sx = quantize_rows_fp8(jnp.pad(x2, pad))
    elif x2.rows:  # act.Fp8Rows padded by the kernel that made them (`act.padded_for`)
        xq, sx = x2.values, x2.scale
    else:  # act.Fp8Rows: quantized by the op that made it; zero rows pad it
        xq, sx = (jnp.pad(a, pad) for a in quantize_rows_fp8(x2))
    yt = fp8_matmul(xq, w.values, tiling, interpret, num_sms or device_sms())  # [N, Mp]
    y = yt[:, :M].T * sx[:M] * w.scale[:, 0].astype(jnp.float32)
    return y.astype(x.dtype).reshape(*lead, -1)


def takes(w) -> bool:
    """Whether the kernel takes this QArray: 2-D fp8 W8A8 with one scale per output channel."""
    return (w.kind == "fp8" and w.act == "fp8" and w.values.ndim == 2
            and w.scale.shape == (w.values.shape[0], 1))


def _body_persistent(x_gmem, w_gmem, o_gmem, *scratch, t: Tiling, K: int, ctas: int,
                     interpret: bool):
    """Persistent: CTA c walks units [c * U / ctas, (c + 1) * U / ctas) of the U = strips x
    k_splits (strip, K chunk) units, strip-major, in one pipeline over all their K steps: the
    TMA loads of a unit's first steps are in flight while the last ones of the unit before are
    multiplied (the grid version drains and refills its pipeline per CTA, a few hundred
    nanoseconds of an SM's bandwidth each time). The accumulator is carried in registers; at a
    unit's last step it is TMA-stored to that unit's [bn, Mp] block of the partials and reset."""
    c = lax.axis_index("sm")
    Mp = x_gmem.shape[0]
    spu = K // (t.block_k * t.k_splits)  # steps per unit
    per_cta = o_gmem.shape[1] // t.block_n * t.k_splits // ctas  # units per CTA (static)
    u0 = c * per_cta

    def unit_of(s):
        u = u0 + lax.div(s, spu)
        return lax.div(u, t.k_splits), lax.rem(u, t.k_splits)  # (strip, K chunk)

    def w_block(s):
        j, kk = unit_of(s)
        return j, kk * spu + lax.rem(s, spu)

    def x_block(s):
        _, kk = unit_of(s)
        return 0, kk * spu + lax.rem(s, spu)

    def operand(x_smem):
        if not interpret or mgpu_compat.INTERPRETER_TRANSPOSES:
            return x_smem.transpose((1, 0))
        scratch[1][...] = x_smem[...].T
        return scratch[1]

    def step(acc_ref, idx, w_smem, x_smem, prev):
        """One K step; at a unit's last, store acc - prev (the accumulator runs on over the
        CTA's units: the Mosaic interpreters of jax 0.10 and 0.11 fail on accumulator stores
        inside a pipeline body, so it is never reset) and carry acc as the next prev."""
        s = idx[0]
        plgpu.wgmma(acc_ref, w_smem, operand(x_smem))

        def flush(prev):
            j, kk = unit_of(s)
            acc = acc_ref[...]  # waits for the unit's last wgmma
            o_smem = scratch[0]
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last unit's store has read it
            o_smem[...] = acc - prev
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_smem, o_gmem.at[kk, pl.ds(j * t.block_n, t.block_n)])
            return acc

        return lax.cond(lax.rem(s, spu) == spu - 1, flush, lambda p: p, prev)

    def acc_scope(acc_ref):
        plgpu.emit_pipeline(
            functools.partial(step, acc_ref),
            grid=(per_cta * spu,),
            in_specs=[plgpu.BlockSpec((t.block_n, t.block_k), w_block, delay_release=1),
                      plgpu.BlockSpec((Mp, t.block_k), x_block, delay_release=1)],
            max_concurrent_steps=t.stages,
            init_carry=jnp.zeros((t.block_n, Mp), jnp.float32),
        )(w_gmem, x_gmem)

    pl.run_scoped(acc_scope, plgpu.ACC((t.block_n, Mp)))
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def fp8_matmul(xq: jax.Array, w: jax.Array, tiling: Tiling, interpret: bool = False,
               num_sms: int = 132) -> jax.Array:
    """xq [M, K] float8_e4m3fn (rows of x, quantized), w [N, K] float8_e4m3fn -> W @ xq^T as
    float32 [N, Mp] (Mp = padded_rows(M); columns past M are zero), unscaled."""
    M, K = xq.shape
    N = w.shape[0]
    if w.shape[1] != K or xq.dtype != w.dtype or w.dtype != jnp.float8_e4m3fn:
        raise ValueError(f"fp8_matmul takes e4m3 x [M, K] and w [N, K], got {xq.dtype}{list(xq.shape)}"
                         f" and {w.dtype}{list(w.shape)}")
    why = unsupported(M, K, N, tiling)
    if why is not None:
        raise ValueError(f"fp8_matmul {tiling.name}: {why}")
    Mp = padded_rows(M)
    xp = jnp.pad(xq, ((0, Mp - M), (0, 0))) if Mp > M else xq
    params, scratch = {}, []
    if interpret:
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
        params["interpret"] = InterpretGPUParams(detect_races=True)
        if not mgpu_compat.INTERPRETER_TRANSPOSES:
            scratch = [plgpu.SMEM((tiling.block_k, Mp), xq.dtype)]
    if tiling.persistent:  # the output tile first, then any staging copy
        ctas = persistent_ctas(N, tiling, num_sms)
        body = functools.partial(_body_persistent, t=tiling, K=K, ctas=ctas, interpret=interpret)
        scratch = [plgpu.SMEM((tiling.block_n, Mp), jnp.float32), *scratch]
        grid = dict(grid=(ctas,), grid_names=("sm",))
    else:
        body = functools.partial(_body, t=tiling, K=K, interpret=interpret)
        grid = dict(grid=(N // tiling.block_n, tiling.k_splits), grid_names=("n", "k"))
    out = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((tiling.k_splits, N, Mp), jnp.float32),
        kernel_name=KERNEL_NAME, scratch_types=scratch, **grid,
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        **params,
    )(xp, w)
    return out[0] if tiling.k_splits == 1 else out.sum(axis=0)
