"""Start-up of the device side: the kernels chosen by measurement (quantized matmul paths and
the weight layouts they need, the MoE grouped matmul), then every (tokens, rows) bucket of the
step compiled and run once on padding, and the sampler compiled for the step's logits. A mixin of
`ModelRunner` (engine/runner.py)."""

from __future__ import annotations

import logging
import time

import jax
import numpy as np

from jaxllm.engine.batch import HostBatch, compiled_pairs
from jaxllm.engine.compile import compile_all
from jaxllm.engine.device_batch import Batch

log = logging.getLogger("jaxllm")


class Warmup:
    def relayout_weights(self) -> None:
        """Give the weights the layouts the warm-up's measurement chose (`choice.relayout`: int4 /
        int8 for the Mosaic integer kernel), before any step is compiled; the step's flat weight list
        is rebuilt (the kv-scale entry found again and kept as it was)."""
        from jaxllm.quantization import choice
        if not choice.NK_LAYOUTS:
            return
        self.params = choice.relayout(self.params)
        if self.layer_params is not None:
            self.layer_params = choice.relayout(self.layer_params)
        kv_scale = None if self._kv_scale_index is None else self.flat_params[self._kv_scale_index]
        self.flat_params, self._params_def = jax.tree.flatten(self.step_params)
        if kv_scale is not None:  # as calibration left it
            paths = [jax.tree_util.keystr(p) for p, _ in
                     jax.tree_util.tree_flatten_with_path(self.step_params)[0]]
            self._kv_scale_index = next(i for i, p in enumerate(paths) if "'kv_scale'" in p)
            self.flat_params[self._kv_scale_index] = kv_scale
        log.info("int4 / int8 weights re-laid out [N, K] for the Mosaic integer kernel: %s",
                 sorted(choice.NK_LAYOUTS))

    def _empty_batch(self, T: int, R: int) -> HostBatch:
        """A (T, R) batch of padding only: it reads and writes no page."""
        return HostBatch(
            tokens=np.zeros(T, np.int32), positions=np.full(T, -1, np.int32),
            token_req=np.zeros(T, np.int32), slot_mapping=np.full(T, -1, np.int32),
            block_tables=np.zeros((R, self.max_blocks), np.int32),
            seq_lens=np.zeros(R, np.int32), query_start_loc=np.zeros(R + 1, np.int32),
            num_seqs=np.zeros(1, np.int32), logits_indices=np.zeros(R, np.int32), num_rows=0)

    def warmup_sampler(self, sampler, num_rows: int) -> None:
        """Compile the sampler for logits as `execute` returns them.

        On one device those are uncommitted arrays, like the sampler's own warm-up
        zeros. Over a mesh they are committed to a mesh device, and jit keys its
        cache on that, so the warm-up's zeros are moved there first. Followers
        never sample.
        """
        if self.tp is None:
            return sampler.warmup(num_rows)
        if self.channel is not None and not self.channel.is_leader:
            return None
        device, sample = self.tp.local_devices[0], sampler.sample
        sampler.sample = lambda logits, batch: sample(jax.device_put(logits, device), batch)
        try:
            sampler.warmup(num_rows)
        finally:
            del sampler.sample  # back to the class's method

    def measure_kernels(self, token_buckets: tuple[int, ...]) -> None:
        """One GPU: the quantized matmuls' paths (and the weight layouts they need) and the MoE
        grouped matmul, chosen by timing them at these token buckets (`quantization/choice.py`,
        `models/gmm.py`). Once, before the pool sizing compiles its probe step where the engine
        passes its buckets at construction: the probe then holds the kernels the steps will run
        (with XLA's fp8 GEMM in their place, its autotuning at 16,384 rows took 104 s of an H200
        start-up, and an unchosen MoE bucket falls back to ragged_dot, whose HLO expands every
        row against every expert)."""
        if self._kernels_measured:
            return
        self._kernels_measured = True
        if self.platform == "gpu" and self.tp is None:  # quantized linears: paths by measurement
            from jaxllm.quantization import choice
            weights = choice.quantized_leaves(self.params, self.layer_params)
            if weights:
                t0 = time.perf_counter()
                log.info("timing the quantized matmuls' paths at tokens %s ...", tuple(token_buckets))
                choice.measure(weights, list(token_buckets), self.dtype)
                self.relayout_weights()
                log.info("quantized matmuls' paths chosen in %.1f s", time.perf_counter() - t0)
        if self.platform == "gpu" and self.tp is None and self.layer_params is not None:
            self.measure_dense_gemv(token_buckets)
        if self.gmm_chooser is not None:
            m = self.model_cfg
            self.gmm_chooser.measure([T * m.moe.top_k for T in token_buckets], m.moe.num_experts,
                                     m.hidden_size, m.moe.moe_intermediate_size, self.dtype,
                                     top_k=m.moe.top_k)

    def measure_dense_gemv(self, token_buckets: tuple[int, ...]) -> None:
        """The dense linears of one- and two-token buckets: XLA's dot or `kernels/gemv.py`, by
        measurement (`models/gemv_choice.py`; JAXLLM_DENSE_GEMV=0: XLA's dot, nothing timed)."""
        from jaxllm.envs import env_choice
        from jaxllm.kernels.gemv import MAX_ROWS
        from jaxllm.models import gemv_choice

        rows = [T for T in token_buckets if T <= MAX_ROWS]
        shapes = gemv_choice.dense_shapes(self.layer_params)
        if not rows or not shapes or env_choice("JAXLLM_DENSE_GEMV", "1", ("0", "1")) == "0":
            return
        t0 = time.perf_counter()
        try:
            gemv_choice.measure(shapes, rows)
        except Exception as e:  # noqa: BLE001 - XLA's dot, always correct, stays every linear's path
            gemv_choice.clear()
            log.warning("dense linears: gemv not measured (%s: %s); XLA's dot everywhere",
                        type(e).__name__, str(e).splitlines()[0][:200] if str(e) else "")
            return
        log.info("dense linears at %s tokens timed in %.1f s", rows, time.perf_counter() - t0)

    def warmup(self, token_buckets: tuple[int, ...], seq_buckets: tuple[int, ...]) -> float:
        """Compile every (T, R) pair of `compiled_pairs`, then run each once, writing nothing
        to the cache. One process: compiled ahead of time on a thread pool (`engine/compile.py`)
        and kept per pair. Several: the leader runs the steps, so that the followers compile
        each as its broadcast batch reaches them.
        """
        t0 = time.perf_counter()
        if self.channel is not None and not self.channel.is_leader:
            return 0.0
        self.measure_kernels(token_buckets)
        pairs = compiled_pairs(token_buckets, seq_buckets)
        if self.channel is None:
            sharding = None if self.tp is None else self.tp.replicated
            self._compiled = compile_all(lambda T, R: self._lower(self._step, T, R, sharding), pairs)
            if self.platform == "gpu" and self.tp is None:
                self.choose_decode_steps(pairs)
        for T, R in pairs:
            jax.block_until_ready(self.execute(self._empty_batch(T, R)))
        if self.eplb is not None:
            if self.channel is not None:
                self.channel.send_eplb_warmup()
            self.eplb.warmup(self)
        return time.perf_counter() - t0

    def _lower(self, step, T: int, R: int, sharding=None):
        return step.lower(self.flat_params, self.kv_pages,
                          Batch.from_host(self._empty_batch(T, R), sharding, self.spec_width), self.no_ids)

    def choose_decode_steps(self, pairs: list[tuple[int, int]], steps: int = 10, rounds: int = 3) -> None:
        """Decode-only pairs (tokens == rows) whose measured quantized-matmul paths include a
        Mosaic GPU custom call are compiled again with the fastest graphable paths, both
        executables are timed on padding (`rounds` runs of `steps` back-to-back steps, the
        median), and the faster is kept (`quantization/step_choice.py`). Sets `step_choice`:
        pair -> (kept, measured s, graphable s)."""
        from jaxllm.quantization import step_choice

        alts = {p: step_choice.alternative(p[0]) for p in pairs if p[0] == p[1]} if step_choice.enabled() else {}
        alts = {p: a for p, a in alts.items() if a}
        if not alts:
            return
        t0 = time.perf_counter()
        jitted = self._jit_step(self.compiler_options, fresh=True)  # traced anew: the table is read then

        def lower(T: int, R: int):
            with step_choice.swapped(alts[(T, R)]):
                return self._lower(jitted, T, R)
        try:
            graphable = compile_all(lower, list(alts))
        except Exception as e:  # noqa: BLE001 - the measured paths stay
            log.warning("decode steps with graphable matmul paths did not compile (%s); measured paths kept",
                        str(e)[:300])
            return
        for pair, exe in graphable.items():
            measured = self._compiled[pair]
            t_m, t_g = self._time_executables(pair, [measured, exe], steps, rounds)
            keep = step_choice.keep_graphable(t_m, t_g)
            self._compiled[pair] = exe if keep else measured
            self.step_choice[pair] = ("graphable" if keep else "measured", t_m, t_g)
        log.info("decode steps, matmul paths as measured alone vs graphable (%s): %s; chosen in %.1f s",
                 "JAXLLM_STEP_CHOICE=0 skips this",
                 {p: f"{k} ({m * 1e3:.3f} / {g * 1e3:.3f} ms)" for p, (k, m, g) in self.step_choice.items()},
                 time.perf_counter() - t0)

    def _time_executables(self, pair: tuple[int, int], exes: list, steps: int, rounds: int) -> list[float]:
        """Seconds a step of each executable on a padding batch, `steps` back to back (host
        launches and device time overlapped as when serving), the median of `rounds` taken in
        turn (each round times every executable, so drift in the card's clocks hits all alike)."""
        hb = self._empty_batch(*pair)
        times: list[list[float]] = [[] for _ in exes]
        for r in range(rounds + 1):  # round 0: each run once, untimed
            for i, exe in enumerate(exes):
                self._compiled[pair] = exe
                t0 = time.perf_counter()
                for _ in range(steps if r else 1):
                    out = self.execute(hb)
                jax.block_until_ready(out)
                if r:
                    times[i].append((time.perf_counter() - t0) / steps)
        return [float(np.median(t)) for t in times]
