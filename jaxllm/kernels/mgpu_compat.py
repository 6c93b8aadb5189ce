"""Mosaic GPU helpers the kernels share: calls whose signature differs between the JAX versions
jaxllm runs on, 0.10 (the CPU machines and CI) and 0.11 (the GPU machine), each the one spelling
both accept without a deprecation warning; the swizzled tile layout of TMA'd operands; the
chained warp-specialized pipelines' states (`run_chained`)."""

from __future__ import annotations

import inspect

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

# 0.11 made `load`'s index optional and deprecated passing it ("index the reference via
# ref.at[idx] before passing it"); 0.10 requires it.
_LOAD_TAKES_NO_INDEX = inspect.signature(plgpu.load).parameters["idx"].default is not inspect.Parameter.empty


def load(ref, *, layout=None, optimized: bool = True):
    """`plgpu.load` of a whole (already indexed) SMEM ref into registers of `layout`."""
    if _LOAD_TAKES_NO_INDEX:
        return plgpu.load(ref, layout=layout, optimized=optimized)
    return plgpu.load(ref, (), layout=layout, optimized=optimized)

# 0.11's CPU interpreter reads transposed SMEM views (`ref.transpose`); 0.10's fails on them
# ("'TransposeTransform' object has no attribute 'indices'"), so kernels stage a copy there.
INTERPRETER_TRANSPOSES = jax.__version_info__ >= (0, 11)


def swizzled(cols: int, itemsize: int = 2):
    """Transforms of a shared-memory tile with `cols` minor elements of `itemsize` bytes: 8-row
    tiles of up to 128 bytes, swizzled at that width (what wgmma and TMA read without conflicts)."""
    swizzle = min(128, cols * itemsize)
    return plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle)


def run_chained(run, first, last) -> None:
    """One tile of a CTA that runs its tiles as one chain of warp-specialized pipelines:
    `run(pipeline_state)`, START on the CTA's first tile, STOP on its last, STEADY between. A
    CTA's only tile runs a whole pipeline, `run(None)`: as START its memory thread would leave
    the ring's last releases unawaited (the interpreter: "did not observe all phases"), and no
    state both fills and drains the ring."""
    P = plgpu.PipelinePipeline
    state = jnp.where(first, int(P.START), jnp.where(last, int(P.STOP), int(P.STEADY))).astype(jnp.int32)
    pl.when(first & last)(lambda: run(None))
    pl.when(~(first & last))(lambda: run(state))
