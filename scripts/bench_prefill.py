"""Prefill attention alone: the paged kernels against contiguous-K/V peers, in one process.

    python3 scripts/bench_kernels.py --prefill [--prefill-cases 2048,8192,32768,ragged8]
        [--prefill-kernels mosaic,pallas,jax_cudnn,jax_mgpu,torch_cudnn,torch_flash] [--page 16]

Llama-3-8B attention (32 q heads, 8 kv heads, head_dim 128), bf16, causal, one layer.
Cases: one sequence of 2048 / 8192 / 32768 tokens, and 8 ragged sequences with lengths
drawn uniformly in [1024, 8192] (not multiples of the page size). The paged kernels read
K/V from a pool of shuffled pages; the peers get the same K/V as contiguous arrays
(per sequence for the ragged case, all inside one jit / one stream).
FLOPs = 4 * H * D * n^2 / 2 per sequence (causal: half the square).
Every output is first checked against a float32 textbook reference on a random sample of
query rows (all rows of the sequences' ends included), with the output memory poisoned
(a NaN buffer of its size freed just before the call); then timed: JAX kernels as wall time
of queued jitted calls that each run the kernel back to back on several query sets (>= ~4 ms
of device work per call, so host dispatch stays hidden), torch with CUDA events; medians.
(No profiler trace: its export stalled for minutes on the H200.)
A paged kernel named `KERNEL@fp8` / `KERNEL@fp8_e5m2` (e.g. `mosaic@fp8,pallas@fp8`) reads the
same pages stored as fp8 (`kv_cache_dtype`, scale 1.0); its check is against the reference on the
fp8-rounded K/V, and its FLOPs are the same.
"""

from __future__ import annotations

import functools
import json
import os

os.environ.setdefault("JAX_TRACEBACK_FILTERING", "off")  # full traces of kernel errors
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.kernels import mosaic_prefill, pallas_prefill, pallas_ragged
from jaxllm.kernels.metadata import AttentionMetadata

H, K, D = 32, 8, 128
SCALE = D ** -0.5


def make_case(lengths: list[int], page: int, seed: int = 0, news: list[int] | None = None,
              pad_tokens: int = 0, heads: tuple[int, int] = (H, K)) -> dict:
    """Requests of context lengths[r] whose last news[r] tokens (default: all) are this
    step's queries; their K/V already in a pool of shuffled pages (write_kv's layout)."""
    nh, nk = heads
    news = list(lengths) if news is None else news
    rng = np.random.default_rng(seed)
    C = int(sum(lengths))
    ppr = [-(-n // page) for n in lengths]
    num_pages = sum(ppr) + 7
    perm = rng.permutation(num_pages).astype(np.int32)
    tables = np.zeros((len(lengths) + 1, max(ppr) + 1), np.int32)  # + a padding row
    used = 0
    for r, n in enumerate(ppr):
        tables[r, :n] = perm[used:used + n]
        used += n
    cpos = np.concatenate([np.arange(n) for n in lengths]).astype(np.int32)
    creq = np.repeat(np.arange(len(lengths)), lengths).astype(np.int32)
    cslot = tables[creq, cpos // page] * page + cpos % page
    qpos = np.concatenate([np.arange(n - m, n) for n, m in zip(lengths, news)]).astype(np.int32)
    qreq = np.repeat(np.arange(len(lengths)), news).astype(np.int32)
    T = len(qpos) + pad_tokens
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(k1, (T, nh, D), jnp.bfloat16)
    k = jax.random.normal(k2, (C, nk, D), jnp.bfloat16)
    v = jax.random.normal(k3, (C, nk, D), jnp.bfloat16)
    # stale data everywhere else in the pool: a kernel reading a wrong slot gets it wrong
    flat = jax.random.normal(k3, (2, nk, num_pages * page, D), jnp.bfloat16) * 3
    flat = flat.at[:, :, jnp.asarray(cslot)].set(jnp.stack([k, v]).swapaxes(1, 2))
    kv = flat.reshape(1, 2, nk, num_pages, page, D)
    md = AttentionMetadata(
        positions=jnp.asarray(np.concatenate([qpos, -np.ones(pad_tokens, np.int32)])),
        token_req=jnp.asarray(np.concatenate([qreq, np.zeros(pad_tokens, np.int32)])),
        slot_mapping=jnp.asarray(np.concatenate([tables[qreq, qpos // page] * page + qpos % page,
                                                 -np.ones(pad_tokens, np.int32)])),
        block_tables=jnp.asarray(tables),
        seq_lens=jnp.asarray(list(lengths) + [0], jnp.int32),
        query_start_loc=jnp.asarray(np.cumsum([0] + list(news) + [0]), jnp.int32),
        num_seqs=jnp.array([len(lengths)], jnp.int32))
    flops = sum(4 * nh * D * (n * n - (n - m) ** 2) / 2 for n, m in zip(lengths, news))
    return dict(lengths=list(map(int, lengths)), news=list(map(int, news)), q=q, k=k, v=v,
                kv=kv, md=md, flops=flops, qstarts=np.cumsum([0] + list(news))[:-1],
                cstarts=np.cumsum([0] + list(lengths))[:-1], real=len(qpos), qpos=qpos,
                qreq=qreq, starts=np.cumsum([0] + list(lengths))[:-1])


def reference_rows(case, rows: np.ndarray) -> np.ndarray:
    """float32 textbook attention for the given query rows -> [len(rows), H, D] (0: padding),
    one masked einsum per request over its whole context."""
    nh, nk = case["q"].shape[1], case["k"].shape[1]
    rows = np.asarray(rows)
    out = np.zeros((len(rows), nh, D), np.float32)
    real = rows < case["real"]
    req = np.where(real, case["qreq"][np.minimum(rows, case["real"] - 1)], -1)
    for r in np.unique(req[real]):
        sel = np.nonzero(req == r)[0]
        s, n = int(case["cstarts"][r]), case["lengths"][r]
        kk = case["k"][s:s + n].astype(jnp.float32)
        vv = case["v"][s:s + n].astype(jnp.float32)
        qq = case["q"][jnp.asarray(rows[sel])].astype(jnp.float32).reshape(len(sel), nk, -1, D)
        pos = jnp.asarray(case["qpos"][rows[sel]])
        sc = jnp.einsum("tkgd,ckd->tkgc", qq, kk) * SCALE
        sc = jnp.where(jnp.arange(n)[None, None, None, :] <= pos[:, None, None, None], sc, -jnp.inf)
        w = jax.nn.softmax(sc, axis=-1)
        out[sel] = np.asarray(jnp.einsum("tkgc,ckd->tkgd", w, vv).reshape(len(sel), nh, D))
    return out


def sample_rows(case, n: int = 48) -> np.ndarray:
    rng = np.random.default_rng(1)
    T = case["q"].shape[0]
    ends = np.cumsum(case["news"]) - 1
    return np.unique(np.concatenate([rng.integers(0, T, n), ends, case["qstarts"],
                                     np.minimum(case["qstarts"] + 129, T - 1), [T - 1]]))


def jax_fns(names: list[str]) -> dict:
    """name -> (kind, fn): kind "paged": fn(q, kv, md) -> [T, H, D]; kind "contig":
    fn(q, k, v, lengths) -> [T, H, D] per sequence (lengths static).
    mosaic:BLOCK_KEYS:STAGES picks a variant; mosaic_direct[:BK:ST] is the kernel without the
    alignment relabeling around it (right only when every request starts at a multiple of 8:
    the 1xN cases); mosaic_scatter[:BK:ST] the wrapper's former scatter of q."""
    fns = {}
    for name in names:
        kind, *parts = name.split(":")
        if kind == "mosaic":  # no parts: the kernel's default block (bf16 128 keys, fp8 / int 64)
            bk, st = (int(parts[0]), int(parts[1])) if parts else (None, 2)
            f = functools.partial(mosaic_prefill.ragged_prefill_attention, sm_scale=SCALE,
                                  block_keys=bk, num_stages=st)
        elif kind == "mosaic_direct":  # the kernel without the alignment cond (aligned batches)
            bk, st = (int(parts[0]), int(parts[1])) if parts else (128, 2)
            fns[name] = ("paged", lambda q, kv, md, bk=bk, st=st: mosaic_prefill._attend(
                q, md.query_start_loc.astype(jnp.int32), md.positions, kv_pages=kv,
                layer=jnp.int32(0), md=md, sm_scale=SCALE, block_keys=bk, num_stages=st,
                interpret=False, semantics=None))
            continue
        elif kind == "mosaic_scatter":  # the wrapper before 2026-12-02 (q scattered into zeros)
            bk, st = (int(parts[0]), int(parts[1])) if parts else (128, 2)
            fns[name] = ("paged", lambda q, kv, md, bk=bk, st=st: _scatter_wrapper(q, kv, md, bk, st))
            continue
        elif kind == "pallas":
            f = functools.partial(pallas_ragged.ragged_paged_attention, sm_scale=SCALE)
        elif kind == "twin":  # the portable twin (Triton on GPU)
            f = functools.partial(pallas_prefill.ragged_prefill_attention, sm_scale=SCALE)
        elif kind in ("jax_cudnn", "jax_xla"):
            impl = "cudnn" if kind == "jax_cudnn" else "xla"
            fns[name] = ("contig", functools.partial(_per_seq, attn=functools.partial(
                jax.nn.dot_product_attention, is_causal=True, scale=SCALE, implementation=impl)))
            continue
        elif kind == "jax_mgpu":
            from jax.experimental.pallas.ops.gpu import attention_mgpu as am
            cfg = am.TuningConfig(block_q=64, block_kv=128, max_concurrent_steps=2, causal=True)
            # float16 inputs: on jax 0.11.2 its bf16 path fails to trace ("Expected dtypes to match
            # but src had type bfloat16 and dst had type float16"); same bytes, same tensor-core rate
            fns[name] = ("contig_f16", functools.partial(_per_seq, attn=lambda q, k, v: am.attention(
                q * jnp.asarray(SCALE, q.dtype), k, v, cfg)))
            continue
        else:
            raise ValueError(f"unknown prefill kernel {name!r}")
        fns[name] = ("paged", lambda q, kv, md, f=f: f(q, kv, jnp.int32(0), md))
    return fns


def _scatter_wrapper(q, kv, md, bk: int, st: int):
    """`ragged_prefill_attention` as it was: q scattered into a zeroed aligned layout (the
    wrapper now gathers it), to price the change in the same run."""
    qsl = md.query_start_loc.astype(jnp.int32)
    new_qsl, new_pos, dest, _, padded = mosaic_prefill.aligned_layout(qsl, md.positions, q.shape[0])
    q_pad = jnp.zeros((padded,) + q.shape[1:], q.dtype).at[dest].set(q)
    out = mosaic_prefill._attend(q_pad, new_qsl, new_pos, kv_pages=kv, layer=jnp.int32(0), md=md,
                                 sm_scale=SCALE, block_keys=bk, num_stages=st, interpret=False,
                                 semantics=None)
    return out[dest]


def _per_seq(q, k, v, lengths, attn):
    """Contiguous peers: [1, n, H, D] per sequence."""
    starts = np.cumsum([0] + list(lengths))[:-1]
    return jnp.concatenate([attn(q[None, s:s + n], k[None, s:s + n], v[None, s:s + n])[0]
                            for s, n in zip(map(int, starts), lengths)])


def runner(kind_fn, case, reps: int = 1):
    """A jitted call of `reps` back-to-back kernel runs on `reps` query sets (no CSE, no
    dispatch gap between them) -> (run(qs) -> list of outputs, qs)."""
    kind, fn = kind_fn
    if kind == "paged":
        jf = jax.jit(lambda qs, kv, md: [fn(qs[i], kv, md) for i in range(qs.shape[0])])
        run = lambda qs: jf(qs, case["kv"], case["md"])
    elif kind == "contig":
        lengths = tuple(case["lengths"])
        jf = jax.jit(lambda qs, k, v: [fn(qs[i], k, v, lengths) for i in range(qs.shape[0])])
        run = lambda qs: jf(qs, case["k"], case["v"])
    else:  # contig_f16: inputs cast once, outside the timed calls; outputs back to bf16 for the check
        lengths = tuple(case["lengths"])
        jf = jax.jit(lambda qs, k, v: [fn(qs[i], k, v, lengths).astype(jnp.bfloat16)
                                       for i in range(qs.shape[0])])
        k16, v16 = case["k"].astype(jnp.float16), case["v"].astype(jnp.float16)
        cast: dict = {}

        def run(qs):
            if id(qs) not in cast:
                cast.clear()
                cast[id(qs)] = (qs, qs.astype(jnp.float16))
            return jf(cast[id(qs)][1], k16, v16)
    return run


def wall_time(run, qs, groups: int = 5, inner: int = 3) -> float:
    """Median wall seconds per kernel run: `inner` calls queued per timed group, after two
    warm-up calls; each call runs qs.shape[0] kernels back to back on the device."""
    jax.block_until_ready(run(qs))
    jax.block_until_ready(run(qs))
    ts = []
    for _ in range(groups):
        t0 = time.perf_counter()
        jax.block_until_ready([run(qs) for _ in range(inner)])
        ts.append((time.perf_counter() - t0) / inner / qs.shape[0])
    return float(np.median(ts))


def check(run, case, rows, want) -> float:
    got = run(case["q"][None])[0]
    jax.block_until_ready(got)
    poison = jnp.full(got.shape, jnp.nan, got.dtype)
    jax.block_until_ready(poison)
    del poison
    got = run(case["q"][None])[0]
    sel = np.asarray(got[jnp.asarray(rows)].astype(jnp.float32))
    if not bool(jnp.isfinite(got.astype(jnp.float32)).all()):
        return float("inf")
    return float(np.linalg.norm(sel - want) / np.linalg.norm(want))


def torch_peers(case, names, rows, want) -> dict:
    res = {}
    try:
        import torch
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except Exception as e:  # noqa: BLE001
        return {n: dict(error=f"torch unavailable: {e!r}") for n in names}
    q = torch.from_dlpack(case["q"]).cuda()
    k = torch.from_dlpack(case["k"]).cuda()
    v = torch.from_dlpack(case["v"]).cuda()
    for name in names:
        backend = SDPBackend.CUDNN_ATTENTION if name == "torch_cudnn" else SDPBackend.FLASH_ATTENTION
        try:
            seqs = []
            for s, n in zip(case["starts"], case["lengths"]):
                s = int(s)
                seqs.append((q[s:s + n].transpose(0, 1)[None],
                             k[s:s + n].transpose(0, 1)[None].repeat_interleave(H // K, 1),
                             v[s:s + n].transpose(0, 1)[None].repeat_interleave(H // K, 1)))

            def run():
                with sdpa_kernel([backend]):
                    return torch.cat([torch.nn.functional.scaled_dot_product_attention(
                        a, b, c, is_causal=True, scale=SCALE)[0].transpose(0, 1)
                        for a, b, c in seqs])
            out = run()
            torch.cuda.synchronize()
            sel = out[torch.as_tensor(rows, device="cuda")].float().cpu().numpy()
            err = float(np.linalg.norm(sel - want) / np.linalg.norm(want))
            ts = []
            for _ in range(7):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                for _ in range(3):
                    run()
                b.record()
                b.synchronize()
                ts.append(a.elapsed_time(b) / 3e3)
            # the per-call concat copies the output once; time it alone and take it out
            outs = [torch.empty_like(out[:n]) for n in case["lengths"]]
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for _ in range(3):
                torch.cat(outs)
            b.record()
            b.synchronize()
            t = float(np.median(ts)) - a.elapsed_time(b) / 3e3
            res[name] = dict(rel_err=err, ms=t * 1e3, tflops=case["flops"] / t / 1e12,
                             ok=err < 2e-2)
        except Exception as e:  # noqa: BLE001
            res[name] = dict(error=repr(e)[-800:])
        print(f"    {name}: {res[name]}", flush=True)
    return res


PAGE_FORMATS = ("fp8", "fp8_e5m2", "int8", "int4")  # "KERNEL@FORMAT": a paged kernel on such pages


def by_format(names: list[str]) -> dict[str, list[tuple[str, str]]]:
    """{page format ("auto": the model dtype): [(name as asked, kernel name)]} for "KERNEL@FMT"."""
    out: dict[str, list[tuple[str, str]]] = {}
    for name in names:
        base, _, fmt = name.partition("@")
        fmt = fmt or "auto"
        if fmt != "auto" and (fmt not in PAGE_FORMATS or not base.startswith(("mosaic", "pallas", "twin"))):
            raise ValueError(f"{name!r}: only the paged kernels (mosaic*, pallas, twin) take a page format, "
                             f"one of {PAGE_FORMATS}")
        out.setdefault(fmt, []).append((name, base))
    return out


def page_case(case: dict, fmt: str) -> dict:
    """`case` with its pages stored in `fmt` (kernels/kv_quant.py: fp8 scale 1.0, int8 / int4
    per-token scales) and its contiguous K/V rounded the same way, so the float32 reference sees
    the values the kernels read."""
    if fmt == "auto":
        return case
    from jaxllm.kernels import kv_quant
    dtype, width = kv_quant.page_layout(fmt, jnp.bfloat16, D)
    rnd = lambda x: kv_quant.decode_rows(kv_quant.encode_rows(x, dtype, width), D,  # noqa: E731
                                         jnp.bfloat16)
    return dict(case, kv=kv_quant.encode(case["kv"], dtype, width), k=rnd(case["k"]), v=rnd(case["v"]))


def per_format(case: dict, rows: np.ndarray, want: np.ndarray, names: list[str]):
    """(name, kernel, case on that name's pages, its reference rows) per name; the pages and the
    reference are made once per page format."""
    for fmt, group in by_format(names).items():
        fcase = page_case(case, fmt)
        fwant = want if fmt == "auto" else reference_rows(fcase, rows)
        fns = jax_fns([base for _, base in group])
        for name, base in group:
            yield name, fns[base], fcase, fwant


def run_prefill(args) -> dict:
    cases = {"2048": [2048], "8192": [8192], "32768": [32768],
             "ragged8": list(np.random.default_rng(7).integers(1024, 8193, 8))}
    names = args.prefill_kernels.split(",")
    result = dict(smoke=smoke(names), cases=[])
    for cname in args.prefill_cases.split(","):
        if cname == "mixed":  # a mixed step: 4 chunks of 512 + 60 decode rows at context 2048
            case = make_case([2048] * 64, args.page[0], news=[512] * 4 + [1] * 60)
        else:
            case = make_case([int(x) for x in cases[cname]], args.page[0])
        paged_only = cname == "mixed"  # the contiguous peers need whole prompts
        rows = sample_rows(case)
        want = reference_rows(case, rows)
        row = dict(case=cname, lengths=case["lengths"], page=args.page[0],
                   gflop=case["flops"] / 1e9, kernels={})
        print(f"== prefill {cname}: lengths {case['lengths']}, {case['flops'] / 1e9:.0f} GFLOP",
              flush=True)
        jax_names = [n for n in names if not n.startswith("torch")
                     and not (paged_only and n.startswith("jax_"))
                     and not (n.startswith("mosaic_direct") and (case["qstarts"] % 8).any())]
        for name, kind_fn, fcase, fwant in per_format(case, rows, want, jax_names):
            print(f"    {name} ...", flush=True)
            try:
                err = check(runner(kind_fn, fcase), fcase, rows, fwant)
                reps = int(np.clip(round(4e12 / case["flops"]), 1, 8))  # >= ~4 ms per call
                qs = jnp.stack([jnp.roll(case["q"], i, axis=0) for i in range(reps)])
                t = wall_time(runner(kind_fn, fcase), qs)
                del qs
                row["kernels"][name] = dict(rel_err=err, ms=t * 1e3,
                                            tflops=case["flops"] / t / 1e12, ok=err < 2e-2)
            except Exception:  # noqa: BLE001
                row["kernels"][name] = dict(error=traceback.format_exc()[-4000:])
            print(f"    {name}: {row['kernels'][name]}", flush=True)
        if not paged_only:
            row["kernels"].update(torch_peers(case, [n for n in names if n.startswith("torch")],
                                              rows, want))
        result["cases"].append(row)
        del case
        with open(args.out, "w") as f:  # partial results survive a time limit
            json.dump(dict(prefill=result), f, indent=1, default=str)
    print(f"\nprefill attention TFLOP/s (causal FLOPs; '!' failed check, 'E' error, '-' not run), "
          f"{jax.devices()[0].device_kind}, jax {jax.__version__}, {time.strftime('%Y-%m-%d')}")
    print(f"{'case':>8} " + " ".join(f"{n:>13}" for n in names))
    for row in result["cases"]:
        cells = []
        for n in names:
            r = row["kernels"].get(n, {})
            cells.append(f"{'-':>13}" if not r else f"{'E':>13}" if "error" in r else
                         f"{r['tflops']:5.0f}{'' if r['ok'] else '!':1}({r['ms']:6.2f})")
        print(f"{row['case']:>8} " + " ".join(cells))
    return result


SMOKE = [  # (contexts, new tokens, pad tokens, (q heads, kv heads), page)
    ([300, 20, 9, 1000, 77], [300, 1, 9, 333, 1], 5, (32, 8), 16),   # mixed, chunk over prefix
    ([129, 64, 700], [129, 1, 200], 3, (8, 8), 16),                  # GQA 1
    ([515, 33, 2], [515, 1, 2], 0, (64, 8), 32),                     # GQA 8, page 32
    ([1100, 50], [1100, 17], 61, (32, 8), 64),                       # page 64, long padding tail
]


def smoke(names: list[str]) -> list:
    """Small mixed batches on the GPU, poisoned, against the float32 reference (all rows)."""
    res = []
    for i, (ctx, new, pad, heads, page) in enumerate(SMOKE):
        if str(i) not in os.environ.get("PREFILL_SMOKE", "0,1,2,3").split(","):
            continue
        case = make_case(ctx, page, seed=20 + i, news=new, pad_tokens=pad, heads=heads)
        rows = np.arange(case["q"].shape[0])
        want = reference_rows(case, rows)
        row = dict(ctx=ctx, new=new, pad=pad, heads=heads, page=page, kernels={})
        paged = [n for n in names if n.startswith(("mosaic", "pallas", "twin"))]
        for name, kind_fn, fcase, fwant in per_format(case, rows, want, paged):
            print(f"  smoke {i} {name} ...", flush=True)
            try:
                run = runner(kind_fn, fcase)
                err = check(run, fcase, rows, fwant)
                got = np.asarray(run(case["q"][None])[0][case["real"]:].astype(jnp.float32))
                row["kernels"][name] = dict(rel_err=err, pad_zero=not got.any(),
                                            ok=err < 2e-2 and not got.any())
            except Exception:  # noqa: BLE001
                row["kernels"][name] = dict(error=traceback.format_exc()[-4000:])
            print(f"  smoke {i} {name}: {row['kernels'][name]}", flush=True)
        res.append(row)
    return res
