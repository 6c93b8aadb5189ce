"""A small draft model with the target's vocabulary: `{"method": "draft_model", "model": ...}`.

KV: the draft has its own page array `[L_d, 2, K_d, P, S, D_d]` with the target's P pages,
indexed by the target's block tables: block b of a request holds the target's K/V in the
target's pages and the draft's K/V in the draft's, so allocation, prefix hits, forks,
rollback and preemption are the target's own bookkeeping. Two jitted programs write it:

* `shadow` (after every target step, on the dispatch thread): the draft runs over the
  step's batch as it is (same tokens, positions and slots) and only writes K/V; no logits.
  The draft's cache then covers what the target's covers. Rejected drafts leave stale
  K/V past the accepted tokens, which the next step's tokens overwrite, as in the
  target's pages. Page copies and swaps of the step are applied to the draft's pages too.
* `loop` (when the host proposes): one `lax.fori_loop` of k greedy draft steps for
  every ready request at once, from its last token at its last position, writing K/V
  into the lookahead slots the scheduler keeps (`num_lookahead_tokens`). One dispatch
  and one fetch per step, none per draft token.

Tensor parallelism (one process): the draft is split over the target's mesh as the target
is (`jaxllm.parallel.TensorParallel` over the same first N devices): query and KV heads and
the MLP over 'tp', embedding and LM head by vocabulary, its pages by KV head. Replicating
it instead would hold its whole KV pool on every device (a 1B draft's pages cost more per
block than an 8B target's share at tp=8) and run its steps N times over; split, each
device holds 1/N of both, and the draft's pages follow the target's block ids as before.

Proposals are the draft's argmax (a point-mass q), which the rejection sampler
verifies exactly. Zero compiles after warm-up: `warmup` compiles `shadow` for every
(tokens, rows) bucket pair and `loop` for every rows bucket.
"""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxllm.engine.batch import HostBatch, compiled_pairs, pick_bucket
from jaxllm.engine.kv_ops import KVOps, committed
from jaxllm.engine.device_batch import Batch
from jaxllm.engine.runner import pick_attention
from jaxllm.kernels.metadata import AttentionMetadata
from jaxllm.models import registry
from jaxllm.models.llama_state import load_state
from jaxllm.runtime.request import Request
from jaxllm.spec.draft import split_layout

log = logging.getLogger("jaxllm")


def load_draft(path: str, load_format: str, cache_dir: str | None) -> tuple[dict, dict | None]:
    """(hf config, numpy weights; None with load_format='dummy') of the draft at `path`."""
    if load_format == "dummy":
        from jaxllm.spec.draft import draft_hf_config
        return draft_hf_config(path), None
    import os
    from jaxllm.models.loader import is_converted, load_model_files, resolve_model
    src = resolve_model(path)
    if os.path.isdir(src) and not is_converted(src):  # a draft needs no tokenizer of its own
        from jaxllm.models.hf_files import load_hf_folder
        return load_hf_folder(src)
    hf, weights, _ = load_model_files(src, cache_dir)  # GGUF or converted: via the cache
    return hf, weights


def page_bytes(hf: dict, block_size: int, dtype, tp: int = 1) -> int:
    """Bytes one block of the draft's pages takes on each device (added to the target's when
    sizing the pool): its share of the KV heads over `tp` devices."""
    m = registry.resolve(hf).config(hf)
    heads = m.num_kv_heads if tp == 1 else _layout(m, tp).kv_heads_per_device
    return m.num_layers * 2 * heads * block_size * m.head_dim * jnp.dtype(dtype).itemsize


def _layout(m, tp: int):
    if m.moe is not None:
        raise ValueError("speculative_config.model: a mixture-of-experts draft with "
                         "tensor_parallel_size > 1 is not implemented")
    return split_layout(m, tp, "draft")


def place_weights(hf: dict, weights: dict | None, dtype, attention_backend: str | None = None,
                  seed: int = 0, tp: int = 1, unroll: bool | None = None,
                  queries_per_request: int = 1) -> tuple:
    """The draft's module on the device(s): (model config, graphdef, flat weights, their
    treedef, its `TensorParallel` or None). With `tp` > 1 every weight is placed shard by
    shard on the target's mesh (the first `tp` devices, as the runner's). `unroll`: one array
    per layer, the runner's accelerator layout (default: on unless on CPU).
    `queries_per_request`: k + 1, the tokens of a request its shadow pass over a verified step
    carries (the decode kernel reads the request's pages once for them: runner.pick_attention).

    The engine calls this before the target's runner sizes the KV pool, so the pool is sized
    from the memory left beside both models' weights."""
    platform = jax.devices()[0].platform
    entry = registry.resolve(hf)
    m = entry.config(hf)
    attn = pick_attention(attention_backend, platform, queries_per_request)
    par, embed_fn, ckpt = None, None, m
    if tp > 1:
        from jaxllm.parallel import TensorParallel
        _layout(m, tp)
        par = TensorParallel(m, tp, split_axes=entry.split_axes(False))
        attn, embed_fn, m = par.attention(attn), par.embedding(), par.model_cfg
    make = lambda c=m: entry.model_cls(c, dtype, rngs=nnx.Rngs(seed), attention_fn=attn, embed_fn=embed_fn)
    if par is not None:
        state = None if weights is None else entry.to_state(ckpt, weights, dtype, consume=True)
        graphdef, params = par.build_params(make, lambda: make(ckpt), state)
    elif weights is None:  # load_format="dummy": random weights drawn on the device
        graphdef, _ = nnx.split(nnx.eval_shape(make))
        params = jax.jit(lambda: nnx.state(make()))()
    else:
        model = nnx.eval_shape(make)
        load_state(model, entry.to_state(m, weights, dtype, consume=True))
        graphdef, params = nnx.split(model)
    unroll = platform != "cpu" if unroll is None else unroll
    layers = entry.split_layers(params, m, shards=tp) if unroll else None
    if par is not None and layers is not None:
        layers = par.place_layers(params, layers)
    flat, treedef = jax.tree.flatten(params if layers is None else (params, layers))
    return m, graphdef, flat, treedef, par


class DraftModelProposer:
    takes_requests = True  # propose() gets the ready requests, not token histories

    def __init__(self, hf: dict, weights: dict | None, *, k: int, dtype, num_blocks: int,
                 block_size: int, max_blocks: int, max_copies: int, num_host_blocks: int,
                 kv, no_ids: jax.Array, seq_buckets: tuple[int, ...], attention_backend: str | None = None,
                 seed: int = 0, placed: tuple | None = None, tp: int = 1):
        """`placed`: `place_weights`' result (else the weights are placed here, over `tp` devices)."""
        self.k, self.block_size, self.max_blocks = k, block_size, max_blocks
        self.kv = kv  # the target's KVCacheManager: its block tables index these pages too
        self.no_ids = no_ids
        self.dtype = dtype
        self.seq_buckets = seq_buckets  # rows buckets of `loop`
        placed = placed or place_weights(hf, weights, dtype, attention_backend, seed, tp)
        self.model_cfg, self.graphdef, self.flat, self._def, self.tp = placed
        m = self.model_cfg
        shape = (m.num_layers, 2, m.num_kv_heads, num_blocks, block_size, m.head_dim)
        if self.tp is None:
            self.pages = committed(jnp.zeros(shape, dtype))  # as KVOps leaves them: one jit variant
            self._shadow = jax.jit(self._shadow_impl, donate_argnums=(1,))
            self._loop = jax.jit(self._loop_impl, donate_argnums=(1,))
        else:  # fixed shardings: the pages stay split in place, a mis-placed input is an error
            self.pages = self.tp.zeros(shape, dtype)
            w, kv, rep = [x.sharding for x in self.flat], self.tp.kv_sharding, self.tp.replicated
            self._shadow = jax.jit(self._shadow_impl, donate_argnums=(1,), in_shardings=(w, kv, rep, rep),
                                   out_shardings=kv)
            self._loop = jax.jit(self._loop_impl, donate_argnums=(1,), in_shardings=(w, kv, *[rep] * 4),
                                 out_shardings=(kv, rep))
        self.kv_ops = KVOps(num_blocks, max_copies, num_host_blocks, self.pages)
        log.info("draft model %s: %d layers, hidden %d, %.1f MiB weights, %.1f MiB KV pages",
                 m.architecture, m.num_layers, m.hidden_size,
                 sum(x.nbytes for x in self.flat) / 2**20, self.pages.nbytes / 2**20)

    # -- device programs ---------------------------------------------------------------
    def _model(self, flat):
        params = self._def.unflatten(flat)
        params, layers = params if isinstance(params, tuple) else (params, None)
        return nnx.merge(self.graphdef, params), layers

    def _precision(self):
        return jax.default_matmul_precision("highest" if self.dtype == jnp.float32 else None)

    def _shadow_impl(self, flat, pages, batch: Batch, prev_ids):
        model, layers = self._model(flat)
        with self._precision():
            out = model(pages, batch.tokens(prev_ids), batch.md, jnp.zeros((0,), jnp.int32), layers)
        return out[0]

    def _loop_impl(self, flat, pages, tok0, pos0, count, tables):
        """tok0/pos0/count [R], tables [R, B] -> (pages, drafts [R, k]): k greedy steps."""
        model, layers = self._model(flat)
        R, S = tok0.shape[0], self.block_size
        rows = jnp.arange(R, dtype=jnp.int32)
        qsl = jnp.arange(R + 1, dtype=jnp.int32)

        def body(j, carry):
            pages, tok, drafts = carry
            pos = pos0 + j
            col = jnp.minimum(pos // S, tables.shape[1] - 1)
            blk = jnp.take_along_axis(tables, col[:, None], axis=1)[:, 0]
            slot = jnp.where(j < count, blk * S + pos % S, -1)  # only slots the table holds
            md = AttentionMetadata(pos, rows, slot, tables, pos + 1, qsl, jnp.full((1,), R, jnp.int32))
            pages, logits, *_ = model(pages, tok, md, rows, layers)
            nxt = jnp.argmax(logits, axis=-1).astype(jnp.int32)
            return pages, nxt, drafts.at[:, j].set(nxt)

        with self._precision():
            init = (pages, tok0, jnp.zeros((R, self.k), jnp.int32))
            pages, _, drafts = jax.lax.fori_loop(0, jnp.max(count), body, init)
        return pages, drafts

    # -- engine hooks (dispatch thread) ------------------------------------------------------
    def on_kv_ops(self, out) -> None:
        """The step's swap-outs, copies and swap-ins, on the draft's pages."""
        self.kv_ops.swap_out(self.pages, out.swap_out)
        pages = self.kv_ops.copy(self.pages, out.copies)
        self.pages = self.kv_ops.swap_in(pages, out.swap_in)

    def after_forward(self, out, hb: HostBatch, prev_ids: jax.Array | None) -> None:
        self.pages = self._shadow(self.flat, self.pages, Batch.from_host(hb, self.tp and self.tp.replicated),
                                  self.no_ids if prev_ids is None else prev_ids)

    # -- proposals (host) ------------------------------------------------------------------------
    def propose(self, ready: list[Request], room: np.ndarray) -> list[list[int]]:
        """Drafts for each ready request (all tokens computed but the last), at most room[i]."""
        S = self.block_size
        tables = [self.kv.block_ids(r.request_id) for r in ready]
        pos = np.array([r.num_tokens - 1 for r in ready], np.int64)
        # Never past the slots its table holds (the lookahead the scheduler allocated), and
        # not into a block another request shares (a fork's, until its copy-on-write).
        count = np.minimum(room, np.array([len(t) for t in tables]) * S - pos).clip(0)
        for i, r in enumerate(ready):
            table = self.kv.tables.get(r.request_id, ())
            if count[i] and any(b.ref_cnt > 1 for b in table[pos[i] // S:]):
                count[i] = 0
        live = np.flatnonzero(count > 0)
        res: list[list[int]] = [[] for _ in ready]
        if not len(live):
            return res
        R = pick_bucket(self.seq_buckets, len(live))
        tok0, pos0, cnt = (np.zeros(R, np.int32) for _ in range(3))
        tab = np.zeros((R, self.max_blocks), np.int32)
        for j, i in enumerate(live):
            tok0[j] = ready[i].output_token_ids[-1] if ready[i].output_token_ids else ready[i].prompt_token_ids[-1]
            pos0[j], cnt[j] = pos[i], count[i]
            tab[j, :len(tables[i])] = tables[i]
        self.pages, drafts = self._loop(self.flat, self.pages, tok0, pos0, cnt, tab)
        drafts = np.asarray(drafts)
        for j, i in enumerate(live):
            res[i] = drafts[j, :cnt[j]].tolist()
        return res

    # -- start-up --------------------------------------------------------------------------------
    def warmup(self, token_buckets: tuple[int, ...], seq_buckets: tuple[int, ...], max_num_seqs: int) -> None:
        for T, R in compiled_pairs(token_buckets, seq_buckets):  # the target step's shapes
            hb = HostBatch(
                tokens=np.zeros(T, np.int32), positions=np.full(T, -1, np.int32),
                token_req=np.zeros(T, np.int32), slot_mapping=np.full(T, -1, np.int32),
                block_tables=np.zeros((R, self.max_blocks), np.int32),
                seq_lens=np.zeros(R, np.int32), query_start_loc=np.zeros(R + 1, np.int32),
                num_seqs=np.zeros(1, np.int32), logits_indices=np.zeros(R, np.int32), num_rows=0)
            self.after_forward(None, hb, None)
        for R in seq_buckets:
            if R > pick_bucket(seq_buckets, min(max_num_seqs, seq_buckets[-1])):
                break
            z = np.zeros(R, np.int32)
            self.pages, d = self._loop(self.flat, self.pages, z, z, z, np.zeros((R, self.max_blocks), np.int32))
        self.pages = self.kv_ops.warmup(self.pages)
        jax.block_until_ready(self.pages)

    def num_compiled(self) -> int:
        return self._shadow._cache_size() + self._loop._cache_size() + self.kv_ops.num_compiled()
