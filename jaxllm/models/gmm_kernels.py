"""The grouped-matmul implementations `models/gmm.py` offers and chooses among, each a callable
`gmm(x [M, K] rows sorted by group, w [G, K, N], group_sizes [G]) -> [M, N]` over one kernel
family (names and what each is for: gmm.py's docstring), some with a one-launch gate/up `pair`,
a whole `sorted_mlp` or an unsorted-row `direct_mlp`."""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

GroupedMatmul = Callable[[jax.Array, jax.Array, jax.Array], jax.Array]


def _mgpu(tiling: tuple[int, ...]) -> GroupedMatmul:
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu

    bm, bn, bk, steps, gbn = tiling

    def gmm(x: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
        sizes = group_sizes.at[-1].add(x.shape[0] - jnp.sum(group_sizes))
        return ragged_dot_mgpu.ragged_dot(x, w, group_sizes=sizes, block_m=bm, block_n=bn, block_k=bk,
                                          max_concurrent_steps=steps, grid_block_n=gbn)
    return gmm


class DecodeGmm:
    """jaxllm's decode kernel at one tiling, with the one-launch gate/up `pair` (`interpret`:
    Pallas' interpreter, for the CPU tests)."""

    def __init__(self, tiling, interpret: bool = False):
        self.tiling = tiling
        self.interpret = interpret

    def __call__(self, x: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
        from jaxllm.kernels import moe_gmm
        return moe_gmm.grouped_matmul(x, w, group_sizes, self.tiling, interpret=self.interpret)

    def pair(self, x, w1, w2, group_sizes):
        from jaxllm.kernels import moe_gmm
        return moe_gmm.grouped_matmul_pair(x, w1, w2, group_sizes, self.tiling, interpret=self.interpret)


class DirectGmm(DecodeGmm):
    """The decode kernel over unsorted rows, one slot a row (`moe_gmm.direct_swiglu`: gate/up and
    down, two launches and nothing between them): `moe.experts` then skips the sort, the group
    sizes and the unsort (a dozen small XLA kernels a layer)."""

    def __init__(self, tiling, interpret: bool = False, down=None):
        super().__init__(tiling, interpret)
        self.down = down  # the down launch's own tiling (None: gate/up's), see `down_variants`

    def direct_mlp(self, rows: int):
        return self._mlp

    def _mlp(self, x, w_gate, w_up, w_down, groups):
        from jaxllm.kernels import moe_gmm
        return moe_gmm.direct_swiglu(x, w_gate, w_up, w_down, groups, self.tiling,
                                     interpret=self.interpret, down_tiling=self.down)


def down_variants(name: str, impl: GroupedMatmul, H: int, F: int) -> dict[str, GroupedMatmul]:
    """The measured best direct implementation with its down launch retiled: each unsplit decode
    tiling (no K-split partials to sum after it), and each one-row tiling split two ways, that fits
    down's [F, H] and is not its own. One tiling serves both launches otherwise, and down (K = F =
    768 for Qwen3-30B-A3B) under `direct_decode_128x64k4` ran at 2.4-2.7x its bytes' time on an
    H100 (session 35), under `direct_row_64x64k4` (split 4 ways: 3 K steps a CTA) at 2.0x on an
    H200, where an unsplit down was slower (session 37)."""
    from jaxllm.kernels import moe_gmm

    if type(impl) is not DirectGmm or impl.down is not None:
        return {}
    return {f"{name}+down_{t.name}": DirectGmm(impl.tiling, impl.interpret, down=t)
            for t in moe_gmm.TILINGS if (t.k_splits == 1 or t.block_m == 1 and t.k_splits == 2)
            and not t.ctas and t != impl.tiling and t.fits(F, H)}


class WsGmm(DecodeGmm):
    """The warp-specialized Hopper kernel for prefill-sized row counts (`kernels/moe_gmm_ws.py`)."""

    def __call__(self, x: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
        from jaxllm.kernels import moe_gmm_ws
        return moe_gmm_ws.grouped_matmul(x, w, group_sizes, self.tiling, interpret=self.interpret)

    def pair(self, x, w1, w2, group_sizes):
        from jaxllm.kernels import moe_gmm_ws
        return moe_gmm_ws.grouped_matmul_pair(x, w1, w2, group_sizes, self.tiling,
                                              interpret=self.interpret)


class WsSplitGmm(WsGmm):
    """The warp-specialized kernel with gate and up as two launches of the one-weight call: in
    session 25's warm-up on an H100 the one-launch `pair` over weights stored apart took ~3x the
    one-weight kernel's time on the fused [E, H, 2F] weight (5.2 vs 1.8 ms, cause not found), so
    the engine measures both."""

    def pair(self, x, w1, w2, group_sizes):
        return self(x, w1, group_sizes), self(x, w2, group_sizes)


class WsGluGmm(WsGmm):
    """A `glu` tiling: gate, up and silu(gate) * up in one launch (`moe.swiglu` takes it), and
    the whole MLP in slot space (`moe_gmm_ws.mlp`: `moe.experts` takes it, unsort included)."""

    def __call__(self, x: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:  # down
        from jaxllm.kernels import moe_gmm_ws
        return moe_gmm_ws.grouped_matmul(x, w, group_sizes, self.tiling.down, interpret=self.interpret)

    def swiglu(self, x, w_gate, w_up, group_sizes):
        from jaxllm.kernels import moe_gmm_ws
        return moe_gmm_ws.swiglu(x, w_gate, w_up, group_sizes, self.tiling, interpret=self.interpret)

    def sorted_mlp(self, rows: int):
        return self._mlp

    def _mlp(self, x, w_gate, w_up, w_down, group_sizes, rows=None):
        from jaxllm.kernels import moe_gmm_ws
        return moe_gmm_ws.mlp(x, w_gate, w_up, w_down, group_sizes, self.tiling, rows=rows,
                              interpret=self.interpret)


class MosaicGmm(DecodeGmm):
    """The Hopper (Mosaic GPU) twin of the decode kernel (`kernels/moe_gmm_mosaic.py`)."""

    def __call__(self, x: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
        from jaxllm.kernels import moe_gmm_mosaic
        return moe_gmm_mosaic.grouped_matmul(x, w, group_sizes, self.tiling)

    def pair(self, x, w1, w2, group_sizes):
        from jaxllm.kernels import moe_gmm_mosaic
        return moe_gmm_mosaic.grouped_matmul_pair(x, w1, w2, group_sizes, self.tiling)
