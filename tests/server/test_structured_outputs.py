"""Structured outputs through the official `openai` client on the demo model: every output follows its
JSON schema, regex, choice or grammar (enforced token by token, not hoped for), in batches mixed with free
requests, streamed and not, with n > 1; malformed schemas and regexes are 400s that name the problem;
logit_bias moves the logits."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from tests.live_server import MODEL_DIR, live_server

pytestmark = pytest.mark.slow

SCHEMAS: dict[str, dict[str, Any]] = {
    "nested": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 24},
            "location": {
                "type": "object",
                "properties": {"lat": {"type": "number", "minimum": -90, "maximum": 90},
                               "lon": {"type": "number", "minimum": -180, "maximum": 180}},
                "required": ["lat", "lon"],
                "additionalProperties": False,
            },
        },
        "required": ["city", "location"],
        "additionalProperties": False,
    },
    "array_of_enums": {
        "type": "object",
        "properties": {"colors": {"type": "array", "items": {"type": "string", "enum": ["red", "green", "blue"]},
                                  "minItems": 1, "maxItems": 3}},
        "required": ["colors"],
        "additionalProperties": False,
    },
    "bounded_numbers": {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 16},
                       "age": {"type": "integer", "minimum": 18, "maximum": 99},
                       "score": {"type": "number", "minimum": 0, "maximum": 1}},
        "required": ["name", "age", "score"],
        "additionalProperties": False,
    },
    "flags": {
        "type": "object",
        "properties": {"answer": {"type": "string", "enum": ["yes", "no", "maybe"]},
                       "sure": {"type": "boolean"}},
        "required": ["answer", "sure"],
        "additionalProperties": False,
    },
}
PROMPTS = {
    "nested": "Describe Paris as JSON with its coordinates.",
    "array_of_enums": "List the colors of the French flag as JSON.",
    "bounded_numbers": "Invent a person as JSON: name, age and a score.",
    "flags": "Is the sky blue? Answer as JSON.",
}
MAX_TOKENS = 120
MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def base_url() -> Iterator[str]:
    if not (MODEL_DIR / "config.json").is_file():
        pytest.skip(f"demo model not prepared at {MODEL_DIR}")
    # float32: streamed and non-streamed greedy outputs are compared token for token (see test_openai_api)
    with live_server("--model", str(MODEL_DIR), "--backend", "cpu", "--dtype", "float32", "--max-num-seqs", "16",
                     "--served-model-name", MODEL) as url:
        yield url


@pytest.fixture(scope="module")
def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=300)


def _format(name: str) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name], "strict": True}}


def _ask(client: openai.OpenAI, name: str | None, stream: bool, temperature: float = 0.0, **kw: Any) -> list[str]:
    """The contents of the choices of one chat request (constrained by schema `name`, or free)."""
    prompt = PROMPTS[name] if name else "Tell me about the Eiffel Tower."
    args: dict[str, Any] = dict(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                max_tokens=MAX_TOKENS, temperature=temperature, **kw)
    if name:
        args["response_format"] = _format(name)
    if not stream:
        reply = client.chat.completions.create(**args)
        for c in reply.choices:
            assert c.finish_reason == "stop" or name is None, (name, c.message.content)
        return [c.message.content or "" for c in reply.choices]
    texts: dict[int, str] = {}
    finish: dict[int, str | None] = {}
    for chunk in client.chat.completions.create(stream=True, **args):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
            finish[c.index] = c.finish_reason or finish.get(c.index)
    if name:
        assert set(finish.values()) == {"stop"}, (name, texts)
    return [texts[i] for i in sorted(texts)]


def _valid(name: str, text: str) -> None:
    jsonschema.validate(json.loads(text), SCHEMAS[name])


def test_every_schema_holds_in_a_batch_mixed_with_free_requests(client: openai.OpenAI) -> None:
    """Each schema twice (streamed and not) beside free requests, all at once: one running batch."""
    jobs = [(name, stream) for name in SCHEMAS for stream in (False, True)] + [(None, False), (None, True)] * 2
    with ThreadPoolExecutor(len(jobs)) as pool:
        results = list(pool.map(lambda job: (job, _ask(client, *job)), jobs))
    for (name, _stream), texts in results:
        if name is not None:
            for text in texts:
                _valid(name, text)
        else:
            assert texts[0] and not texts[0].lstrip().startswith("{")  # free requests stay free
    greedy = {(name, stream): texts for (name, stream), texts in results if name}
    for name in SCHEMAS:  # streaming changes nothing
        assert greedy[(name, False)] == greedy[(name, True)]


def test_sampled_choices_each_follow_the_schema(client: openai.OpenAI) -> None:
    for stream in (False, True):
        texts = _ask(client, "bounded_numbers", stream, temperature=1.0, n=3, seed=11)
        assert len(texts) == 3
        for text in texts:
            _valid("bounded_numbers", text)


def test_json_object_regex_choice_and_grammar(client: openai.OpenAI) -> None:
    def ask(prompt: str, **kw: Any) -> str:
        reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                               max_tokens=80, temperature=0, **kw)
        assert reply.choices[0].finish_reason == "stop", reply.choices[0]
        return reply.choices[0].message.content or ""

    cat = ask("Give me a JSON object with a cat's name and age.", response_format={"type": "json_object"})
    assert isinstance(json.loads(cat), dict)
    phone = ask("Give me a phone number.", extra_body={"structured_outputs": {"regex": r"\+33 [1-9]( [0-9]{2}){4}"}})
    assert re.fullmatch(r"\+33 [1-9]( [0-9]{2}){4}", phone), phone
    pick = ask("Is Paris in France?", extra_body={"structured_outputs": {"choice": ["Yes, it is", "No"]}})
    assert pick in ("Yes, it is", "No")
    # vLLM's older name and llama-server's fields
    assert ask("Pick a number.", extra_body={"guided_regex": "[0-9]{2}"}).isdigit()
    gbnf = 'root ::= "The answer is " answer "."\nanswer ::= "yes" | "no"'
    assert ask("Is the sky blue?", extra_body={"grammar": gbnf}) in ("The answer is yes.", "The answer is no.")
    lark = 'start: "A" | "B" | "C"'
    assert ask("Pick a letter.", extra_body={"structured_outputs": {"grammar": lark}}) in ("A", "B", "C")
    llama_schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
                    "additionalProperties": False}
    jsonschema.validate(json.loads(ask("Is it ok? JSON.", extra_body={"json_schema": llama_schema})), llama_schema)


def test_completions_endpoint_takes_structured_outputs_too(client: openai.OpenAI) -> None:
    reply = client.completions.create(model=MODEL, prompt="The year the Eiffel Tower opened:", max_tokens=8,
                                      temperature=0, extra_body={"structured_outputs": {"regex": "1[0-9]{3}"}})
    assert re.fullmatch("1[0-9]{3}", reply.choices[0].text)


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
         "response_format.json_schema.schema", "nonsense"),
        ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs.regex", "unclosed group"),
        ({"structured_outputs": {"grammar": "start: missing_rule"}}, "structured_outputs.grammar", "missing_rule"),
        ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
        ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}},
         "structured_outputs.regex", "only one structured output"),
        ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema"),
        ({"logit_bias": {"hello": 5}}, "logit_bias", "token ids"),
        ({"logit_bias": {"12": 500}}, "logit_bias", "between -100 and 100"),
        ({"logit_bias": {"99999999": 1}}, "logit_bias", "out of range"),
    ],
)
def test_malformed_structured_output_is_a_400_naming_it(base_url: str, body: dict, param: str, words: str) -> None:
    r = httpx.post(f"{base_url}/v1/chat/completions", timeout=60,
                   json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert words in error["message"], error
    assert error["param"] is None or error["param"].startswith(param.split(".")[0]), error


def test_logit_bias_moves_the_choice(client: openai.OpenAI, base_url: str) -> None:
    tokenized = httpx.post(f"{base_url}/tokenize", json={"prompt": " banana", "add_special_tokens": False})
    tokens = tokenized.json()["tokens"]
    reply = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What is the capital of France?"}], max_tokens=3,
        temperature=0, logit_bias={str(tokens[0]): 100})
    content = reply.choices[0].message.content
    assert content is not None and content.count("banana") == 3, content
    free = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What is the capital of France?"}], max_tokens=3,
        temperature=0, logit_bias={str(tokens[0]): -100})
    assert free.choices[0].message.content is not None and "banana" not in free.choices[0].message.content
