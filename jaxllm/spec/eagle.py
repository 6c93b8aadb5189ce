"""EAGLE and EAGLE-3 draft heads, in the published checkpoint formats (vLLM's
`EagleLlamaForCausalLM` / `Eagle3LlamaForCausalLM`), fed from the target's hidden states.

A head is one Llama decoder layer over the target's features:

* EAGLE (`{"method": "eagle"}`): x = fc(concat(embed(token), h)) with h the target's final
  (normed) hidden state, the layer without its input norm, logits = target lm_head(out).
  Weights: `fc.weight` [E, 2E], `layers.0.{self_attn,mlp}.*`, `layers.0.post_attention_layernorm`;
  embeddings and LM head are the target's.
* EAGLE-3 (`{"method": "eagle3"}`): h = fc(concat of 3 target layers' input hidden states)
  ([E, 3E]; layers `eagle_config.eagle_aux_hidden_state_layer_ids`, default (2, L/2, L-3)), the
  layer's q/k/v read concat(input_layernorm(embed), hidden_norm(h)) [2E], logits = own lm_head
  over a draft vocabulary mapped to target ids by `d2t` (target = draft + d2t[draft]).
  Weights: `fc.weight`, `midlayer.*`, `norm.weight`, `lm_head.weight`, optional `d2t`,
  `embed_tokens.weight`.

The target step returns those hidden states ([T, n E], `Llama.capture`) and they stay on the
device: the head's program takes the runner's `last_hidden` as its argument (no copy). Its
KV (one layer) lives in its own pages, indexed by the target's block tables (as a draft
model's, `draft_model.py`). The head's entry at position p reads (token p+1, target hidden
at p), so one program per step (`propose`, when the accepted tokens are known): the step's
tokens with their successors (the sampled token after the last accepted one) write the
entries whose inputs are known, the entry at each ready request's last accepted position
gives the first draft, and a `lax.fori_loop` of k-1 more steps feeds the head its own
output hidden state. Proposals are argmax (point-mass q), verified exactly. With tensor
parallelism the head is split over the target's mesh (`eagle_tp.py`).
"""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.engine.batch import HostBatch, compiled_pairs, pick_bucket
from jaxllm.engine.kv_ops import KVOps, committed
from jaxllm.engine.runner import pick_attention
from jaxllm.kernels.metadata import AttentionMetadata
from jaxllm.kernels.ref import write_kv
from jaxllm.models.config import ModelConfig
from jaxllm.models.llama import rms_norm
from jaxllm.models.rope import apply_rope, rope_inv_freq
from jaxllm.models.params import value

log = logging.getLogger("jaxllm")

_LINEARS = {"self_attn.q_proj": "wq", "self_attn.k_proj": "wk", "self_attn.v_proj": "wv",
            "self_attn.o_proj": "wo", "mlp.gate_proj": "w_gate", "mlp.up_proj": "w_up",
            "mlp.down_proj": "w_down"}
_NORMS = {"input_layernorm": "ln_in", "hidden_norm": "hidden_norm", "post_attention_layernorm": "ln_mlp"}


def _err(msg: str) -> ValueError:
    return ValueError(f"speculative_config.model: {msg}")


def aux_layers(hf: dict, method: str, num_layers: int) -> tuple[int, ...]:
    """What the head reads from the target step (`Llama.capture`)."""
    if method == "eagle":
        return (-1,)
    ids = (hf.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") \
        or hf.get("eagle_aux_hidden_state_layer_ids") or (2, num_layers // 2, num_layers - 3)
    ids = tuple(int(i) for i in ids)
    if len(ids) != 3 or not all(0 <= i < num_layers for i in ids):
        raise _err(f"EAGLE-3 reads target layers {ids}, not 3 layers of the target's {num_layers}")
    return ids


def load_head(path: str, method: str, target: ModelConfig) -> tuple[ModelConfig, dict, tuple[int, ...]]:
    """(head config, weights in [in, out] layout, target layers it reads); checks shapes."""
    import os
    from jaxllm.models.hf_files import load_hf_config, load_safetensors, safetensors_files
    from jaxllm.models.loader import resolve_model
    src = resolve_model(path)
    if not os.path.isdir(src):
        raise _err(f"an EAGLE head is a folder (config.json + safetensors), got {src}")
    hf = load_hf_config(src)
    try:
        raw = load_safetensors(safetensors_files(src))
    except (FileNotFoundError, ValueError) as e:
        raise _err(f"cannot load the EAGLE head: {e}") from e
    cfg = ModelConfig.from_hf(dict(hf, model_type="llama"))
    E, Et = cfg.hidden_size, int(hf.get("target_hidden_size") or cfg.hidden_size)
    if Et != target.hidden_size or (method == "eagle" and E != target.hidden_size):
        raise _err(f"the EAGLE head's hidden_size {Et} does not match the target's {target.hidden_size}")
    aux = aux_layers(hf, method, target.num_layers)
    w: dict[str, np.ndarray] = {}
    for name in list(raw):
        key = name[6:] if name.startswith("model.") else name
        key = key.replace("midlayer.", "layers.0.")
        if key.startswith("layers.0."):
            part = key[len("layers.0."):].removesuffix(".weight")
            if part in _LINEARS:
                w[_LINEARS[part]] = raw[name].T
            elif part in _NORMS:
                w[_NORMS[part]] = raw[name]
            else:
                raise _err(f"unsupported EAGLE head weight {name!r}")
        elif key in ("fc.weight", "norm.weight", "lm_head.weight", "embed_tokens.weight", "d2t"):
            arr = raw[name]
            w[key.split(".")[0]] = arr.T if key in ("fc.weight", "lm_head.weight") else arr
        elif key != "t2d":
            raise _err(f"unsupported EAGLE head weight {name!r}")
    need = ["fc", "wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down", "ln_mlp"]
    need += ["ln_in", "hidden_norm", "norm", "lm_head"] if method == "eagle3" else []
    missing = [n for n in need if n not in w]
    if missing:
        raise _err(f"the {method} head lacks {missing} (is it an {method} checkpoint?)")
    n_in = len(aux) * Et if method == "eagle3" else 2 * E
    if w["fc"].shape != (n_in, E):
        raise _err(f"fc.weight is {w['fc'].shape[::-1]}, the {method} format needs {(E, n_in)}")
    if method == "eagle":
        w.pop("embed", None)  # the target's embeddings (as vLLM shares them)
        w.pop("ln_in", None)  # EAGLE-1 has no input norm
    if "d2t" in w:
        w["d2t"] = w["d2t"].astype(np.int32)
    if method == "eagle3" and w["lm_head"].shape[1] != len(w.get("d2t", ())) and "d2t" in w:
        raise _err(f"lm_head has {w['lm_head'].shape[1]} rows, d2t {len(w['d2t'])}")
    return cfg, w, aux


class EagleProposer:
    takes_requests = True

    def __init__(self, path: str, method: str, *, runner, k: int, block_size: int, max_copies: int,
                 num_host_blocks: int, kv, requests: dict, seq_buckets: tuple[int, ...],
                 max_num_seqs: int, attention_backend: str | None = None):
        self.method, self.k, self.block_size = method, k, block_size
        self.cfg, w, self.capture = load_head(path, method, runner.model_cfg)
        self.dtype, self.runner, self.kv, self.requests = runner.dtype, runner, kv, requests
        self.max_blocks = runner.max_blocks
        self.rows = pick_bucket(seq_buckets, max_num_seqs)  # the loop's rows (ready requests)
        p = runner.params
        shared = {"embed": value(p["embed"])}  # the target's arrays, not copies
        if not runner.model_cfg.tie_word_embeddings:
            shared["lm_head"] = value(p["lm_head"])
        par = runner.tp  # tensor parallel: the head split over the target's mesh (eagle_tp.py)
        self.attn = pick_attention(attention_backend, jax.devices()[0].platform)
        self.embed_fn = None  # the target's vocabulary-parallel lookup, where its table is split
        if par is None:
            self.weights = {n: jnp.asarray(a, jnp.int32 if n == "d2t" else self.dtype) for n, a in w.items()}
        else:
            from jaxllm.spec.eagle_tp import place_head
            self.cfg, self.weights = place_head(self.cfg, w, self.dtype, par)
            self.attn, self.embed_fn = par.attention(self.attn), par.embedding()
        for n, a in shared.items():
            self.weights.setdefault(n, a)  # (tied: logits from embed.T inside the program)
        m = self.cfg
        shape = (1, 2, m.num_kv_heads, runner.num_blocks, block_size, m.head_dim)
        if par is None:
            self.pages = committed(jnp.zeros(shape, self.dtype))  # as KVOps leaves them: one jit variant
            self._program = jax.jit(self._propose_impl, donate_argnums=(1,))
        else:
            from jaxllm.spec.eagle_tp import jit_program
            self.pages = par.zeros(shape, self.dtype)
            self._program = jit_program(self._propose_impl, self.weights, par)
        self.kv_ops = KVOps(runner.num_blocks, max_copies, num_host_blocks, self.pages)
        self._last: tuple | None = None  # (scheduler output, batch, target hidden) of the last step
        log.info("%s head: hidden %d, reads target %s, %d-token draft vocabulary", method, m.hidden_size,
                 "final hidden state" if self.capture == (-1,) else f"layers {self.capture}",
                 (self.weights["lm_head"] if "lm_head" in self.weights else self.weights["embed"].T).shape[1])

    # -- the head ------------------------------------------------------------------------------------
    def _layer(self, w, pages, tok, h, md: AttentionMetadata):
        """One head step over tokens [T] with hidden h [T, E] -> (pages, out hidden, logits input)."""
        m, eps = self.cfg, self.cfg.rms_norm_eps
        e = w["embed"][tok] if self.embed_fn is None else self.embed_fn(w["embed"], tok)
        if self.method == "eagle3":
            hn = rms_norm(h, w["hidden_norm"], eps)
            x, resid = jnp.concatenate([rms_norm(e, w["ln_in"], eps), hn], -1), h
        else:
            x = resid = jnp.concatenate([e, h], -1) @ w["fc"]
        T, H, K, D = tok.shape[0], m.num_heads, m.num_kv_heads, m.head_dim
        inv = rope_inv_freq(m)
        q = apply_rope((x @ w["wq"]).reshape(T, H, D), md.positions, inv)
        kk = apply_rope((x @ w["wk"]).reshape(T, K, D), md.positions, inv)
        pages = write_kv(pages, jnp.int32(0), kk, (x @ w["wv"]).reshape(T, K, D), md.slot_mapping)
        resid = resid + self.attn(q, pages, jnp.int32(0), md, sm_scale=m.sm_scale).reshape(T, H * D) @ w["wo"]
        hh = rms_norm(resid, w["ln_mlp"], eps)
        out = resid + (jax.nn.silu(hh @ w["w_gate"]) * (hh @ w["w_up"])) @ w["w_down"]
        return pages, out, rms_norm(out, w["norm"], eps) if self.method == "eagle3" else out

    def _draft_ids(self, w, hid):
        head = w["lm_head"] if "lm_head" in w else w["embed"].T
        ids = jnp.argmax(jnp.dot(hid, head, preferred_element_type=jnp.float32), -1).astype(jnp.int32)
        return ids + w["d2t"][ids] if "d2t" in w else ids

    def _propose_impl(self, w, pages, hidden, tok, md: AttentionMetadata, sel, pos0, count, tables):
        """Entries of the last step's tokens, then k drafts for the rows `sel` picks."""
        if self.method == "eagle3":
            hidden = hidden.astype(w["fc"].dtype) @ w["fc"]
        pages, out, lin = self._layer(w, pages, tok, hidden.astype(self.dtype), md)
        h, d = out[sel], self._draft_ids(w, lin[sel])
        R, S = sel.shape[0], self.block_size
        rows, qsl = jnp.arange(R, dtype=jnp.int32), jnp.arange(R + 1, dtype=jnp.int32)

        def body(j, carry):
            pages, h, d, drafts = carry
            pos = pos0 + j  # the entry of draft j-1 (token d at its position), predicting draft j
            col = jnp.minimum(pos // S, tables.shape[1] - 1)
            blk = jnp.take_along_axis(tables, col[:, None], axis=1)[:, 0]
            slot = jnp.where(j < count, blk * S + pos % S, -1)
            md1 = AttentionMetadata(pos, rows, slot, tables, pos + 1, qsl, jnp.full((1,), R, jnp.int32))
            pages, h, lin1 = self._layer(w, pages, d, h, md1)
            d = self._draft_ids(w, lin1)
            return pages, h, d, drafts.at[:, j].set(d)

        precision = "highest" if self.dtype == jnp.float32 else None
        with jax.default_matmul_precision(precision):
            drafts = jnp.zeros((R, self.k), jnp.int32).at[:, 0].set(d)
            pages, _, _, drafts = jax.lax.fori_loop(1, jnp.max(count), body, (pages, h, d, drafts))
        return pages, drafts

    # -- engine hooks ---------------------------------------------------------------------------------
    def on_kv_ops(self, out) -> None:
        self.kv_ops.swap_out(self.pages, out.swap_out)
        self.pages = self.kv_ops.swap_in(self.kv_ops.copy(self.pages, out.copies), out.swap_in)

    def after_forward(self, out, hb: HostBatch, prev_ids) -> None:
        self._last = (out, hb, self.runner.last_hidden)

    def _entries(self, out, hb: HostBatch):
        """(successor token [T], slot [T] (-1: not written)) of the last step's tokens, and
        batch index of each live row's last accepted position."""
        T = len(hb.tokens)
        tok, slot = np.zeros(T, np.int32), np.full(T, -1, np.int32)
        last: dict[str, int] = {}
        qsl = hb.query_start_loc
        for i, s in enumerate(out.scheduled):
            req = self.requests.get(s.request_id)
            if req is None or req.request_id not in self.kv.tables or req.num_computed_tokens == 0:
                continue  # finished, aborted or preempted since
            # Entry p is known when token p+1 is, and the target's hidden at p verified.
            n = min(len(s.token_ids), min(req.num_computed_tokens, req.num_tokens - 1) - s.start_pos)
            if n <= 0:
                continue
            a = int(qsl[i])
            tok[a:a + n] = req.token_slice(s.start_pos + 1, s.start_pos + 1 + n)
            slot[a:a + n] = hb.slot_mapping[a:a + n]
            if s.start_pos + n == req.num_tokens - 1:
                last[s.request_id] = a + n - 1
        return tok, slot, last

    def propose(self, ready: list, room: np.ndarray) -> list[list[int]]:
        res: list[list[int]] = [[] for _ in ready]
        step, self._last = self._last, None
        if step is None:
            return res
        out, hb, hidden = step
        tok, slot, last = self._entries(out, hb)
        S, R = self.block_size, self.rows
        sel, pos0, cnt = (np.zeros(R, np.int32) for _ in range(3))
        tab = np.zeros((R, self.max_blocks), np.int32)
        live = []
        for i, r in enumerate(ready):
            j = last.get(r.request_id)
            if j is None or room[i] <= 0:
                continue  # not in the last step: its hidden state is gone (drafts next step)
            table = self.kv.tables[r.request_id]
            p = r.num_tokens - 1  # where draft 1's entry goes
            c = int(min(room[i], len(table) * S - p + 1))
            if any(b.ref_cnt > 1 for b in table[p // S:]):
                c = min(c, 1)  # a fork's shared block: no writes past the step's own tokens
            if c <= 0:
                continue
            n = len(live)
            sel[n], pos0[n], cnt[n] = j, p - 1, c
            tab[n, :len(table)] = [b.block_id for b in table]
            live.append(i)
        if not live and not (slot >= 0).any():
            return res
        md = AttentionMetadata(hb.positions, hb.token_req, slot, hb.block_tables, hb.seq_lens,
                               hb.query_start_loc, hb.num_seqs)
        self.pages, drafts = self._program(self.weights, self.pages, hidden, tok, md, sel, pos0, cnt, tab)
        drafts = np.asarray(drafts)
        for n, i in enumerate(live):
            res[i] = drafts[n, :cnt[n]].tolist()
        return res

    # -- start-up --------------------------------------------------------------------------------------
    def warmup(self, token_buckets: tuple[int, ...], seq_buckets: tuple[int, ...], max_num_seqs: int) -> None:
        width = self.runner.last_hidden.shape[-1] if self.runner.last_hidden is not None else None
        for T, R in compiled_pairs(token_buckets, seq_buckets):
            hidden = jnp.zeros((T, width or len(self.capture) * self.runner.model_cfg.hidden_size),
                               self.runner.last_hidden.dtype if width else self.dtype)
            if self.runner.tp is not None:  # as the step returns it (jit's cache keys on placement)
                hidden = jax.device_put(hidden, self.runner.tp.replicated)
            z = np.zeros(self.rows, np.int32)
            md = AttentionMetadata(np.full(T, -1, np.int32), np.zeros(T, np.int32), np.full(T, -1, np.int32),
                                   np.zeros((R, self.max_blocks), np.int32), np.zeros(R, np.int32),
                                   np.zeros(R + 1, np.int32), np.zeros(1, np.int32))
            self.pages, _ = self._program(self.weights, self.pages, hidden, np.zeros(T, np.int32), md, z, z, z,
                                          np.zeros((self.rows, self.max_blocks), np.int32))
        self.pages = self.kv_ops.warmup(self.pages)
        jax.block_until_ready(self.pages)

    def num_compiled(self) -> int:
        return self._program._cache_size() + self.kv_ops.num_compiled()
