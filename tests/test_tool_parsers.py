"""Tool-call and reasoning parsers on canned model text: what they extract, and that streaming
(the parse of every prefix) reassembles to exactly the non-streamed message."""

from __future__ import annotations

import json

import pytest

from jaxllm.server.chat_output import ChoiceText
from jaxllm.server.reasoning import get_reasoning_parser
from jaxllm.server.tool_calls import ToolMode
from jaxllm.server.tool_parsers import TOOL_PARSERS, get_tool_parser

W = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
T = '{"name": "get_time", "arguments": {"tz": "CET"}}'
CASES = {
    "hermes": [
        (f"Let me check.\n<tool_call>\n{W}\n</tool_call>\n<tool_call>\n{T}\n</tool_call>", "Let me check.\n",
         ["get_weather", "get_time"]),
        (f"<tool_call>{W}", "", ["get_weather"]),  # unclosed last block: parsed at the end
        ("No tools needed: 2 < 3 and <tool_ is not a tag.", "No tools needed: 2 < 3 and <tool_ is not a tag.", []),
        ("<tool_call>{not json}</tool_call> tail", "<tool_call>{not json}</tool_call> tail", []),
        (f"<tool_call>{W}</tool_call>\nDone.", "Done.", ["get_weather"]),
    ],
    "llama3_json": [
        ('{"name": "get_weather", "parameters": {"city": "Paris"}}', "", ["get_weather"]),
        ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
         '{"name": "get_time", "parameters": {}}', "", ["get_weather", "get_time"]),
        ("The weather is fine.", "The weather is fine.", []),
        ('{"answer": 42}', '{"answer": 42}', []),
    ],
    "mistral": [
        (f"[TOOL_CALLS] [{W}, {T}]", "", ["get_weather", "get_time"]),
        ('Sure.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}', "Sure.",
         ["get_weather", "get_time"]),
        ("Just text [TOOL", "Just text [TOOL", []),
    ],
}


def _stream(reader: ChoiceText, text: str) -> dict:
    """Feed the text in small pieces as a stream does; reassemble the deltas like a client."""
    msg: dict = {"content": "", "reasoning_content": "", "tool_calls": []}
    for end in list(range(1, len(text), 3)) + [len(text)]:
        d, _ = reader.delta(text[:end], final=end == len(text))
        msg["content"] += d.get("content", "")
        msg["reasoning_content"] += d.get("reasoning_content", "")
        for tc in d.get("tool_calls", []):
            if tc["index"] == len(msg["tool_calls"]):
                msg["tool_calls"].append({"id": tc["id"], "type": "function",
                                          "function": {"name": tc["function"]["name"], "arguments": ""}})
            msg["tool_calls"][tc["index"]]["function"]["arguments"] += tc["function"]["arguments"]
    return msg


def _same(full: dict, streamed: dict) -> None:
    assert (full["content"] or "") == streamed["content"]
    assert (full.get("reasoning_content") or "") == streamed["reasoning_content"]
    assert full.get("tool_calls", []) == streamed["tool_calls"]


@pytest.mark.parametrize("parser,text,content,names",
                         [(p, *case) for p, cases in CASES.items() for case in cases])
def test_auto_parsers_extract_and_stream_the_same(parser, text, content, names):
    mode = ToolMode("auto")
    reader = ChoiceText(mode, get_tool_parser(parser), None, False)
    full = reader.message(text)
    assert [c["function"]["name"] for c in full.get("tool_calls", [])] == names
    assert (full["content"] or "") == content
    for c in full.get("tool_calls", []):
        assert isinstance(json.loads(c["function"]["arguments"]), dict)
    assert reader.tools_called(reader.view(text, True)) == bool(names)
    stream_reader = ChoiceText(mode, get_tool_parser(parser), None, False)
    streamed = _stream(stream_reader, text)
    stream_reader.ids = reader.ids  # ids are random per reader; the calls must match otherwise
    for got, want in zip(streamed["tool_calls"], full.get("tool_calls", [])):
        got["id"] = want["id"]
    _same(full, streamed)


def test_parser_registry_and_arguments():
    assert {"hermes", "llama3_json", "mistral"} <= set(TOOL_PARSERS)
    with pytest.raises(ValueError, match="hermes"):
        get_tool_parser("nope")
    calls = get_tool_parser("hermes").parse(f"<tool_call>{W}</tool_call>", final=True).calls
    assert json.loads(calls[0].arguments) == {"city": "Paris", "unit": "celsius"}
    assert len(get_tool_parser("mistral").new_id()) == 9


@pytest.mark.parametrize("name,prompt,text,reasoning,content", [
    ("qwen3", "<|im_start|>assistant\n", "<think>\nSteps.\n</think>\n\nThe answer.", "\nSteps.\n", "\n\nThe answer."),
    ("qwen3", "<|im_start|>assistant\n<think>\n", "Steps.</think>Answer", "Steps.", "Answer"),
    ("qwen3", "<|im_start|>assistant\n", "Plain answer, no thinking.", None, "Plain answer, no thinking."),
    ("qwen3", "<|im_start|>assistant\n<think>\n\n</think>\n\n", "Thinking off.", None, "Thinking off."),
    ("deepseek_r1", "<|Assistant|><think>\n", "Hmm, 2+2.</think>4", "Hmm, 2+2.", "4"),
    ("deepseek_r1", "<|Assistant|>", "<think>a</think>b", "a", "b"),
    ("deepseek_r1", "<|Assistant|><think>\n", "cut short before the end", "cut short before the end", ""),
])
def test_reasoning_parsers(name, prompt, text, reasoning, content):
    rp = get_reasoning_parser(name)
    reader = ChoiceText(ToolMode("none"), None, rp, rp.starts_open(prompt))
    full = reader.message(text)
    assert full["reasoning_content"] == reasoning and full["content"] == content
    _same(full, _stream(ChoiceText(ToolMode("none"), None, rp, rp.starts_open(prompt)), text))


def test_reasoning_then_tool_call_and_required_and_named():
    rp = get_reasoning_parser("qwen3")
    text = f"<think>I should call it.</think>\n<tool_call>{W}</tool_call>"
    reader = ChoiceText(ToolMode("auto"), get_tool_parser("hermes"), rp, False)
    msg = reader.message(text)
    assert msg["reasoning_content"] == "I should call it." and msg["content"] is None
    assert msg["tool_calls"][0]["function"]["name"] == "get_weather"
    req = '[{"name": "get_weather", "parameters": {"city": "Rome"}}, {"name": "get_time", "parameters": {}}]'
    r = ChoiceText(ToolMode("required"), None, None, False)
    msg = r.message(req)
    assert [c["function"]["name"] for c in msg["tool_calls"]] == ["get_weather", "get_time"]
    assert r.tools_called(r.view(req, True))
    one = ChoiceText(ToolMode("required", parallel=False), None, None, False).message(req)
    assert len(one["tool_calls"]) == 1
    named = ChoiceText(ToolMode("named", "get_weather"), None, None, False)
    msg = named.message('{"city": "Oslo"}')
    assert msg["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    assert not named.tools_called(named.view('{"city": "Oslo"}', True))  # named: finish_reason stays "stop"
    streamed = _stream(ChoiceText(ToolMode("named", "get_weather"), None, None, False), '{"city": "Oslo"}')
    assert streamed["tool_calls"][0]["function"]["arguments"] == '{"city": "Oslo"}'


def test_eos_text_kept_by_special_token_parsers_is_not_content():
    text = '[TOOL_CALLS][{"name": "f", "arguments": {}}]</s>'
    msg = ChoiceText(ToolMode("auto"), get_tool_parser("mistral"), None, False, "</s>").message(text)
    assert msg["content"] is None and msg["tool_calls"][0]["function"]["name"] == "f"
    plain = ChoiceText(ToolMode("auto"), get_tool_parser("mistral"), None, False, "</s>")
    assert plain.message("Hello.</s>")["content"] == "Hello."
    reader = ChoiceText(ToolMode("auto"), get_tool_parser("mistral"), None, False, "</s>")
    first, _ = reader.delta("Hello.", final=False)  # the EOS token's text comes whole, with the last delta
    last, _ = reader.delta("Hello.</s>", final=True)
    assert first.get("content", "") + last.get("content", "") == "Hello."
