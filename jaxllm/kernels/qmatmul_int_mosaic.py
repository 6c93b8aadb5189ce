"""Hopper (Mosaic GPU) weight-only matmul for decode-sized steps: int4 / int8 / fp8 weights streamed once.

`int_matmul(x [M, K], w: Int4NK | Int8NK | Fp8NK) -> [M, N]` for up to MAX_ROWS rows, w made
once by `to_nk` from a QArray:
  int4  w = q * s + o per group of GROUP rows along K and output column (`quantize_int4`'s
        asymmetric g128): signed nibbles q - 8 as jnp.int4 [N, K], scale and offset
        [K / GROUP, N] as stored (float16);
  int8  w = q * s per output column (`quantize_int8`): int8 [N, K], scale [1, N];
  fp8   weight-only blocks (HF FP8's 128 x 128 `weight_scale_inv`, or per tensor): the e4m3
        values as stored ([N, K] already), the block scales expanded to [K / GROUP, N].

As `qmatmul_mosaic.py` for fp8 W8A8, the roles are swapped for decode: the weight's N rows are
wgmma's M side and the M <= 64 rows of x (padded to a multiple of 8) its N side. A step's
[bn, GROUP] weight tile is loaded from shared memory into registers and converted there, to
bf16 for the integers (Mosaic's int4 / int8 -> bf16 conversions are bit operations; every
value is exact) and to f16 for fp8 (the one fp8 conversion Mosaic has; x rows are then f16
too), and is wgmma's A operand from registers; x^T is a transposed view of the [Mp, GROUP] x
tile. Each step's product goes to a fresh float32 accumulator and then into the running
total, scaled per row where the kind has per-step scales; for int4:

    total[n, m] += (q_g x_g^T)[n, m] * s[g, n] + (o[g, n] + 8 s[g, n]) * sum_k x_g[m, k]

so no dequantized weight exists anywhere, not even in registers, and the only float work per
weight is the conversion (the scaling is per [bn, Mp] output, 4 elements a thread). The group
sums of x ([K / GROUP, Mp], float32) come from one small XLA reduction before the kernel; int8's
per-channel scale is applied by the XLA epilogue.

Grid (N / bn strips, k_splits), the splits' float32 partials [k_splits, N, Mp] summed by the
XLA epilogue, as in the fp8 W8A8 kernel. The body reads its slot's tiles with plain loads, so
it ends with a proxy fence (`commit_smem`) before the pipeline refills the slot by TMA. Checked
in Mosaic GPU's CPU interpreter (where wgmma takes its A operand from a staged shared-memory
copy) against the dequantized product in tests/test_qmatmul_int_mosaic.py, and lowered for cuda
there. In the engine (one Hopper GPU) the warm-up measures it per layout ("mosaic_nk/<tiling>",
`quantization/choice.py`) against the paths that read the stored layout; where it is faster
over the decode-sized buckets the weights are made over once (`choice.relayout`) and every
decode step uses it (prefill-sized steps: x @ the dequantized weight through XLA).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxllm.kernels import mgpu_compat
from jaxllm.kernels.qmatmul_mosaic import SMEM_LIMIT, grid_splits, padded_rows

MAX_ROWS = 64
GROUP = 128  # K rows per pipeline step (= int4's scale group)
KERNEL_NAME = "jaxllm_int_matmul"
XS_MIN = 32  # int4's x group-sum rows are padded to a multiple of 32 float32 (128 bytes): each
# pipeline slot of a TMA destination must start 128-byte aligned; [1, 8] slots of 32 bytes
# faulted on an H100 ("misaligned address", 1-row steps; 64 rows were fine), session 25


def xs_width(Mp: int) -> int:
    """Columns of int4's x group sums: Mp rounded up to whole 128-byte slots."""
    return -(-Mp // XS_MIN) * XS_MIN


class _NK:
    """What the re-laid-out weights share: the QArray's reading in `quantization/choice.layout_key`
    (kind, act, group, pack, shape), layer indexing, `x @ w`."""
    act = "none"
    pack = 0

    @property
    def shape(self) -> tuple[int, ...]:
        """The float weight's [..., K, N]."""
        v = self.values.shape
        return (*v[:-2], v[-1], v[-2])

    def __getitem__(self, i):
        """Index the leading (layer) axes of every part."""
        return jax.tree.map(lambda a: a[i], self)

    def __rmatmul__(self, x: jax.Array) -> jax.Array:
        from jaxllm.quantization.kernels import matmul
        return matmul(x, self)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Int4NK(_NK):
    """An int4 g128 weight for `x @ w` laid out for this kernel."""
    values: jax.Array  # jnp.int4 [..., N, K]: q - 8, q the stored nibble in [0, 16)
    scale: jax.Array  # [..., K / GROUP, N] as stored (float16)
    offset: jax.Array  # [..., K / GROUP, N] as stored: w = (q - 8) s + (o + 8 s)
    kind = "int4"
    group = GROUP

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        """The float weight [..., K, N] (the XLA path at prefill-sized steps; checks)."""
        q = jnp.swapaxes(self.values.astype(jnp.float32), -1, -2)  # [..., K, N]
        s = jnp.repeat(self.scale.astype(jnp.float32), GROUP, axis=-2)
        o = jnp.repeat(self.offset.astype(jnp.float32), GROUP, axis=-2)
        return (q * s + o + 8.0 * s).astype(dtype)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Int8NK(_NK):
    """A per-channel int8 weight for `x @ w` laid out for this kernel."""
    values: jax.Array  # int8 [..., N, K]
    scale: jax.Array  # float32 [..., 1, N]
    kind = "int8"

    @property
    def group(self) -> int:
        return self.values.shape[-1]

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        q = jnp.swapaxes(self.values.astype(jnp.float32), -1, -2)
        return (q * self.scale.astype(jnp.float32)).astype(dtype)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Fp8NK(_NK):
    """A weight-only fp8 weight in blocks (HF FP8 `weight_scale_inv`, 128 x 128; per tensor) for
    `x @ w`: the values as stored, the block scales expanded to one a row per 128 of K."""
    values: jax.Array  # float8_e4m3fn [..., N, K] (the QArray's own array)
    scale: jax.Array  # float32 [..., K / GROUP, N]: the scale of row n over K rows g*128..+127
    kind = "fp8"
    pack = 0

    @property
    def group(self) -> int:
        return 0  # as `choice.layout_key` keys every fp8 layout

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        q = jnp.swapaxes(self.values.astype(jnp.float32), -1, -2)
        return (q * jnp.repeat(self.scale, GROUP, axis=-2)).astype(dtype)


def takes(w) -> bool:
    """Whether `to_nk` takes this weight: an int4 QArray in groups (and nibble runs) of GROUP
    rows, or a per-channel int8 one, with K a multiple of GROUP."""
    from jaxllm.quantization.qarray import QArray

    if not isinstance(w, QArray) or w.shape[-2] % GROUP:
        return False
    if w.kind == "int4":
        return w.group == GROUP and (w.pack or w.group) == GROUP
    if w.kind == "fp8":  # weight-only blocks whose K extent is whole steps
        from jaxllm.kernels.qmatmul import fp8_group
        g = fp8_group(w)
        return w.act == "none" and w.values.dtype == jnp.float8_e4m3fn and g is not None and g % GROUP == 0
    return w.kind == "int8" and w.group == w.shape[-2]


def to_nk(w) -> Int4NK | Int8NK | Fp8NK:
    """An int4 / int8 / weight-only fp8 QArray (`takes`; any leading layer axes) -> this kernel's
    layout (numpy or jax arrays; done once, at load or warm-up)."""
    from jaxllm.quantization.qarray import unpack_int4

    if not takes(w):
        raise ValueError(f"to_nk takes int4 weights in groups of {GROUP}, per-channel int8 or "
                         f"weight-only e4m3 blocks of whole {GROUP}-row steps, got "
                         f"{w.kind} {w.values.shape} g{w.group} p{w.pack}")
    xp = np if isinstance(w.values, np.ndarray) else jnp
    if w.kind == "fp8":  # [..., nb, kb] block scales -> [..., K / GROUP, N]
        N, K = w.values.shape[-2:]
        nb, kb = w.scale.shape[-2:]
        s = xp.repeat(xp.swapaxes(w.scale.astype(np.float32), -1, -2), N // nb, axis=-1)
        return Fp8NK(w.values, xp.repeat(s, K // kb // GROUP, axis=-2))
    if w.kind == "int8":
        return Int8NK(xp.swapaxes(w.values, -1, -2), w.scale.astype(np.float32))
    q = unpack_int4(w.values, GROUP, xp).astype(np.int8) - 8  # [..., K, N]
    offset = w.offset if w.offset is not None else xp.zeros_like(w.scale)
    return Int4NK(xp.asarray(xp.swapaxes(q, -1, -2)).astype(jnp.int4), w.scale, offset)


@dataclasses.dataclass(frozen=True)
class Tiling:
    block_n: int = 64  # weight rows per CTA: wgmma's M (a multiple of 64)
    stages: int = 6
    k_splits: int = 1

    @property
    def name(self) -> str:
        return f"mi_{self.block_n}s{self.stages}k{self.k_splits}"

    @classmethod
    def parse(cls, name: str) -> "Tiling":
        bn, rest = name.removeprefix("mi_").split("s")
        st, ks = rest.split("k")
        return cls(int(bn), int(st), int(ks))


SHAPES = ((64, 8), (128, 6))  # (block_n, stages): 4-16 KB of weight a slot


def slot_blocks(kind: str, block_n: int, Mp: int) -> list[tuple[str, tuple[int, int], object]]:
    """(role, block shape, dtype) of each operand the pipeline copies a step, in the kernel's
    order: the weight tile, int4's scale / offset rows and x group sums, fp8's row scales, the x
    tile. Every block is a whole number of 128-byte units (`XS_MIN`)."""
    w = {"int4": jnp.int4, "int8": jnp.int8, "fp8": jnp.float8_e4m3fn}[kind]
    out = [("w", (block_n, GROUP), w)]
    if kind == "int4":
        out += [("row", (1, block_n), jnp.float16), ("row", (1, block_n), jnp.float16),
                ("xs", (1, xs_width(Mp)), jnp.float32)]
    elif kind == "fp8":
        out.append(("row", (1, block_n), jnp.float32))
    return out + [("x", (Mp, GROUP), jnp.float16 if kind == "fp8" else jnp.bfloat16)]


def smem_bytes(M: int, t: Tiling, kind: str) -> int:
    """Shared memory of a tiling at M rows: `stages` slots of the weight tile, the x tile (2-byte)
    and the scale rows, the float32 output tile, and 4 KiB for Mosaic's padding of the small
    tiles and its barriers (its own count was 16-2,600 bytes above the rest on the shapes
    probed: int4 / int8 / fp8, 1 and 64 rows, 64 / 128 weight rows, 2 / 4 stages)."""
    Mp = padded_rows(M)
    slot = t.block_n * GROUP * (1 if kind == "int4" else 2) // 2 + Mp * GROUP * 2
    slot += {"int4": 2 * t.block_n * 2 + xs_width(Mp) * 4, "fp8": t.block_n * 4}.get(kind, 0)
    return t.stages * slot + t.block_n * Mp * 4 + 4096


def unsupported(M: int, K: int, N: int, t: Tiling, kind: str = "int4") -> str | None:
    if M > MAX_ROWS:
        return f"{M} rows (decode-sized steps only, <= {MAX_ROWS})"
    if t.block_n % 64 or N % t.block_n:
        return f"N={N} is not a multiple of block_n={t.block_n} (itself a multiple of 64)"
    if K % (GROUP * t.k_splits):
        return f"K={K} is not a multiple of {GROUP} x k_splits={t.k_splits}"
    if smem_bytes(M, t, kind) > SMEM_LIMIT:
        return f"{smem_bytes(M, t, kind)} bytes of shared memory at {M} rows ({kind})"
    return None


def tilings_for(M: int, K: int, N: int, num_sms: int = 132, kind: str = "int4") -> list[Tiling]:
    """Each shape with the fewest K splits (a power of two) giving one CTA per SM, and twice that;
    as many stages as fit in shared memory, up to the shape's."""
    out = []
    for bn, st in SHAPES:
        if N % bn:
            continue
        while st > 2 and smem_bytes(M, Tiling(bn, st), kind) > SMEM_LIMIT:
            st -= 1
        for k in grid_splits(N // bn, K // GROUP, num_sms):
            t = Tiling(bn, st, k)
            if unsupported(M, K, N, t, kind) is None and t not in out:
                out.append(t)
    return out


def _body(x_gmem, w_gmem, *refs, t: Tiling, K: int, kind: str, interpret: bool):
    """refs: int4: (scale, offset, x group sums), fp8: (row scales,), then out and the scratch."""
    int4 = kind == "int4"
    if int4:
        s_gmem, o_gmem, xs_gmem, out_gmem, *scratch = refs
    elif kind == "fp8":
        s_gmem, out_gmem, *scratch = refs
    else:
        out_gmem, *scratch = refs
    cdt = x_gmem.dtype  # the wgmma operands: bf16 (integers), f16 (fp8: Mosaic converts it to f16 only)
    j, ks = lax.axis_index("n"), lax.axis_index("k")
    steps = K // (GROUP * t.k_splits)
    Mp = x_gmem.shape[0]
    bn = t.block_n

    def product(a, x_smem):
        """The step's q x^T [bn, Mp] float32: A (bf16) from registers, B = x^T (the interpreter
        takes both from shared memory: staged copies)."""
        def mm(acc_ref):
            if interpret:
                scratch[1][...] = a
                b = x_smem.transpose((1, 0)) if mgpu_compat.INTERPRETER_TRANSPOSES else scratch[2]
                if not mgpu_compat.INTERPRETER_TRANSPOSES:
                    scratch[2][...] = x_smem[...].T
                plgpu.wgmma(acc_ref, scratch[1], b)
            else:
                plgpu.wgmma(acc_ref, a, x_smem.transpose((1, 0)))
            plgpu.wgmma_wait(0)  # the slot's tiles are released when the step returns
            return acc_ref[...]
        return pl.run_scoped(mm, plgpu.ACC((bn, Mp)))

    def step(_, w_smem, *smem):
        *groups, x_smem, total = smem
        part = product(w_smem[...].astype(cdt), x_smem)  # stored values -> cdt in registers
        if kind == "fp8":
            part = part * lax.broadcast_in_dim(groups[0][0, :], (bn, Mp), [0])
        if int4:
            s_smem, o_smem, xs_smem = groups
            s = s_smem[0, :].astype(jnp.float32)
            o = o_smem[0, :].astype(jnp.float32) + 8.0 * s  # the stored offset of q, not q - 8
            part = (part * lax.broadcast_in_dim(s, (bn, Mp), [0])
                    + lax.broadcast_in_dim(o, (bn, Mp), [0]) * lax.broadcast_in_dim(xs_smem[0, :Mp], (bn, Mp), [1]))
        plgpu.commit_smem()  # the slot's plain reads, ordered before the TMA that refills it
        return total + part

    g0 = ks * steps
    srcs = [w_gmem] + ([s_gmem, o_gmem, xs_gmem] if int4 else [s_gmem] if kind == "fp8" else []) + [x_gmem]
    column = {"w": lambda k: (j, g0 + k), "row": lambda k: (g0 + k, j), "x": lambda k: (0, g0 + k),
              "xs": lambda k: (g0 + k, 0)}  # block index of each operand's step-k tile
    specs = [plgpu.BlockSpec(shape, column[role]) for role, shape, _ in slot_blocks(kind, bn, Mp)]
    total = plgpu.emit_pipeline(
        step,
        grid=(steps,),
        in_specs=specs,
        max_concurrent_steps=t.stages,
        init_carry=jnp.zeros((bn, Mp), jnp.float32),
    )(*srcs)
    o_smem = scratch[0]
    o_smem[...] = total
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem, out_gmem.at[ks, pl.ds(j * bn, bn)])
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def int_matmul(x: jax.Array, w: Int4NK | Int8NK | Fp8NK, tiling: Tiling, interpret: bool = False) -> jax.Array:
    """x [..., K] @ w ([K, N] as `Int4NK` / `Int8NK` / `Fp8NK`) -> [..., N] in x's dtype (rows
    taken as bf16; f16 for fp8, whose values Mosaic converts to f16 only)."""
    K, N = w.shape
    lead = x.shape[:-1]
    x2 = x.reshape(-1, K)
    M = x2.shape[0]
    why = unsupported(M, K, N, tiling, w.kind)
    if why is not None:
        raise ValueError(f"int_matmul {tiling.name}: {why}")
    kind = w.kind
    int4 = kind == "int4"
    cdt = jnp.float16 if kind == "fp8" else jnp.bfloat16
    Mp = padded_rows(M)
    xb = jnp.pad(x2.astype(cdt), ((0, Mp - M), (0, 0)))
    args = [xb, w.values] + ([w.scale] if kind == "fp8" else [])
    if int4:
        xsum = xb.astype(jnp.float32).reshape(Mp, K // GROUP, GROUP).sum(-1).T  # [K / GROUP, Mp]
        xsum = jnp.pad(xsum, ((0, 0), (0, xs_width(Mp) - Mp)))  # 128-byte slots (XS_MIN)
        args += [w.scale, w.offset, xsum]
    scratch = [plgpu.SMEM((tiling.block_n, Mp), jnp.float32)]
    params = {}
    if interpret:
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
        params["interpret"] = InterpretGPUParams(detect_races=True)
        scratch += [plgpu.SMEM((tiling.block_n, GROUP), cdt)]
        if not mgpu_compat.INTERPRETER_TRANSPOSES:
            scratch += [plgpu.SMEM((GROUP, Mp), cdt)]
    out = plgpu.kernel(
        functools.partial(_body, t=tiling, K=K, kind=kind, interpret=interpret),
        out_type=jax.ShapeDtypeStruct((tiling.k_splits, N, Mp), jnp.float32),
        grid=(N // tiling.block_n, tiling.k_splits), grid_names=("n", "k"), kernel_name=KERNEL_NAME,
        scratch_types=scratch,
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        **params,
    )(*args)
    y = (out.sum(axis=0) if tiling.k_splits > 1 else out[0])[:, :M].T
    if kind == "int8":
        y = y * w.scale.reshape(1, N).astype(jnp.float32)
    return y.astype(x.dtype).reshape(*lead, N)
