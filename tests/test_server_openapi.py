"""A published schema that tells the truth: every schemathesis check against the live server
(tests/test_server.py's, shared through conftest.py), and what /openapi.json documents."""

from __future__ import annotations

import httpx
import pytest


@pytest.fixture(scope="module")
def srv(live_server):
    return live_server


CONSTRAINT_FIELDS = ("structured_outputs", "response_format", "guided_json", "guided_regex", "guided_choice",
                     "guided_grammar", "tools")
# Schema-valid requests the server refuses for a reason a JSON schema cannot state, by name:
# (the 400 message that identifies it, why the schema cannot express it).
SCHEMA_CANNOT_SAY = {
    "context length": ("maximum context length", "prompt tokens + max_tokens over max_model_len: a sum of the "
                                                 "tokenized prompt's length and a field"),
    "no room to generate": ("leaves no room to generate", "the tokenized prompt's length alone fills the context"),
    "empty final message": ("continue_final_message needs a final message", "a condition on the last message"),
    "template missing text": ("does not appear in the rendered chat", "depends on what the chat template renders"),
    "chat template refused": ("chat template failed", "the model's template (jinja) checks the conversation"),
    "constraint compiler": ("param=" + "|".join(CONSTRAINT_FIELDS), "schemas, regexes and grammars are checked by "
                                                                  "their compiler (and its size/time limits)"),
    "two constraints": ("give one output constraint", "at most one of several optional fields"),
    "whitespace without JSON": ("whitespace options", "one optional field requires another of some kinds"),
    "tool choice without tools": ("needs `tools`", "one optional field requires another"),
    "tool not in tools": ("which is not in `tools`", "a name must match an element of another field"),
    "auto tool choice off": ('"auto" tool choice requires', "a server flag (--enable-auto-tool-choice)"),
    "constraint with tool choice": ("cannot be combined with tool_choice", "two optional fields exclude each other"),
    "top_logprobs without logprobs": ("top_logprobs requires logprobs", "one optional field requires another"),
    "best_of": ("best_of different from n", "a field must equal another"),
    "max_tokens 0 without echo": ("0 only with echo", "one field's value requires another's"),
    "min_tokens over max_tokens": ("min_tokens must be less than or equal to max_tokens", "a field bounded by "
                                                                                        "another"),
    "schema names": ("structured_outputs must set exactly one", "exactly one of several optional fields"),
    "tools $defs": ("$defs", "definitions merged across tools must agree"),
    "prompt tokenizes to nothing": ("the prompt is empty", "a text of characters the vocabulary lacks (SmolLM2 "
                                    "has no token for bytes 0x04 0x06 0x13 0x14 0x16 0x1d) has no tokens"),
}


def _cannot_say(resp) -> str | None:
    if resp.status_code != 400:
        return None
    try:
        err = resp.json()["error"]
    except ValueError:
        return None

    def hit(needle: str) -> bool:
        if needle.startswith("param="):
            return err.get("param") in needle[len("param="):].split("|")
        return needle in err["message"]
    return next((name for name, (needle, _) in SCHEMA_CANNOT_SAY.items() if hit(needle)), None)


def test_schemathesis_all_checks(srv):
    """Every schemathesis check on every operation, positive and negative examples (bounded); the only
    failures allowed are schema-valid requests refused for a reason named in SCHEMA_CANNOT_SAY."""
    import schemathesis
    from hypothesis import HealthCheck, given, settings
    from hypothesis.errors import Unsatisfiable
    from schemathesis.checks import CHECKS, load_all_checks
    from schemathesis.generation.modes import GenerationMode
    from schemathesis.openapi.checks import RejectedPositiveData

    load_all_checks()
    checks = list(CHECKS.get_all())
    assert len(checks) >= 10
    schema = schemathesis.openapi.from_url(f"{srv.url}/openapi.json")
    failures, excused = [], set()
    for result in schema.get_all_operations():
        op = result.ok()
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):

            @settings(max_examples=15, deadline=None, database=None, suppress_health_check=list(HealthCheck))
            @given(case=op.as_strategy(mode))
            def check(case) -> None:
                body = case.body if isinstance(case.body, dict) else {}
                # Keep generations short (CPU time), in positive cases only: in a negative one the
                # clamp could repair the very value schemathesis made invalid (a float, or one over
                # the schema's maximum) and turn a correct 400 into an "accepted negative data".
                for key in ("max_tokens", "max_completion_tokens"):
                    if mode == GenerationMode.POSITIVE and isinstance(body.get(key), (int, float)) \
                            and not isinstance(body[key], bool) and body[key] > 8:
                        body[key] = 8
                if "messages" in body and op.path == "/v1/chat/completions":
                    body.setdefault("max_completion_tokens", 8)
                resp = case.call(base_url=srv.url, timeout=120)
                try:
                    case.validate_response(resp, checks=checks)
                except BaseException as group:  # schemathesis' FailureGroup
                    for f in getattr(group, "exceptions", [group]):
                        name = _cannot_say(resp) if isinstance(f, RejectedPositiveData) else None
                        if name is not None:
                            excused.add(name)
                        else:
                            failures.append((op.label, mode.value, type(f).__name__, resp.status_code,
                                             resp.text[:300], repr(case.body)[:600]))

            try:
                check()
            except Unsatisfiable:  # no invalid input exists (e.g. a GET without parameters)
                assert mode == GenerationMode.NEGATIVE
    assert not failures, "\n".join(map(str, failures[:8]))
    assert httpx.get(f"{srv.url}/health").status_code == 200
    srv.wait_idle(60)


def test_openapi_documents_statuses_and_media_types(srv):
    spec = httpx.get(f"{srv.url}/openapi.json").json()
    chat = spec["paths"]["/v1/chat/completions"]["post"]["responses"]
    assert {"200", "400", "404", "413", "503"} <= set(chat) and "422" not in chat
    assert set(chat["200"]["content"]) == {"application/json", "text/event-stream"}
    assert chat["400"]["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorResponse")
    assert spec["paths"]["/health"]["get"]["responses"]["200"].get("content", {}) == {}
    assert set(spec["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == {"text/plain"}
    assert "securitySchemes" not in spec.get("components", {})
    n = spec["components"]["schemas"]["ChatCompletionRequest"]["properties"]["n"]
    assert n["maximum"] == srv.engine.max_num_seqs
    # An empty stop string is refused (as SamplingParams refuses it), so the schema says so:
    # schemathesis once drew stop [""] as a valid request and got the 400.
    for req in ("ChatCompletionRequest", "CompletionRequest"):
        stop = spec["components"]["schemas"][req]["properties"]["stop"]["anyOf"]
        strings = [s for s in stop if s.get("type") == "string"] + [s["items"] for s in stop if s.get("type") == "array"]
        assert len(strings) == 2 and all(s.get("minLength") == 1 for s in strings), stop
    srv.app.state.api_key = "sk-test"
    try:
        keyed = httpx.get(f"{srv.url}/openapi.json").json()
    finally:
        srv.app.state.api_key = None
    assert keyed["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"
    assert keyed["paths"]["/v1/models"]["get"]["security"] == [{"bearer": []}]
    assert "401" in keyed["paths"]["/v1/models"]["get"]["responses"]


def test_prompt_of_characters_without_tokens_is_a_400(srv):
    """The case schemathesis found: "\\x06" is a valid string with no SmolLM2 token (the byte-level
    vocabulary lacks six control bytes), so the prompt is empty after tokenizing: a 400 naming it,
    and the server goes on."""
    r = httpx.post(f"{srv.url}/v1/completions", json={"prompt": ["\x06"], "max_tokens": 1}, timeout=30)
    assert r.status_code == 400 and "the prompt is empty" in r.json()["error"]["message"], r.text
    assert httpx.get(f"{srv.url}/health").status_code == 200
