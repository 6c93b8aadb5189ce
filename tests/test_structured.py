"""Structured outputs end to end on the embedded SmolLM2 (one LLM for the module), plus the
sampler's bitmask, the scheduler's admission gate and the reasoning hook as units."""

from __future__ import annotations

import asyncio
import json
import logging
import re

import jax.numpy as jnp
import jsonschema
import numpy as np
import pytest

from jaxllm import LLM, SamplingParams
from jaxllm.engine.sampler import SampleRow, Sampler
from jaxllm.runtime.kv_cache_manager import KVCacheManager
from jaxllm.runtime.request import Request, StopRule
from jaxllm.runtime.scheduler import Scheduler, SchedulerConfig
from jaxllm.sampling_params import StructuredOutputsParams as S

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 18, "maximum": 99},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "minItems": 1, "maxItems": 3},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                     "zip": {"type": "integer", "minimum": 10000,
                                                             "maximum": 99999}},
                    "required": ["city", "zip"], "additionalProperties": False},
    },
    "required": ["name", "age", "role", "tags", "address"],
    "additionalProperties": False,
}
PROMPT = "Describe a user of our website as JSON:"


@pytest.fixture(scope="module")
def llm() -> LLM:
    # A small KV pool (24 blocks of 16 tokens) so n = 8 JSON samples get preempted.
    return LLM(dtype="float32", max_model_len=256, max_num_seqs=8, token_buckets=(16, 64),
               seq_buckets=(8,), num_gpu_blocks_override=24)


def _clean(llm: LLM) -> None:
    st = llm.stats()
    assert st["compiles_after_warmup"] == 0
    assert st["num_free_blocks"] == st["num_total_blocks"]
    assert not llm.engine.structured.states  # every sequence's matcher was dropped


def test_json_schema_n8_validates_and_survives_preemption(llm) -> None:
    before = llm.stats()["num_preemptions"]
    sp = SamplingParams(n=8, temperature=1.0, seed=11, max_tokens=160,
                        structured_outputs=S(json=SCHEMA, disable_any_whitespace=True))
    out = llm.generate([PROMPT], sp, use_tqdm=False)[0]
    assert len(out.outputs) == 8
    for c in out.outputs:
        jsonschema.validate(json.loads(c.text), SCHEMA)
        assert c.finish_reason == "stop"  # the grammar reached its end
    assert len({c.text for c in out.outputs}) > 1  # sampled, not one forced string
    assert llm.stats()["num_preemptions"] > before
    _clean(llm)


@pytest.mark.parametrize("n", [1, 8])
def test_json_streamed_through_the_async_engine(llm, n) -> None:
    """Streamed deltas of every one of the n samples reassemble to JSON that validates; with
    n = 8 the small KV pool also preempts some of them mid-stream."""
    from jaxllm.engine.async_engine import AsyncLLM

    before = llm.stats()["num_preemptions"]

    async def run() -> list[str]:
        engine = AsyncLLM(llm.engine)
        try:
            sp = SamplingParams(n=n, temperature=1.0, seed=5, max_tokens=160,
                                structured_outputs=S(json=SCHEMA, disable_any_whitespace=True))
            ids = llm.engine.tokenize(PROMPT)[1]
            texts, reasons, chunks = [""] * n, [None] * n, [0] * n
            async for o in engine.generate(ids, sp, delta=True):
                for c in o.outputs:
                    texts[c.index] += c.text
                    chunks[c.index] += bool(c.text)
                    reasons[c.index] = c.finish_reason or reasons[c.index]
            assert reasons == ["stop"] * n
            assert all(k > 1 for k in chunks)  # streamed in pieces, not one final text
            return texts
        finally:
            await engine.shutdown()

    texts = asyncio.run(run())
    for text in texts:
        jsonschema.validate(json.loads(text), SCHEMA)
    assert n == 1 or len(set(texts)) > 1  # n independent samples, not one stream copied
    assert n == 1 or llm.stats()["num_preemptions"] > before
    _clean(llm)


LARK = r"""
start: expr
expr: NUM | NUM OP NUM | NUM OP NUM OP NUM
NUM: /[1-9][0-9]?/
OP: "+" | "-" | "*"
"""


def test_regex_choice_grammar_json_object_and_mixed_rows(llm) -> None:
    plain = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    alone = llm.generate(["The capital of France is"], plain, use_tqdm=False)[0].outputs[0].token_ids
    cases = [
        (SamplingParams(n=4, temperature=1.0, seed=1, max_tokens=20,
                        structured_outputs=S(regex=r"[A-Z][a-z]{2,6}-[0-9]{3}")),
         lambda t: re.fullmatch(r"[A-Z][a-z]{2,6}-[0-9]{3}", t)),
        (SamplingParams(n=4, temperature=1.0, seed=2, max_tokens=20,
                        structured_outputs=S(choice=["red", "green", "dark blue"])),
         lambda t: t in ("red", "green", "dark blue")),
        (SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=20, structured_outputs=S(grammar=LARK)),
         lambda t: re.fullmatch(r"[1-9][0-9]?([-+*][1-9][0-9]?){0,2}", t)),
        (SamplingParams(n=2, temperature=1.0, seed=4, max_tokens=100, logprobs=2, stop=["zzz"],
                        structured_outputs=S(json_object=True, disable_any_whitespace=True)),
         lambda t: isinstance(json.loads(t), dict)),
    ]
    prompts = ["A product code:", "Pick a colour:", "An arithmetic expression:", "A JSON object:",
               "The capital of France is"]
    outs = llm.generate(prompts, [c[0] for c in cases] + [plain], use_tqdm=False)
    for (sp, ok), o in zip(cases, outs):
        for c in o.outputs:
            assert ok(c.text) and c.finish_reason == "stop", (sp.structured_outputs.kind, c.text, c.finish_reason)
    for c in outs[3].outputs:  # logprobs still come with constrained tokens
        assert len(c.logprobs) == len(c.token_ids) and all(t in lp for t, lp in zip(c.token_ids, c.logprobs))
    # An unconstrained greedy row in a batch with constrained rows is unchanged.
    assert outs[4].outputs[0].token_ids == alone
    _clean(llm)


def test_invalid_constraints_raise_and_the_engine_keeps_serving(llm) -> None:
    for bad, reason in [(S(json={"type": "object", "properties": {"a": {"type": "nope"}}}), "nope"),
                        (S(regex="(unclosed"), "unclosed"), (S(grammar="start: missing_rule"), "missing_rule")]:
        with pytest.raises(ValueError, match=reason):
            llm.generate(["x"], SamplingParams(max_tokens=4, structured_outputs=bad), use_tqdm=False)
    out = llm.generate(["Yes or no?"], SamplingParams(max_tokens=5, structured_outputs=S(choice=["yes", "no"])),
                       use_tqdm=False)
    assert out[0].outputs[0].text in ("yes", "no")
    _clean(llm)


def test_a_grammar_failing_after_admission_aborts_only_its_request(llm) -> None:
    eng = llm.engine
    bad = SamplingParams(max_tokens=4, structured_outputs=S(regex="(never closed [a-z]"))
    try:
        eng.add_request("bad", "x", bad)  # compiles on a worker thread; fails there
    except ValueError:  # the compile already failed when the engine looked: refused at once
        pass
    eng.add_request("good", "Hi", SamplingParams(max_tokens=3, structured_outputs=S(choice=["ok"])))
    finished = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                finished[o.request_id] = o.outputs[0]
    assert finished["good"].text == "ok"
    assert finished.get("bad") is None or finished["bad"].finish_reason == "abort"
    _clean(llm)


def test_sync_scheduling_gives_the_same_constrained_output(llm) -> None:
    sp = SamplingParams(n=3, temperature=1.0, seed=21, max_tokens=24,
                        structured_outputs=S(regex=r"[a-z]{3,8}( [a-z]{3,8}){2}\."))
    overlapped = [c.text for c in llm.generate(["Three words:"], sp, use_tqdm=False)[0].outputs]
    llm.engine.async_scheduling = False
    try:
        sync = [c.text for c in llm.generate(["Three words:"], sp, use_tqdm=False)[0].outputs]
    finally:
        llm.engine.async_scheduling = True
    assert sync == overlapped  # the mask of step k+1 saw step k's token either way
    assert all(re.fullmatch(r"[a-z]{3,8}( [a-z]{3,8}){2}\.", t) for t in sync)
    _clean(llm)


# -- units ----------------------------------------------------------------------------------------

def test_mask_is_applied_in_the_jitted_sampler() -> None:
    vocab = 100  # 4 words, the last one half padding
    sampler = Sampler(vocab, 16, pad_to=4)
    logits = np.zeros((4, vocab), np.float32)
    logits[:, 7] = 50.0  # the forbidden top choice, by far
    constrained = SamplingParams(temperature=1.0, structured_outputs=S(regex="a"))
    rows = [SampleRow(constrained, [0], [], seed=s, eos_token_id=None) for s in range(3)]
    rows.append(SampleRow(SamplingParams(temperature=0.0), [0], [], seed=0, eos_token_id=None))
    allowed = {3, 40, 99}
    mask = np.full((4, sampler.mask_words), -1, np.int32)
    mask[:3] = 0
    for t in allowed:
        mask[:3, t // 32] |= np.int32(np.uint32(1 << (t % 32)).view(np.int32))
    seen, before = set(), None
    for step in range(24):
        batch = sampler.prepare([SampleRow(r.params, r.prompt_ids, [0] * step, r.seed, None) for r in rows], 4)
        assert batch.masked and not batch.greedy_only
        batch.bitmask = mask
        out = sampler.sample(jnp.asarray(logits), batch).token_ids
        seen |= set(out[:3].tolist())
        assert out[3] == 7  # the unconstrained row still takes its top choice
        before = before or sampler.num_compiled_variants()
    assert seen <= allowed and len(seen) > 1
    assert sampler.num_compiled_variants() == before
    batch = sampler.prepare(rows, 4)
    with pytest.raises(ValueError, match="bitmask"):
        sampler.sample(jnp.asarray(logits), batch)  # a constrained draw without its mask


def test_scheduler_admits_past_a_request_whose_grammar_compiles() -> None:
    kv = KVCacheManager(64, 4)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64), kv)
    ready = [False]
    slow = Request("slow", [1, 2, 3], StopRule(max_tokens=4))
    slow.admit_check = lambda: ready[0]
    sched.add(slow)
    sched.add(Request("fast", [4, 5, 6], StopRule(max_tokens=4)))
    assert [s.request_id for s in sched.schedule().scheduled] == ["fast"]
    ready[0] = True
    assert "slow" in [s.request_id for s in sched.schedule().scheduled]


def test_reasoning_end_starts_the_constraint() -> None:
    from jaxllm.models.loader import embedded_model_path
    from jaxllm.models.tokenizer import Tokenizer
    from jaxllm.structured.manager import StructuredManager

    tok = Tokenizer.from_gguf(embedded_model_path())
    manager = StructuredManager(tok, tok.vocab_size + 40)  # a model vocab with padding ids
    end = tok.encode("</think>", add_special_tokens=False)
    params = S(choice=["yes", "no"], reasoning_end_ids=end)
    manager.add("r", params, manager.submit(params))
    manager.submit(params).result()
    thinking = tok.encode("Let me think", add_special_tokens=False)
    assert not manager.advance("r", thinking)
    assert (manager.fill([("r", 0)], 1) == -1).all()  # still reasoning: nothing is forbidden
    out = thinking + end
    assert not manager.advance("r", out)
    mask = manager.fill([("r", 0)], 2)
    allowed = np.flatnonzero(np.unpackbits(mask[0].view(np.uint8), bitorder="little"))
    assert 0 < len(allowed) < 50 and allowed.max() < tok.vocab_size  # padding ids are forbidden
    assert (mask[1] == -1).all()
    assert all(tok.decode([int(t)]) in ("y", "ye", "yes", "n", "no") for t in allowed)
    assert manager.advance("r", out + tok.encode("yes", add_special_tokens=False))  # complete
    manager.remove("r")


def test_prepare_builds_the_grammar_backend_once(llm, caplog, monkeypatch) -> None:
    eng = llm.engine
    saved, eng._structured = eng._structured, None
    try:
        with caplog.at_level(logging.INFO, logger="jaxllm"):
            took = eng.prepare_structured_outputs()
        assert took is not None and eng._structured is not None
        assert "structured outputs ready" in caplog.text
        assert eng.prepare_structured_outputs() is None  # built already: nothing to do
    finally:
        eng._structured = saved if saved is not None else eng._structured

    # The server builds it at start-up, before it answers anything.
    import argparse

    import jaxllm.engine.async_engine as ae
    from jaxllm.engine.arg_utils import add_engine_args
    from jaxllm.server.args import add_serve_args, build_server_app

    calls = []

    class Engine:
        def prepare_structured_outputs(self):
            calls.append("prepared")

    class Stub:
        engine = Engine()

        @classmethod
        def from_config(cls, *a, **k):
            return cls()

    monkeypatch.setattr(ae, "AsyncLLM", Stub)
    monkeypatch.setattr("jaxllm.server.app.build_app", lambda *a, **k: "app")
    p = argparse.ArgumentParser()
    add_serve_args(p)
    add_engine_args(p)
    assert build_server_app(p.parse_args([])) == "app" and calls == ["prepared"]


def test_in_place_mask_job_equals_the_scratch_path() -> None:
    """The dispatch thread's mask job writes the rows in place when the mask has the tokenizer's
    width, through a scratch array otherwise (model padding ids): both give the same bits for the
    same matcher states, on rows out of order, and rows left unconstrained stay all ones."""
    from jaxllm.models.loader import embedded_model_path
    from jaxllm.models.tokenizer import Tokenizer
    from jaxllm.structured.manager import StructuredManager

    tok = Tokenizer.from_gguf(embedded_model_path())
    exact, padded = StructuredManager(tok, tok.vocab_size), StructuredManager(tok, tok.vocab_size + 40)
    params = [S(json=SCHEMA), S(regex=r"[a-c]{2,5}x"), S(choice=["alpha", "beta"])]
    prefixes = ['{"name": "Al', "ab", "al"]
    for m in (exact, padded):
        for i, (p, text) in enumerate(zip(params, prefixes)):
            m.add(f"s{i}", p, m.submit(p))
            m.submit(p).result()
            assert not m.advance(f"s{i}", tok.encode(text, add_special_tokens=False))
    rows = [("s2", 0), ("s0", 3), ("s1", 1)]  # row 2 and 4 unconstrained
    job = exact.fill_job(rows, 5)
    a, b = job(), padded.fill(rows, 5)
    w = exact.words
    assert np.array_equal(a, b[:, :w]) and (b[[0, 1, 3], w:] == 0).all()
    assert (a[[2, 4]] == -1).all() and not (a[[0, 1, 3]] == -1).all()
    assert exact.mask_steps == 1 and exact.mask_rows == 3


def test_every_mask_placement_gives_the_same_output(llm) -> None:
    """The step's constrained rows computed on the mask thread (the default), on the dispatch
    thread or on the engine thread: the same seeded samples, every one matching the regex."""
    sp = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=24,
                        structured_outputs=S(regex=r"[a-z]{3,8}( [a-z]{3,8}){2}\."))
    manager = llm.engine.structured
    assert manager.mask_on == "thread"
    texts = {}
    try:
        for where in ("thread", "dispatch", "engine"):
            manager.mask_on = where
            texts[where] = [c.text for c in llm.generate(["Three words:"], sp, use_tqdm=False)[0].outputs]
    finally:
        manager.mask_on = "thread"
    assert texts["thread"] == texts["dispatch"] == texts["engine"]
    assert all(re.fullmatch(r"[a-z]{3,8}( [a-z]{3,8}){2}\.", t) for t in texts["thread"])
    _clean(llm)


def test_hand_off_resolves_or_fails_the_draws_future(monkeypatch) -> None:
    """Each placement resolves the Future the draw waits for with the same mask; a job that
    raises on the mask thread fails the Future (the draw does not wait forever); a bad
    JAXLLM_MASK_ON is refused naming the variable."""
    from concurrent.futures import Future

    from jaxllm.models.loader import embedded_model_path
    from jaxllm.models.tokenizer import Tokenizer
    from jaxllm.structured.manager import StructuredManager

    tok = Tokenizer.from_gguf(embedded_model_path())
    m = StructuredManager(tok, tok.vocab_size)
    m.add("s", S(regex=r"[a-c]{2,5}x"), m.submit(S(regex=r"[a-c]{2,5}x")))
    m.submit(S(regex=r"[a-c]{2,5}x")).result()
    assert not m.advance("s", tok.encode("ab", add_special_tokens=False))
    masks = {}
    for where in ("thread", "dispatch", "engine"):
        m.mask_on, fut = where, Future()
        m.hand_off([("s", 1)], 2, fut)
        masks[where] = fut.result(timeout=10)()
    assert np.array_equal(masks["thread"], masks["dispatch"]) and np.array_equal(masks["thread"], masks["engine"])
    assert (masks["thread"][0] == -1).all() and not (masks["thread"][1] == -1).all()

    def boom():
        raise RuntimeError("mask failed")

    monkeypatch.setattr(m, "fill_job", lambda rows, n: boom)
    m.mask_on, fut = "thread", Future()
    m.hand_off([("s", 0)], 1, fut)
    with pytest.raises(RuntimeError, match="mask failed"):
        fut.result(timeout=10)
    monkeypatch.setenv("JAXLLM_MASK_ON", "gpu")
    with pytest.raises(ValueError, match="JAXLLM_MASK_ON"):
        StructuredManager(tok, tok.vocab_size)


def test_each_steps_mask_is_handed_off_once(llm, monkeypatch) -> None:
    """With the mask computed on the mask thread, the draw's Future resolves only when the mask
    is ready; the engine must not take "not done yet" for "not handed off" and hand the same
    step's matchers off again (a second fill then ran while the host advanced those matchers:
    llguidance's "Already borrowed" on an H200). Each step's Future is handed off exactly once,
    and the mask counters count each step once."""
    manager = llm.engine.structured
    assert manager.mask_on == "thread" and llm.engine.async_scheduling
    seen: list[int] = []
    real = manager.hand_off

    def counting(rows, num_rows, future):
        seen.append(id(future))
        futures.append(future)  # kept alive, so no id is reused within the run
        return real(rows, num_rows, future)

    futures: list = []
    monkeypatch.setattr(manager, "hand_off", counting)
    steps0 = manager.mask_steps
    sp = SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=40, structured_outputs=S(json=SCHEMA))
    outs = llm.generate([PROMPT, "Another user, as JSON:"], sp, use_tqdm=False)
    assert len(seen) > 10 and len(seen) == len(set(seen)), "a step's mask was handed off twice"
    assert manager.mask_steps - steps0 == len(seen)
    assert all(c.token_ids for o in outs for c in o.outputs)
    _clean(llm)
