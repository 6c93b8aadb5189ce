"""Tool calling, reasoning, output constraints and refused fields through the live server and the
official `openai` client (the server of tests/test_server.py, shared through conftest.py).

Where a test needs the model to write a given text (a hermes tool call, a think block), the
engine's streams are replaced by canned ones for that request: the server's whole path from
request to response (template, constraint, parser, SSE, client parsing) still runs.
"""

from __future__ import annotations

import json
import re
from contextlib import contextmanager
from types import SimpleNamespace

import httpx
import openai
import pytest

from jaxllm.outputs import CompletionOutput
from jaxllm.server.reasoning import get_reasoning_parser
from jaxllm.server.tool_parsers import get_tool_parser
from test_server import MODEL

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
TOOLS = [WEATHER, TIME]
ASK = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def srv(live_server):
    return live_server


@pytest.fixture(scope="module")
def client(srv):
    return openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=60)


class _Canned:
    """Stands in for one engine stream: the 'model' writes `text` in small pieces, then stops."""

    def __init__(self, text: str) -> None:
        self.pieces = [text[i:i + 5] for i in range(0, len(text), 5)] or [""]

    async def outputs(self, delta: bool):
        if not delta:
            yield SimpleNamespace(outputs=[CompletionOutput(0, "".join(self.pieces), [0] * len(self.pieces),
                                                            finish_reason="stop")])
            return
        for i, p in enumerate(self.pieces):
            last = i == len(self.pieces) - 1
            yield SimpleNamespace(outputs=[CompletionOutput(0, p, [0], finish_reason="stop" if last else None)])

    def abort(self) -> None:
        pass


@contextmanager
def canned(srv, text: str, tool_parser: str | None = None, reasoning: str | None = None):
    """Requests in this block get `text` as the model's answer; yields what the server admitted."""
    chat = srv.app.state.chat
    saved = chat.admit, chat.tool_parser, chat.auto_tools, chat.reasoning_parser
    seen: dict = {}

    def admit(rid, prompts, params, *args, **kwargs):
        seen["params"], seen["prompt_ids"] = params, prompts[0][1]
        return [_Canned(text)]
    chat.admit = admit
    chat.tool_parser = get_tool_parser(tool_parser) if tool_parser else None
    chat.auto_tools = tool_parser is not None
    chat.reasoning_parser = get_reasoning_parser(reasoning) if reasoning else None
    try:
        yield seen
    finally:
        chat.admit, chat.tool_parser, chat.auto_tools, chat.reasoning_parser = saved


def _reassemble(chunks) -> tuple[dict, str | None]:
    """A streamed choice put back together as a client does: content, reasoning, tool calls, finish."""
    msg: dict = {"content": "", "reasoning_content": "", "tool_calls": []}
    finish = None
    for ch in chunks:
        for c in ch.choices:
            d = c.delta
            msg["content"] += d.content or ""
            msg["reasoning_content"] += getattr(d, "reasoning_content", None) or ""
            for tc in d.tool_calls or []:
                if tc.index == len(msg["tool_calls"]):
                    msg["tool_calls"].append({"id": tc.id, "name": tc.function.name, "arguments": ""})
                msg["tool_calls"][tc.index]["arguments"] += tc.function.arguments or ""
            finish = c.finish_reason or finish
    return msg, finish


HERMES = ('I will look it up.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
          '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')


def test_auto_hermes_tool_calls_whole_and_streamed(srv, client):
    with canned(srv, HERMES, tool_parser="hermes"):
        r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="auto")
        streamed, finish = _reassemble(client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS,
                                                                      stream=True))
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content == "I will look it up.\n"
    calls = c.message.tool_calls
    assert [t.function.name for t in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0].function.arguments) == {"city": "Paris"} and calls[0].id and calls[0].type == "function"
    assert finish == "tool_calls" and streamed["content"] == c.message.content
    assert [(t["name"], json.loads(t["arguments"])) for t in streamed["tool_calls"]] == \
        [(t.function.name, json.loads(t.function.arguments)) for t in calls]
    with canned(srv, HERMES, tool_parser="hermes"):  # parallel_tool_calls=false: the first call only
        one = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, parallel_tool_calls=False)
    assert [t.function.name for t in one.choices[0].message.tool_calls] == ["get_weather"]


def test_required_and_named_constrain_with_the_tools_schema(srv, client):
    text = '[{"name": "get_weather", "parameters": {"city": "Rome", "unit": "celsius"}}]'
    with canned(srv, text) as seen:
        r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required")
    schema = seen["params"].structured_outputs.json
    assert schema["type"] == "array" and schema["minItems"] == 1
    assert [o["properties"]["name"]["enum"] for o in schema["items"]["anyOf"]] == [["get_weather"], ["get_time"]]
    assert schema["items"]["anyOf"][0]["properties"]["parameters"] == WEATHER["function"]["parameters"]
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None
    assert json.loads(c.message.tool_calls[0].function.arguments) == {"city": "Rome", "unit": "celsius"}
    named = {"type": "function", "function": {"name": "get_weather"}}
    with canned(srv, '{"city": "Oslo"}') as seen:
        r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=named)
        streamed, finish = _reassemble(client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS,
                                                                      tool_choice=named, stream=True))
    assert seen["params"].structured_outputs.json == WEATHER["function"]["parameters"]
    call = r.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Oslo"}
    assert r.choices[0].finish_reason == "stop"  # as OpenAI and vLLM answer a named tool choice
    assert streamed["tool_calls"][0]["arguments"] == call.function.arguments and finish == "stop"


def test_tool_choice_none_and_a_tool_result_turn(srv, client):
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=4)
    assert r.choices[0].message.tool_calls is None and isinstance(r.choices[0].message.content, str)
    turn = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees and sunny"}]
    r = client.chat.completions.create(model=MODEL, messages=turn, tools=TOOLS, tool_choice="none", max_tokens=4)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 4
    tok = httpx.post(f"{srv.url}/tokenize", json={"messages": turn, "return_token_strs": True}).json()
    ids = tok["tokens"]
    assert len(tok["token_strs"]) == len(ids) and all(isinstance(t, str) for t in tok["token_strs"])
    prompt = httpx.post(f"{srv.url}/detokenize", json={"tokens": ids}).json()["prompt"]
    assert "18 degrees and sunny" in prompt and prompt.index("Weather in Paris?") < prompt.index("18 degrees")


def test_reasoning_parser_splits_think_and_constraints_wait_for_it(srv, client):
    text = "<think>Paris is in France.</think>The capital is Paris."
    with canned(srv, text, reasoning="qwen3"):
        r = client.chat.completions.create(model=MODEL, messages=ASK)
        streamed, _ = _reassemble(client.chat.completions.create(model=MODEL, messages=ASK, stream=True))
    m = r.choices[0].message
    assert m.reasoning_content == "Paris is in France." and m.content == "The capital is Paris."
    assert streamed["reasoning_content"] == m.reasoning_content and streamed["content"] == m.content
    with canned(srv, '<think>ok</think>{"a": 1}', reasoning="deepseek_r1") as seen:
        r = client.chat.completions.create(model=MODEL, messages=ASK, response_format={"type": "json_object"})
    end_ids = srv.engine.tokenizer.encode("</think>", add_special_tokens=False)
    assert seen["params"].structured_outputs.reasoning_end_ids == end_ids
    assert r.choices[0].message.content == '{"a": 1}'


def test_request_fields_map_onto_structured_outputs(srv):
    cases = [
        ({"response_format": {"type": "json_object"}}, {"json_object": True}),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": {"type": "object"}}}},
         {"json": {"type": "object"}}),
        ({"structured_outputs": {"regex": "[ab]+"}}, {"regex": "[ab]+"}),
        ({"structured_outputs": {"choice": ["yes", "no"]}}, {"choice": ["yes", "no"]}),
        ({"guided_json": {"type": "array"}}, {"json": {"type": "array"}}),
        ({"guided_regex": "x+"}, {"regex": "x+"}),
        ({"guided_choice": ["a", "b"]}, {"choice": ["a", "b"]}),
        ({"guided_grammar": 'start: "hi"'}, {"grammar": 'start: "hi"'}),
        ({"response_format": {"type": "text"}}, None),
    ]
    for fields, want in cases:
        with canned(srv, "x") as seen:
            r = httpx.post(f"{srv.url}/v1/chat/completions", json={"messages": ASK, **fields}, timeout=30)
        assert r.status_code == 200, (fields, r.text)
        so = seen["params"].structured_outputs
        assert (so is None) if want is None else all(getattr(so, k) == v for k, v in want.items()), fields


BAD = [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "no-such-type"}}}}}}, "response_format"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs"),
    ({"structured_outputs": {"grammar": "start: ( "}}, "structured_outputs"),
    ({"structured_outputs": {"choice": []}}, "choice"),
    ({"guided_choice": []}, "choice"),
    ({"guided_grammar": "start: " + " | ".join(f'"w{i}"' for i in range(40000))}, "limit"),  # over the size limit
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "not_there"}}}, "not_there"),
    ({"tools": TOOLS}, "enable-auto-tool-choice"),  # tools default to "auto", which this server has not enabled
    ({"tool_choice": "required"}, "tools"),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ({"reasoning_effort": "high"}, "reasoning_effort"),  # SmolLM2's template does not take it
    ({"guided_regex": "a+", "guided_whitespace_pattern": " "}, "whitespace"),  # not a JSON constraint
    ({"structured_outputs": {"disable_any_whitespace": True}}, "whitespace"),  # options without a constraint
]


@pytest.mark.parametrize("fields,needle", BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_constraints_and_tool_choices_are_400_and_leak_nothing(srv, fields, needle):
    r = httpx.post(f"{srv.url}/v1/chat/completions", json={"model": MODEL, "messages": ASK, "max_tokens": 4, **fields},
                   timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert needle in err["message"] or needle == err["param"], err
    ok = httpx.post(f"{srv.url}/v1/chat/completions", json={"messages": ASK, "max_tokens": 2}, timeout=30)
    assert ok.status_code == 200
    srv.wait_idle()  # every KV block back in the pool


def test_completions_constraint_errors_and_body_limit(srv):
    r = httpx.post(f"{srv.url}/v1/completions", json={"prompt": "x", "guided_regex": "(("}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "guided_regex"
    big = httpx.post(f"{srv.url}/v1/completions", content=b'{"prompt": "' + b"x" * (33 * 2 ** 20) + b'"}',
                     headers={"content-type": "application/json"}, timeout=60)
    assert big.status_code == 413 and "bytes" in big.json()["error"]["message"]
    assert httpx.get(f"{srv.url}/health").status_code == 200


def test_unknown_fields_are_logged_as_ignored(srv, caplog):
    with caplog.at_level("WARNING", logger="jaxllm"):
        r = httpx.post(f"{srv.url}/v1/chat/completions", timeout=30, json={
            "messages": [{"role": "user", "content": "hi", "mood": "happy"}], "max_tokens": 2, "frobnicate": 1})
    assert r.status_code == 200
    line = next(rec.getMessage() for rec in caplog.records if "ignored" in rec.getMessage())
    assert "frobnicate" in line and "messages[0].mood" in line


UNIT = {"type": "function", "function": {"name": "set_unit", "parameters": {
    "type": "object", "properties": {"unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["unit"], "additionalProperties": False}}}


def test_constrained_generation_through_the_client(srv, client):
    """The real engine under the constraints (random weights: only the constraint makes the output valid)."""
    import jsonschema

    schema = {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]},
                                               "n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["answer", "n"], "additionalProperties": False}
    # compact JSON: random weights would otherwise spend the budget on the whitespace JSON allows
    r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=48, temperature=1.0, seed=3, n=2,
                                       response_format={"type": "json_schema",
                                                        "json_schema": {"name": "reply", "schema": schema}},
                                       extra_body={"structured_outputs": {"disable_any_whitespace": True}})
    for c in r.choices:
        assert c.finish_reason == "stop", c.message.content
        jsonschema.validate(json.loads(c.message.content), schema)
    closed_time = {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {}, "additionalProperties": False}}}
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=[UNIT, closed_time], tool_choice="required",
                                       parallel_tool_calls=False, max_tokens=64, temperature=0.8, seed=1)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and len(c.message.tool_calls) == 1, c.message
    for call in c.message.tool_calls:
        assert call.function.name in ("set_unit", "get_time")
        args = json.loads(call.function.arguments)
        assert args in ({"unit": "celsius"}, {"unit": "fahrenheit"}) if call.function.name == "set_unit" else True
    named = {"type": "function", "function": {"name": "set_unit"}}
    chunks = list(client.chat.completions.create(model=MODEL, messages=ASK, tools=[UNIT, TIME], tool_choice=named,
                                                 max_tokens=48, stream=True, temperature=0.8, seed=2))
    streamed, finish = _reassemble(chunks)
    assert finish == "stop" and streamed["tool_calls"][0]["name"] == "set_unit"
    jsonschema.validate(json.loads(streamed["tool_calls"][0]["arguments"]), UNIT["function"]["parameters"])
    srv.wait_idle()


def test_completions_constraint_and_continue_final_message(srv, client):
    r = client.completions.create(model=MODEL, prompt="Pick one:", max_tokens=8, temperature=1.0, seed=5, n=3,
                                  extra_body={"guided_choice": ["alpha", "beta"]})
    assert all(c.text in ("alpha", "beta") and c.finish_reason == "stop" for c in r.choices), r.choices
    msgs = ASK + [{"role": "assistant", "content": "The weather in Paris is"}]
    with canned(srv, " sunny.") as seen:
        r = client.chat.completions.create(model=MODEL, messages=msgs,
                                           extra_body={"continue_final_message": True})
    prompt = srv.engine.tokenizer.decode(seen["prompt_ids"], skip_special_tokens=False)
    assert prompt.endswith("The weather in Paris is") and r.choices[0].message.content == " sunny."


def test_a_cached_constraint_takes_no_hop_through_the_engine_loop():
    """The up-front compile of a request's constraint goes through the engine's loop only to
    build the compiler the first time; afterwards a cached grammar is checked inline (a burst of
    JSON requests otherwise waited a step each for that hop). A bad schema is still a 400."""
    import asyncio

    from jaxllm.models.loader import embedded_model_path
    from jaxllm.models.tokenizer import Tokenizer
    from jaxllm.server.protocol import APIError
    from jaxllm.server.serving import ServingBase

    tok = Tokenizer.from_gguf(embedded_model_path())  # a fresh tokenizer: no compiler built yet
    calls = []

    class Engine:
        tokenizer = tok

        async def call(self, fn):
            calls.append(fn)
            return fn(SimpleNamespace(tokenizer=tok))

    serving = ServingBase(Engine(), [MODEL])
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}

    def req(s):
        return SimpleNamespace(constraint_kwargs=lambda: ("response_format", {"json": s}), whitespace=lambda: {})

    first = asyncio.run(serving.constraint(req(schema)))
    assert first.json == schema and len(calls) == 1
    for _ in range(3):
        assert asyncio.run(serving.constraint(req(schema))).json == schema
    assert len(calls) == 1  # no hop once the compiler exists and the grammar is cached
    with pytest.raises(APIError) as err:
        asyncio.run(serving.constraint(req({"type": "object", "properties": {"a": {"type": "nonsense"}}})))
    assert err.value.status == 400 and err.value.param == "response_format"
    assert len(calls) == 1


TAG_SCHEMA = {"type": "object", "properties": {"unit": {"enum": ["celsius", "fahrenheit"]},
                                               "n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["unit", "n"], "additionalProperties": False,
              # compact JSON (llguidance's schema option): random weights would otherwise spend the
              # budget on the whitespace JSON allows; a tag has no whitespace_pattern of its own
              "x-guidance": {"whitespace_flexible": False}}


def test_structural_tag_constrains_between_its_markers(srv, client):
    """vLLM's `structured_outputs.structural_tag` on the real engine: text is free until a trigger,
    then the tag's begin, a JSON value of its schema and its end are forced. The trigger is the text
    of the token this random-weight model writes first when unconstrained, so greedy decoding walks
    into the tag (only the constraint can make what follows valid). A malformed tag is a 400 naming
    the field, whatever is wrong with it."""
    import re

    import jsonschema

    msgs = [{"role": "user", "content": "Set the unit."}]
    trigger = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=1,
                                             temperature=0).choices[0].message.content
    assert trigger, "the model's first token has no text of its own"
    begin, end = trigger + "<set>", "</set>"
    tag = {"structures": [{"begin": begin, "schema": TAG_SCHEMA, "end": end}], "triggers": [trigger]}
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=40, temperature=0,
                                       extra_body={"structured_outputs": {"structural_tag": tag}})
    text = r.choices[0].message.content
    assert text.startswith(begin), text  # the trigger came first: the tag began at once
    pattern = re.escape(begin) + "(.*?)" + re.escape(end)
    bodies = re.findall(pattern, text, flags=re.S)
    assert bodies, text
    for body in bodies:
        jsonschema.validate(json.loads(body), TAG_SCHEMA)
    # Outside the tags the text is free, but every trigger in it opened a tag: only a tag cut
    # short by max_tokens may be left over, at the very end.
    rest = re.sub(pattern, "", text, flags=re.S)
    cut = rest.find(trigger)
    assert cut < 0 or (text.endswith(rest[cut:]) and r.choices[0].finish_reason == "length"
                       and (rest[cut:].startswith(begin) or begin.startswith(rest[cut:]))), text
    # The tag as a JSON string (vLLM takes both) is the same constraint.
    again = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=40, temperature=0,
                                           extra_body={"structured_outputs": {"structural_tag": json.dumps(tag)}})
    assert again.choices[0].message.content == text

    good = {"begin": "<a>", "schema": {"type": "object"}, "end": "</a>"}
    bad = [
        ("not json", "not valid JSON"),
        ({"structures": [good]}, "triggers"),
        ({"structures": [{"end": "</a>"}], "triggers": ["<a"]}, "begin"),
        ({"structures": [{"begin": "<a>"}], "triggers": ["<a"]}, "end"),
        ({"structures": [], "triggers": []}, "non-empty"),
        ({"structures": {"begin": "<a>", "end": "</a>"}, "triggers": ["<a"]}, "structures"),
        ({"structures": [good], "triggers": "<a"}, "triggers"),
        ({"structures": [good], "triggers": [1]}, "triggers"),
        ({"structures": [good], "triggers": ["<b"]}, "no trigger is a prefix"),
        ({"structures": [{**good, "schema": {"type": "no-such-type"}}], "triggers": ["<a"]}, "no-such-type"),
        ({"structures": [{**good, "schema": 5}], "triggers": ["<a"]}, "schema"),
        (5, "structural_tag"),  # neither a string nor an object: the request model refuses it
    ]
    for value, reason in bad:
        res = httpx.post(f"{srv.url}/v1/chat/completions", timeout=30, json={
            "model": MODEL, "messages": msgs, "max_tokens": 4, "structured_outputs": {"structural_tag": value}})
        assert res.status_code == 400, (value, res.status_code, res.text)
        err = res.json()["error"]
        assert err["param"].startswith("structured_outputs"), (value, err)
        assert "structural_tag" in err["message"] and reason in err["message"], (value, err)
    ok = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=2)
    assert ok.choices[0].finish_reason == "length"
    srv.wait_idle()  # every KV block back in the pool


def test_a_grammar_over_the_compile_time_limit_is_400(srv, client, monkeypatch):
    """A constraint whose grammar does not compile within the limit is refused with a 400 naming
    the field and the limit; nothing was admitted (no KV block held), and while that compile still
    runs the server answers a plain request and another constrained one. Its compile is held by a
    stand-in backend until the test lets it go, and the limit is cut to a fraction of a second."""
    import functools
    import threading

    import jaxllm.structured as structured
    from jaxllm.sampling_params import StructuredOutputsParams

    limit = 0.3
    compiler = srv.run(srv.engine.call(lambda e: structured.compiler_for(e.tokenizer)))
    slow_regex = "held-[0-9]{3}"  # this test's own: its compile waits for `release`
    release, started = threading.Event(), threading.Event()
    real_compile = compiler.backend.compile

    def held(params):
        if params.regex == slow_regex:
            started.set()
            release.wait(30)
        return real_compile(params)

    monkeypatch.setattr(compiler.backend, "compile", held)
    monkeypatch.setattr(structured, "validate", functools.partial(structured.validate, timeout_s=limit))
    total = srv.wait_idle()["num_total_blocks"]
    try:
        r = httpx.post(f"{srv.url}/v1/chat/completions", timeout=60, json={
            "model": MODEL, "messages": ASK, "max_tokens": 8, "structured_outputs": {"regex": slow_regex}})
        assert started.is_set()
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "structured_outputs", err
        assert "regex" in err["message"] and f"exceeded the {limit:g} s limit" in err["message"], err
        st = srv.engine.stats()
        assert st["num_waiting"] == 0 and st["num_running"] == 0 and st["num_free_blocks"] == total
        # The held compile occupies one compile thread; the server keeps answering meanwhile.
        plain = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=3)
        assert plain.choices[0].finish_reason == "length" and plain.usage.completion_tokens == 3
        other = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=8,
                                               extra_body={"guided_choice": ["quick", "fast"]})
        assert other.choices[0].message.content in ("quick", "fast")
        assert srv.wait_idle()["num_free_blocks"] == total
    finally:
        release.set()
    # Once compiled (and cached), the same constraint is served.
    compiler.submit(StructuredOutputsParams(regex=slow_regex)).result(30)
    again = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=12,
                                           extra_body={"structured_outputs": {"regex": slow_regex}})
    assert re.fullmatch(slow_regex, again.choices[0].message.content), again.choices[0].message.content
    assert srv.wait_idle()["num_free_blocks"] == total


TOOLS_TEMPLATE = (
    "{% if tools %}<tools>{% for t in tools %}[{{ t.function.name }}: {{ t.function.description or '' }} "
    "{{ t.function.parameters | tojson }}]{% endfor %}</tools>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_tools_reach_the_chat_template(srv, client, monkeypatch):
    """`tools` are handed to the chat template (apply_chat_template(tools=...)): under a template
    that prints them, each tool's name, description and parameter schema are in the prompt the
    engine receives; without tools the template prints none."""
    monkeypatch.setattr(srv.engine.tokenizer, "chat_template", TOOLS_TEMPLATE)
    named = {"type": "function", "function": {"name": "get_weather"}}
    with canned(srv, '{"city": "Oslo"}') as seen:
        r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=named)
    assert r.choices[0].message.tool_calls[0].function.name == "get_weather"
    prompt = srv.engine.tokenizer.decode(seen["prompt_ids"], skip_special_tokens=False)
    params = json.dumps(WEATHER["function"]["parameters"], ensure_ascii=False)
    assert f"[get_weather: Weather in a city {params}]" in prompt, prompt
    assert "[get_time: " in prompt and prompt.index("get_weather") < prompt.index("get_time"), prompt
    assert prompt.endswith("<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n"), prompt
    with canned(srv, "hi") as seen:
        client.chat.completions.create(model=MODEL, messages=ASK)
    prompt = srv.engine.tokenizer.decode(seen["prompt_ids"], skip_special_tokens=False)
    assert "<tools>" not in prompt and prompt.startswith("<|im_start|>user\n"), prompt
