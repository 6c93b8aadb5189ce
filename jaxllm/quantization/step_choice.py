"""Decode steps compiled two ways, the faster kept: the quantized matmuls' paths as measured alone
(`choice.measure`), and the fastest measured paths that XLA can put in a command buffer.

Timed alone, a Mosaic GPU kernel and a Triton one each cost one launch. In a step, XLA records
runs of kernels into command buffers (CUDA graphs) launched from the host as one, and a Mosaic
GPU custom call ends a run: compiled for an H100 under jax 0.10.2 (`scripts/aot_kernels.py`),
an fp8 Llama-3-8B batch-1 step with the Mosaic matmuls made 480 host launches for 620 kernels,
the same step with the Triton matmuls 65. Whether fewer launches beat faster kernels depends
on the card, the jax version and the batch, so the warm-up times the whole step both ways, on
one GPU, for each decode-only bucket (tokens == rows <= the decode kernels' 64) whose measured
paths include such a call (`engine/warmup.py`). JAXLLM_STEP_CHOICE=0 keeps the measured paths
without it.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

from jaxllm.quantization import choice
from jaxllm.quantization.kernels import NK_PATH

# Paths whose kernel is a Mosaic GPU custom call (no command-buffer support in XLA's registration).
BREAKS_GRAPHS: tuple[str, ...] = ("mosaic/", NK_PATH, "mgpu")
MARGIN = 0.98  # the graphable step is kept only when at least 2% faster (timing noise)


def enabled() -> bool:
    from jaxllm.envs import env_choice
    return env_choice("JAXLLM_STEP_CHOICE", "1", ("0", "1")) == "1"


def breaks_graphs(path: str) -> bool:
    return path.startswith(BREAKS_GRAPHS)


def alternative(rows: int) -> dict[tuple, str]:
    """{layout key at `rows`: its fastest timed path that keeps graphs whole} for each layout
    whose measured path breaks them; {} when there is none, or when one of them is a re-laid-out
    int layout (`choice.NK_LAYOUTS`: its weights take no other path, so the step would keep a
    break) or has no graphable path timed."""
    out = {}
    for key, path in choice._MEASURED.items():
        if key[-1] != rows or not breaks_graphs(path):
            continue
        times = {p: t for p, t in choice.TIMINGS.get(key, {}).items() if not breaks_graphs(p)}
        if key[:-1] in choice.NK_LAYOUTS or not times:
            return {}
        out[key] = choice.fastest(times)
    return out


@contextlib.contextmanager
def swapped(paths: dict[tuple, str]) -> Iterator[None]:
    """`paths` in place of the measured ones while a step is traced (`kernels.path_for` reads
    the table at trace time)."""
    saved = {k: choice._MEASURED[k] for k in paths}
    choice._MEASURED.update(paths)
    try:
        yield
    finally:
        choice._MEASURED.update(saved)


def keep_graphable(measured_s: float, graphable_s: float) -> bool:
    return graphable_s < MARGIN * measured_s
