"""instructor over the openai SDK, as its documentation shows it: JSON_SCHEMA, TOOLS, TOOLS_STRICT and
RESPONSES_TOOLS modes (the last sends a named function and text.format together), partial streaming, and a
re-ask after a validation error (the failed call and the error go back to the model as a tool turn)."""

from __future__ import annotations

import json

import httpx
import instructor
import openai
import pytest
from pydantic import BaseModel, Field, field_validator

from tests.clients.conftest import MODEL

pytestmark = pytest.mark.slow
TEXT = "John Smith is 30 years old."


class User(BaseModel):
    name: str = Field(max_length=20)
    age: int = Field(ge=0, le=150)


@pytest.fixture(scope="module")
def sent(base_url: str) -> list[dict]:
    return []


@pytest.fixture(scope="module")
def sdk(base_url: str, sent: list[dict]) -> openai.OpenAI:
    def record(request: httpx.Request) -> None:
        if request.method == "POST":
            sent.append({"path": request.url.path, **json.loads(request.content)})

    http = httpx.Client(timeout=120, event_hooks={"request": [record]})
    return openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, http_client=http)


@pytest.mark.parametrize("mode", [instructor.Mode.JSON_SCHEMA, instructor.Mode.TOOLS, instructor.Mode.TOOLS_STRICT])
def test_chat_modes(sdk: openai.OpenAI, mode: instructor.Mode) -> None:
    client = instructor.from_openai(sdk, mode=mode)
    user = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": TEXT}],
                                          response_model=User, max_tokens=60, temperature=0, max_retries=0)
    assert isinstance(user, User)


def test_responses_tools_mode(sdk: openai.OpenAI, sent: list[dict]) -> None:
    client = instructor.from_openai(sdk, mode=instructor.Mode.RESPONSES_TOOLS)
    user = client.responses.create(model=MODEL, input=TEXT, response_model=User, max_output_tokens=60,
                                   temperature=0, max_retries=0)
    assert isinstance(user, User)
    asked = sent[-1]
    assert asked["path"].endswith("/responses") and asked["tool_choice"]["name"] == "User" and "text" in asked


def test_partial_streaming(sdk: openai.OpenAI) -> None:
    client = instructor.from_openai(sdk, mode=instructor.Mode.TOOLS)
    partials = list(client.chat.completions.create_partial(
        model=MODEL, messages=[{"role": "user", "content": TEXT}], response_model=User, max_tokens=60, temperature=0))
    assert len(partials) > 2 and isinstance(partials[-1].age, int) and partials[-1].name
    assert partials[0].name is None or len(partials[0].name or "") <= len(partials[-1].name)


def test_reask_after_a_validation_error(sdk: openai.OpenAI, sent: list[dict]) -> None:
    attempts: list[str] = []

    class CheckedUser(User):
        @field_validator("name")
        @classmethod
        def first_attempt_fails(cls, name: str) -> str:
            attempts.append(name)
            if len(attempts) == 1:
                raise ValueError("the name must be written in capital letters")
            return name

    client = instructor.from_openai(sdk, mode=instructor.Mode.TOOLS)
    before = len(sent)
    user = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": TEXT}],
                                          response_model=CheckedUser, max_tokens=60, temperature=0, max_retries=2)
    assert isinstance(user, CheckedUser) and len(attempts) == 2
    reask = sent[before + 1]["messages"]  # the failed call and the error went back to the model
    assert [m["role"] for m in reask[-2:]] == ["assistant", "tool"] and "capital letters" in reask[-1]["content"]
