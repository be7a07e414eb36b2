"""Ferrum's tokenizer against HF transformers' AutoTokenizer on the demo model folder.

transformers is the reference here only; ferrum.tokenizer itself must never import it.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from ferrum.tokenizer import ChatTemplateError, IncrementalDecoder, Tokenizer
from ferrum.tokenizer.cleanup import CleanupStream, clean_up_tokenization

transformers = pytest.importorskip("transformers")  # the reference the tokenizer is compared with

DEMO = Path(__file__).resolve().parents[2] / "models" / "SmolLM2-135M-Instruct"

TEXTS = [
    "",
    "Hello world",
    " leading space",
    "   three leading spaces and trailing   ",
    "line one\nline two\n\n\ttabbed",
    "café naïve Ångström façade jalapeño",
    "e\u0301 (combining accent)",
    "你好，世界！今天天气很好。",
    "日本語のテキストと한국어 텍스트",
    "emoji 👋🏽 family 👨\u200d👩\u200d👧\u200d👦 flag 🇫🇷 🎉🎉",
    "مرحبا بالعالم",
    "def f(x):\n    return x ** 2  # square\n",
    "numbers 1234567890 3.14159 -42",
    "<|im_start|>user\nhi<|im_end|>",
    "text with <|endoftext|> inside and <|im_end|>",
    "don't can't I'm we've they're it's",
    "Hello , world . How are you ?",
]

# Several conversations for the demo model's own template.
CONVERSATIONS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "Hello!"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is 2+2?"},
    ],
    [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Translate 'cat' into French and Japanese: 🐱"},
    ],
    [
        {"role": "system", "content": "  spaces kept  \n"},
        {"role": "user", "content": "a\nb"},
        {"role": "assistant", "content": "c"},
        {"role": "user", "content": "你好"},
    ],
]


# --- fixtures ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def demo() -> Path:
    if not (DEMO / "tokenizer.json").is_file():
        pytest.skip(f"demo model not prepared at {DEMO} (scripts/prepare_demo_model.py)")
    return DEMO


@pytest.fixture(scope="module")
def tok(demo: Path) -> Tokenizer:
    return Tokenizer.from_folder(demo)


@pytest.fixture(scope="module")
def hf(demo: Path) -> Any:
    return transformers.AutoTokenizer.from_pretrained(str(demo))


def make_folder(
    root: Path,
    demo: Path,
    *,
    tokenizer_config: dict[str, Any] | None = None,
    tokenizer_json: Path | None = None,
    files: dict[str, str] | None = None,
) -> Path:
    """A model folder linking to the demo tokenizer.json (or to `tokenizer_json`) with other settings."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "tokenizer.json").symlink_to(tokenizer_json or demo / "tokenizer.json")
    if tokenizer_config is not None:
        (root / "tokenizer_config.json").write_text(json.dumps(tokenizer_config), encoding="utf-8")
    for name, text in (files or {}).items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text, encoding="utf-8")
    return root


def demo_config(demo: Path, **overrides: Any) -> dict[str, Any]:
    config: dict[str, Any] = json.loads((demo / "tokenizer_config.json").read_text(encoding="utf-8"))
    config.update(overrides)
    return config


def hf_render(hf: Any, template: str, messages: list[dict[str, Any]], **kwargs: Any) -> Any:
    """HF's rendering with `template` set as the tokenizer's chat template."""
    saved = hf.chat_template
    hf.chat_template = template
    try:
        return hf.apply_chat_template(messages, **kwargs)
    finally:
        hf.chat_template = saved


def streamed(decoder: IncrementalDecoder, ids: list[int]) -> tuple[list[str], str]:
    pieces = [decoder.step(token_id) for token_id in ids]
    return pieces, decoder.flush()


# --- serving code stays free of transformers -----------------------------------------------------


def test_does_not_import_transformers() -> None:
    code = "import sys, ferrum.tokenizer; assert 'transformers' not in sys.modules, 'transformers imported'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[2])


# --- encode / decode / vocabulary ----------------------------------------------------------------


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_encode_matches_hf(tok: Tokenizer, hf: Any, add_special_tokens: bool) -> None:
    for text in TEXTS:
        assert tok.encode(text, add_special_tokens) == hf.encode(
            text, add_special_tokens=add_special_tokens
        ), text


@pytest.mark.parametrize("skip", [True, False])
def test_decode_matches_hf(tok: Tokenizer, hf: Any, skip: bool) -> None:
    for text in TEXTS:
        ids = hf.encode(text, add_special_tokens=False)
        assert tok.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip), text
    rng = random.Random(0)
    for _ in range(200):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 10))]
        assert tok.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip), ids


def test_id_to_token_text_is_single_id_decode(tok: Tokenizer, hf: Any) -> None:
    rng = random.Random(1)
    for token_id in [*range(20), *(rng.randrange(tok.vocab_size) for _ in range(100))]:
        assert tok.id_to_token_text(token_id) == hf.decode([token_id], skip_special_tokens=False)
    assert tok.id_to_token_text(2) == "<|im_end|>"
    assert tok.id_to_token_text(tok.encode("Hello world")[1]) == " world"


def test_vocabulary_and_special_tokens(tok: Tokenizer, hf: Any) -> None:
    assert tok.vocab_size == len(hf)
    assert tok.bos_token == hf.bos_token == "<|im_start|>"
    assert tok.eos_token == hf.eos_token == "<|im_end|>"
    assert tok.pad_token == hf.pad_token and tok.unk_token == hf.unk_token
    assert tok.bos_token_id == hf.bos_token_id == 1
    assert 2 in tok.eos_token_ids  # <|im_end|>
    assert tok.special_token_ids == {i for i, t in hf.added_tokens_decoder.items() if t.special}


# --- chat template on the demo model -------------------------------------------------------------


@pytest.mark.parametrize("conversation", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_demo_chat_template_matches_hf(
    tok: Tokenizer, hf: Any, conversation: list[dict[str, Any]], add_generation_prompt: bool
) -> None:
    text = tok.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt)
    assert text == hf.apply_chat_template(
        conversation, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    ids = tok.encode_chat(conversation, add_generation_prompt=add_generation_prompt)
    assert ids == hf.apply_chat_template(
        conversation, tokenize=True, add_generation_prompt=add_generation_prompt, return_dict=False
    )
    assert ids == tok.encode(text, add_special_tokens=False)


def test_demo_chat_template_default_system_prompt(tok: Tokenizer) -> None:
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


# --- other templates, rendered by Ferrum and by HF -----------------------------------------------

LLAMA3_STYLE = """\
{{- bos_token }}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] | trim %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set system_message = 'Today Date: ' + date_string if date_string is defined else '' %}
    {%- set loop_messages = messages %}
{%- endif %}
{%- if system_message %}
    {{- '<|start_header_id|>system<|end_header_id|>\\n\\n' + system_message + '<|eot_id|>' }}
{%- endif %}
{%- for message in loop_messages %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}
    {{- message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

ALTERNATION_MESSAGE = "Conversation roles must alternate user/assistant/user/assistant/..."

MISTRAL_STYLE = (
    """\
{{ bos_token }}
{% for message in messages %}
    {% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{ raise_exception('"""
    + ALTERNATION_MESSAGE
    + """') }}
    {% endif %}
    {% if message['role'] == 'user' %}
        {{ '[INST] ' + message['content'] + ' [/INST]' }}
    {% elif message['role'] == 'assistant' %}
        {{ message['content'] + eos_token }}
    {% else %}
        {{ raise_exception('Only user and assistant roles are supported!') }}
    {% endif %}
{% endfor %}
"""
)

QWEN_STYLE = """\
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\\n\\n' }}
    {%- endif %}
    {{- '# Tools\\n\\nFunction signatures within <tools></tools>:\\n<tools>' }}
    {%- for tool in tools %}
        {{- '\\n' }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- '\\n</tools>\\ncompact: ' + (tools[0] | tojson(separators=(',', ':'))) + '<|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'system' %}
        {%- continue %}
    {%- endif %}
    {%- if message.role == 'assistant' and message.tool_calls is defined %}
        {{- '<|im_start|>assistant' }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for call in message.tool_calls %}
            {%- set fn = call.function if call.function is defined else call %}
            {{- '\\n<tool_call>\\n{"name": "' + fn.name + '", "arguments": ' }}
            {{- fn.arguments | tojson(indent=2, sort_keys=true) }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == 'tool' %}
        {{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
    {%- endif %}
    {%- if max_turns is defined and loop.index >= max_turns %}
        {%- break %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

# Namespaces, {% generation %} blocks (HF's assistant-mask tag), strftime_now and documents.
MISC_STYLE = """\
{% set ns = namespace(turns=0) %}
{% for message in messages %}
{% set ns.turns = ns.turns + 1 %}
{% if message.role == 'assistant' %}
A: {% generation %}{{ message.content }}{% endgeneration %}

{% else %}
{{ message.role | upper }}: {{ message.content }}
{% endif %}
{% endfor %}
turns={{ ns.turns }} year={{ strftime_now('%Y') }} documents={{ documents | tojson }}
{% if add_generation_prompt %}A:{% endif %}
"""

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Météo actuelle <b>now</b> & forecast — 天气",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "description": "City name, e.g. Zürich"},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city"],
            },
        },
    },
    {"type": "function", "function": {"name": "now", "description": "Current time", "parameters": {}}},
]

TOOL_CONVERSATION: list[dict[str, Any]] = [
    {"role": "system", "content": "You can call tools."},
    {"role": "user", "content": "Weather in Zürich?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"unit": "celsius", "city": "Zürich"}},
            }
        ],
    },
    {"role": "tool", "content": '{"temp": 21, "sky": "☀️"}', "tool_call_id": "call_1"},
    {"role": "assistant", "content": "It is 21 °C and sunny ☀️."},
    {"role": "user", "content": "Thanks!"},
]

CHAT_CASES: list[tuple[str, str, list[dict[str, Any]], dict[str, Any]]] = [
    ("llama3-system", LLAMA3_STYLE, CONVERSATIONS[1], {}),
    ("llama3-date", LLAMA3_STYLE, CONVERSATIONS[2], {"date_string": "26 Jul 2024"}),
    ("llama3-no-date", LLAMA3_STYLE, CONVERSATIONS[0], {}),
    ("mistral", MISTRAL_STYLE, CONVERSATIONS[2], {}),
    ("qwen-tools", QWEN_STYLE, TOOL_CONVERSATION, {"tools": TOOLS}),
    ("qwen-no-tools", QWEN_STYLE, CONVERSATIONS[3], {}),
    ("qwen-break", QWEN_STYLE, CONVERSATIONS[2], {"max_turns": 2}),
    ("misc", MISC_STYLE, CONVERSATIONS[3], {}),
    ("misc-documents", MISC_STYLE, CONVERSATIONS[0], {"documents": [{"title": "t", "text": "ü"}]}),
]


@pytest.mark.parametrize(
    ("template", "messages", "kwargs"), [c[1:] for c in CHAT_CASES], ids=[c[0] for c in CHAT_CASES]
)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_templates_match_hf(
    tok: Tokenizer,
    hf: Any,
    template: str,
    messages: list[dict[str, Any]],
    kwargs: dict[str, Any],
    add_generation_prompt: bool,
) -> None:
    ferrum = tok.with_chat_template(template)
    text = ferrum.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, **kwargs)
    expected = hf_render(
        hf, template, messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
    )
    assert text == expected
    ids = ferrum.encode_chat(messages, add_generation_prompt=add_generation_prompt, **kwargs)
    assert ids == hf_render(
        hf,
        template,
        messages,
        tokenize=True,
        return_dict=False,
        add_generation_prompt=add_generation_prompt,
        **kwargs,
    )


def test_template_features_are_really_exercised(tok: Tokenizer) -> None:
    text = tok.with_chat_template(QWEN_STYLE).apply_chat_template(TOOL_CONVERSATION, tools=TOOLS)
    assert '"description": "Météo actuelle <b>now</b> & forecast — 天气"' in text  # tojson: no escaping
    assert 'compact: {"type":"function","function":{"name":"get_weather"' in text  # separators
    assert '"arguments": {\n  "city": "Zürich",\n  "unit": "celsius"\n}' in text  # indent, sort_keys
    assert "You can call tools." in text and text.count("<|im_start|>system") == 1  # continue
    two_turns = tok.with_chat_template(QWEN_STYLE).apply_chat_template(CONVERSATIONS[2], max_turns=2)
    assert "Translate" not in two_turns  # break
    llama = tok.with_chat_template(LLAMA3_STYLE).apply_chat_template(
        CONVERSATIONS[0], date_string="1 Jan 2025"
    )
    assert llama.startswith(
        "<|im_start|><|start_header_id|>system<|end_header_id|>\n\nToday Date: 1 Jan 2025"
    )


def test_raise_exception_reaches_caller_verbatim(tok: Tokenizer, hf: Any) -> None:
    bad = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    mistral = tok.with_chat_template(MISTRAL_STYLE)
    with pytest.raises(ChatTemplateError) as caught:
        mistral.apply_chat_template(bad)
    assert str(caught.value) == ALTERNATION_MESSAGE
    assert isinstance(caught.value, ValueError)
    with pytest.raises(ChatTemplateError) as caught:
        mistral.encode_chat([{"role": "user", "content": "u"}, {"role": "system", "content": "s"}])
    assert str(caught.value) == "Only user and assistant roles are supported!"
    with pytest.raises(Exception, match="roles must alternate"):  # HF refuses the same conversation
        hf_render(hf, MISTRAL_STYLE, bad, tokenize=False)


@pytest.mark.parametrize(
    ("template", "match"),
    [
        ("{% for m in messages %}{{ m.content }", "not valid Jinja"),
        ("{{ messages[0].content.__class__.__mro__ }}", "SecurityError"),
        ("{% set _ = messages.append(1) %}", "SecurityError"),
        ("{% set ns = namespace(_secret=1) %}", "SecurityError"),
        ("{{ messages[0].content + 1 }}", "TypeError"),
    ],
)
def test_template_failures_are_chat_template_errors(tok: Tokenizer, template: str, match: str) -> None:
    with pytest.raises(ChatTemplateError, match=match):
        tok.with_chat_template(template).apply_chat_template([{"role": "user", "content": "x"}])


def test_empty_conversation_is_refused(tok: Tokenizer) -> None:
    with pytest.raises(ChatTemplateError, match="empty"):
        tok.apply_chat_template([])


def test_messages_are_not_modified(tok: Tokenizer) -> None:
    messages = json.loads(json.dumps(TOOL_CONVERSATION))
    tok.with_chat_template(QWEN_STYLE).apply_chat_template(messages, tools=TOOLS)
    assert messages == TOOL_CONVERSATION


# --- where templates come from -------------------------------------------------------------------


def test_template_from_tokenizer_config_string(tmp_path: Path, demo: Path) -> None:
    config = demo_config(demo, chat_template=LLAMA3_STYLE)
    folder = make_folder(tmp_path / "m", demo, tokenizer_config=config)
    hf = transformers.AutoTokenizer.from_pretrained(str(folder))
    tok = Tokenizer.from_folder(folder)
    expected = hf.apply_chat_template(CONVERSATIONS[1], tokenize=False, add_generation_prompt=True)
    assert tok.apply_chat_template(CONVERSATIONS[1]) == expected
    assert tok.chat_template == LLAMA3_STYLE


def test_named_templates_pick_default_or_tool_use(tmp_path: Path, demo: Path) -> None:
    config = demo_config(
        demo,
        chat_template=[
            {"name": "default", "template": LLAMA3_STYLE},
            {"name": "tool_use", "template": QWEN_STYLE},
        ],
    )
    folder = make_folder(tmp_path / "m", demo, tokenizer_config=config)
    hf = transformers.AutoTokenizer.from_pretrained(str(folder))
    tok = Tokenizer.from_folder(folder)
    plain = tok.apply_chat_template(CONVERSATIONS[1])
    assert plain == hf.apply_chat_template(CONVERSATIONS[1], tokenize=False, add_generation_prompt=True)
    assert "<|start_header_id|>" in plain
    with_tools = tok.apply_chat_template(TOOL_CONVERSATION, tools=TOOLS)
    assert with_tools == hf.apply_chat_template(
        TOOL_CONVERSATION, tools=TOOLS, tokenize=False, add_generation_prompt=True
    )
    assert "<tools>" in with_tools


def test_template_file_wins_over_config(tmp_path: Path, demo: Path) -> None:
    folder = make_folder(
        tmp_path / "m",
        demo,
        tokenizer_config=demo_config(demo, chat_template="from config"),
        files={"chat_template.jinja": "from file"},
    )
    assert (
        Tokenizer.from_folder(folder).apply_chat_template([{"role": "user", "content": "x"}]) == "from file"
    )


def test_model_without_chat_template(tmp_path: Path, demo: Path) -> None:
    folder = make_folder(tmp_path / "m", demo, tokenizer_config=demo_config(demo))
    tok = Tokenizer.from_folder(folder)
    assert tok.chat_template is None
    assert tok.encode("still encodes") == Tokenizer.from_folder(demo).encode("still encodes")
    with pytest.raises(ChatTemplateError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])
    with pytest.raises(ChatTemplateError):
        tok.encode_chat([{"role": "user", "content": "hi"}])


# --- loading errors and config files -------------------------------------------------------------


def test_missing_folder(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        Tokenizer.from_folder(tmp_path / "nope")


def test_missing_tokenizer_json(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError) as caught:
        Tokenizer.from_folder(tmp_path)
    assert "tokenizer.json" in str(caught.value) and str(tmp_path) in str(caught.value)


def test_unreadable_tokenizer_json(tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError) as caught:
        Tokenizer.from_folder(tmp_path)
    assert "tokenizer.json" in str(caught.value) and str(tmp_path) in str(caught.value)


def test_unreadable_tokenizer_config(tmp_path: Path, demo: Path) -> None:
    folder = make_folder(tmp_path / "m", demo, files={"tokenizer_config.json": "[1, 2"})
    with pytest.raises(ValueError, match="tokenizer_config.json"):
        Tokenizer.from_folder(folder)


def test_eos_ids_are_the_union_of_all_configs(tmp_path: Path, demo: Path) -> None:
    eos = {"content": "<|im_end|>", "lstrip": False, "rstrip": False, "normalized": False, "special": True}
    folder = make_folder(
        tmp_path / "m",
        demo,
        tokenizer_config=demo_config(demo, eos_token=eos),
        files={
            "generation_config.json": json.dumps({"eos_token_id": [0, 7]}),
            "config.json": json.dumps({"eos_token_id": 5, "text_config": {"eos_token_id": 9}}),
        },
    )
    tok = Tokenizer.from_folder(folder)
    assert tok.eos_token == "<|im_end|>"
    assert tok.eos_token_ids == {0, 2, 5, 7, 9}


def test_demo_eos_ids(tok: Tokenizer, demo: Path) -> None:
    generation = json.loads((demo / "generation_config.json").read_text())
    assert tok.eos_token_ids == {2} | (
        {generation["eos_token_id"]} if "eos_token_id" in generation else set()
    )


def test_special_token_missing_from_vocab_is_added(tmp_path: Path, demo: Path) -> None:
    folder = make_folder(tmp_path / "m", demo, tokenizer_config=demo_config(demo, mask_token="<mask_x>"))
    hf = transformers.AutoTokenizer.from_pretrained(str(folder))
    tok = Tokenizer.from_folder(folder)
    assert tok.vocab_size == len(hf) == Tokenizer.from_folder(demo).vocab_size + 1
    text = "a <mask_x> b"
    assert tok.encode(text) == hf.encode(text)
    assert tok.decode(tok.encode(text)) == hf.decode(hf.encode(text), skip_special_tokens=True) == "a  b"


# --- BOS / EOS flags against the tokenizer.json post-processor -----------------------------------


@pytest.fixture(scope="module")
def bos_tokenizer_json(demo: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo tokenizer.json with a post-processor that adds BOS (<|im_start|>), as Llama's does."""
    data: dict[str, Any] = json.loads((demo / "tokenizer.json").read_text(encoding="utf-8"))
    data["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [
            {"SpecialToken": {"id": "<|im_start|>", "type_id": 0}},
            {"Sequence": {"id": "A", "type_id": 0}},
        ],
        "pair": [
            {"SpecialToken": {"id": "<|im_start|>", "type_id": 0}},
            {"Sequence": {"id": "A", "type_id": 0}},
            {"Sequence": {"id": "B", "type_id": 1}},
        ],
        "special_tokens": {"<|im_start|>": {"id": "<|im_start|>", "ids": [1], "tokens": ["<|im_start|>"]}},
    }
    path = tmp_path_factory.mktemp("bos") / "tokenizer.json"
    path.write_text(json.dumps(data), encoding="utf-8")
    return path


@pytest.mark.parametrize(
    ("post_processor_adds_bos", "flags", "prefix", "suffix", "same_as_hf"),
    [
        (True, {"add_bos_token": True}, [1], [], True),  # BOS once, not twice
        (True, {}, [1], [], True),  # no flags: tokenizer.json decides
        (True, {"add_bos_token": False}, [1], [], True),  # a false flag takes nothing away
        (False, {}, [], [], True),
        (False, {"add_bos_token": False, "add_eos_token": False}, [], [], True),
        # HF v5 drops these flags whenever tokenizer.json exists; Ferrum honours them.
        (False, {"add_bos_token": True}, [1], [], False),
        (False, {"add_bos_token": True, "add_eos_token": True}, [1], [2], False),
        (True, {"add_bos_token": True, "add_eos_token": True}, [1], [2], False),
    ],
)
def test_bos_eos_flags(
    tmp_path: Path,
    demo: Path,
    bos_tokenizer_json: Path,
    post_processor_adds_bos: bool,
    flags: dict[str, bool],
    prefix: list[int],
    suffix: list[int],
    same_as_hf: bool,
) -> None:
    folder = make_folder(
        tmp_path / "m",
        demo,
        tokenizer_config=demo_config(demo, **flags),
        tokenizer_json=bos_tokenizer_json if post_processor_adds_bos else None,
    )
    tok = Tokenizer.from_folder(folder)
    body = tok.encode("Hello there", add_special_tokens=False)
    assert body == [19556, 665]
    assert tok.encode("Hello there") == prefix + body + suffix
    assert tok.encode("") == prefix + suffix
    chat = tok.with_chat_template(
        "{{ bos_token }}{{ messages[0].content }}"
    )  # the template writes BOS itself
    assert chat.encode_chat([{"role": "user", "content": "Hello there"}]) == [1, *body]
    if same_as_hf:
        hf = transformers.AutoTokenizer.from_pretrained(str(folder))
        assert tok.encode("Hello there") == hf.encode("Hello there")
        assert tok.encode("Hello there", add_special_tokens=False) == hf.encode(
            "Hello there", add_special_tokens=False
        )


# --- incremental decoding ------------------------------------------------------------------------

STREAM_TEXTS = [
    "Hello 👋🏽 wörld, 你好世界! café  naïve 🇫🇷 ",
    "  leading spaces then 日本語 and 한국어 and emoji 🎉🤖👨\u200d👩\u200d👧",
    "Ångström façade jalapeño — “quotes” … ½ € ✓",
    "e\u0301e\u0301 नमस्ते مرحبا",
    "\n\n  code:\n\tx = '→'\n",
]


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("text", STREAM_TEXTS)
def test_incremental_decoder_concatenation(tok: Tokenizer, text: str, skip: bool) -> None:
    ids = [1, *tok.encode(text), 2, 0]  # special tokens around and after the text
    pieces, tail = streamed(tok.incremental_decoder(skip_special_tokens=skip), ids)
    assert "".join(pieces) + tail == tok.decode(ids, skip_special_tokens=skip)
    assert tail == ""  # valid text: nothing is left once the last token is in
    assert not any("\ufffd" in piece for piece in pieces)  # never half a character
    if not skip:
        assert pieces[0] == "<|im_start|>" and pieces[-2:] == ["<|im_end|>", "<|endoftext|>"]


@pytest.mark.parametrize("skip", [True, False])
def test_incremental_decoder_random_ids(tok: Tokenizer, skip: bool) -> None:
    rng = random.Random(2)
    for _ in range(200):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 12))]
        decoder = tok.incremental_decoder(skip_special_tokens=skip)
        sent = ""
        for i, token_id in enumerate(ids):
            sent += decoder.step(token_id)
            assert tok.decode(ids[: i + 1], skip_special_tokens=skip).startswith(sent), ids
        assert sent + decoder.flush() == tok.decode(ids, skip_special_tokens=skip), ids


def test_incremental_decoder_flushes_a_split_character(tok: Tokenizer) -> None:
    ids = tok.encode("ok 👋")
    cut = ids[:-1]  # the last token completes the emoji
    decoder = tok.incremental_decoder()
    pieces, tail = streamed(decoder, cut)
    assert "".join(pieces) == "ok"
    assert tail and set(tail.strip()) == {"\ufffd"}
    assert "".join(pieces) + tail == tok.decode(cut)
    with pytest.raises(RuntimeError):
        decoder.step(ids[-1])


def test_incremental_decoder_without_decode_stream(tok: Tokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    class Broken:
        def __init__(self, ids: list[int] | None = None, skip_special_tokens: bool = False) -> None:
            pass

        def step(self, tokenizer: object, token_id: int) -> str:
            raise RuntimeError("invalid prefix")

    monkeypatch.setattr("ferrum.tokenizer.incremental.DecodeStream", Broken)
    ids = tok.encode(STREAM_TEXTS[0])
    pieces, tail = streamed(tok.incremental_decoder(), ids)
    assert "".join(pieces) + tail == tok.decode(ids)
    assert not any("\ufffd" in piece for piece in pieces)


# --- incremental decoding after the prompt ------------------------------------------------------

SP_WORDS = "The capital of France is Paris . , ! ? a an the in on to and Hello world café".split()
# The last units are not in the vocab: they are encoded as byte-fallback tokens.
SP_UNITS = [*SP_WORDS, "你", "好", "日本", "👋🏽", "Ω", "ñ", "🇫🇷"]
SP_KINDS = ("metaspace", "metaspace_bytes", "llama")


def sentencepiece_tokenizer_json(path: Path, kind: str) -> None:
    """A small SentencePiece-style tokenizer.json: a Unigram model with byte fallback, "▁" for spaces.

    kind "metaspace": Metaspace pre-tokenizer and decoder (byte tokens decode as their names);
    "metaspace_bytes": the same with a ByteFallback decoder first; "llama": as Llama 2 and Mistral
    tokenizer.json files have it, a Prepend("▁") + Replace normalizer and a
    Replace / ByteFallback / Fuse / Strip decoder, which drops the first char of the text.
    """
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import decoders, models, normalizers, pre_tokenizers

    pieces = [("<unk>", 0.0), ("<s>", 0.0), ("</s>", 0.0)] + [(f"<0x{b:02X}>", 0.0) for b in range(256)]
    pieces += [("▁" + w, -5.0) for w in SP_WORDS] + [(w, -6.0) for w in SP_WORDS] + [("▁", -3.0)]
    pieces += [(c, -10.0) for c in sorted(set("".join(SP_WORDS)))]
    raw = RawTokenizer(models.Unigram(pieces, unk_id=0, byte_fallback=True))
    if kind == "llama":
        raw.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
        raw.decoder = decoders.Sequence(
            [
                decoders.Replace("▁", " "),
                decoders.ByteFallback(),
                decoders.Fuse(),
                decoders.Strip(" ", 1, 0),
            ]
        )
    else:
        raw.pre_tokenizer = pre_tokenizers.Metaspace()
        metaspace = decoders.Metaspace()
        with_bytes = decoders.Sequence([decoders.ByteFallback(), metaspace])
        raw.decoder = with_bytes if kind == "metaspace_bytes" else metaspace
    raw.add_special_tokens(["<unk>", "<s>", "</s>"])
    raw.save(str(path))


@pytest.fixture(scope="module")
def sp(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Tokenizer]:
    tokenizers_by_kind = {}
    for kind in SP_KINDS:
        folder = tmp_path_factory.mktemp(kind)
        sentencepiece_tokenizer_json(folder / "tokenizer.json", kind)
        config = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "add_bos_token": True}
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
        tokenizers_by_kind[kind] = Tokenizer.from_folder(folder)
    return tokenizers_by_kind


def common_prefix_len(a: str, b: str) -> int:
    size = 0
    while size < min(len(a), len(b)) and a[size] == b[size]:
        size += 1
    return size


def check_after_prompt(tok: Tokenizer, prompt: list[int], generated: list[int], skip: bool) -> bool:
    """Stream `generated` after `prompt`; check the text is what `generated` adds to decode(prompt).

    That is decode(P + G)[len(decode(P)):] when decode(P) is a prefix of decode(P + G) (returns True
    then). Otherwise the prompt ends inside a character that G completes or changes: the output is
    decode(P + G) past the part it shares with decode(P). Pieces are never taken back.
    """
    decoder = tok.incremental_decoder(skip_special_tokens=skip, prompt_token_ids=prompt)
    pieces, tail = streamed(decoder, generated)
    before, whole = tok.decode(prompt, skip), tok.decode(prompt + generated, skip)
    applies = whole.startswith(before)
    expected = whole[len(before) :] if applies else whole[common_prefix_len(before, whole) :]
    assert "".join(pieces) + tail == expected, (prompt, generated, skip)
    assert len(decoder.context_ids) <= 24 and tuple(prompt[len(prompt) - len(decoder.context_ids) :]) == (
        decoder.context_ids
    )
    return applies


@pytest.mark.parametrize("kind", SP_KINDS)
def test_first_generated_token_keeps_its_space(sp: dict[str, Tokenizer], kind: str) -> None:
    tok = sp[kind]
    ids = tok.encode("The capital of France is Paris. 你好")
    paris_id = tok.token_to_id("▁Paris")
    assert paris_id is not None
    paris = ids.index(paris_id)
    prompt, generated = ids[:paris], ids[paris:]
    assert prompt[0] == tok.bos_token_id and tok.decode(prompt) == "The capital of France is"
    added = tok.decode(ids)[len(tok.decode(prompt)) :]
    assert added.startswith(" Paris.")
    # Without the prompt "▁Paris" is the first token of the text and its space is dropped (the old bug).
    pieces, tail = streamed(tok.incremental_decoder(), generated)
    assert pieces[0] == "Paris"
    assert "".join(pieces) + tail == tok.decode(generated) == added[1:]
    # After the prompt it keeps it: the text is what the tokens add to the prompt's.
    pieces, tail = streamed(tok.incremental_decoder(prompt_token_ids=prompt), generated)
    assert pieces[:2] == [" Paris", "."]
    assert "".join(pieces) + tail == added
    assert tok.decode(prompt) + "".join(pieces) + tail == tok.decode(ids)
    if kind != "metaspace":  # byte fallback: "你好" is six byte tokens, shown once each character is whole
        assert added == " Paris. 你好" and tail == ""
        assert [piece for piece in pieces if piece] == [" Paris", ".", " ", "你", "好"]


@pytest.mark.parametrize("model", ["demo", "metaspace"])
def test_incremental_decoder_after_random_prompts(
    tok: Tokenizer, sp: dict[str, Tokenizer], model: str
) -> None:
    """Random ids on decoders whose text only grows (byte-level BPE, Metaspace): the invariant holds for
    any prompt and generated ids. Half the ids are special or split a character, so that prompts end
    inside characters and between special tokens."""
    tokenizer = tok if model == "demo" else sp[model]
    vocab = range(tokenizer.vocab_size)
    odd = [i for i in vocab if "\ufffd" in tokenizer.decode([i], skip_special_tokens=False)]
    odd += sorted(tokenizer.special_token_ids)
    rng = random.Random(7)

    def pick() -> int:
        return rng.choice(odd) if rng.random() < 0.5 else rng.randrange(tokenizer.vocab_size)

    applied = 0
    for _ in range(400):
        prompt = [pick() for _ in range(rng.choice([0, 1, 3, 8, 30]))]
        generated = [pick() for _ in range(rng.randint(0, 8))]
        for skip in (True, False):
            applied += check_after_prompt(tokenizer, prompt, generated, skip)
    assert applied > 400  # most cases are under the invariant (not prompts that end mid-character)
    if model == "demo":
        assert applied < 800  # and some are not


@pytest.mark.parametrize("kind", SP_KINDS)
def test_incremental_decoder_after_prompt_split_anywhere(sp: dict[str, Tokenizer], kind: str) -> None:
    """Real text cut at any id, inside byte-fallback characters too; pieces are never half a character.
    (Random ids are no test for byte fallback: a run of byte tokens decodes as a whole, so appending
    an invalid byte turns text already shown into U+FFFD, and no stream can take it back.)"""
    tokenizer = sp[kind]
    rng = random.Random(8)
    for _ in range(300):
        text = "".join(rng.choice(["", " ", "  "]) + rng.choice(SP_UNITS) for _ in range(rng.randint(1, 10)))
        ids = tokenizer.encode(text) + ([2] if rng.random() < 0.3 else [])
        cut = rng.randint(0, len(ids))
        for skip in (True, False):
            check_after_prompt(tokenizer, ids[:cut], ids[cut:], skip)
            pieces, _ = streamed(tokenizer.incremental_decoder(skip, prompt_token_ids=ids[:cut]), ids[cut:])
            assert not any("\ufffd" in piece for piece in pieces), (text, cut)


def test_prompt_ending_inside_a_character(tok: Tokenizer, sp: dict[str, Tokenizer]) -> None:
    ids = tok.encode("ok 👋")
    prompt = ids[:-1]
    assert tok.decode(prompt) == "ok \ufffd"
    pieces, tail = streamed(tok.incremental_decoder(prompt_token_ids=prompt), ids[-1:])
    assert (pieces, tail) == (["👋"], "")  # the emoji the last byte completes, whole
    a = tok.encode("a")
    assert tok.decode(prompt + a) == "ok \ufffda"
    pieces, tail = streamed(tok.incremental_decoder(prompt_token_ids=prompt), a)
    assert "".join(pieces) + tail == "a"  # the prompt's broken character is not output again
    pieces, tail = streamed(tok.incremental_decoder(prompt_token_ids=prompt), [])
    assert (pieces, tail) == ([], "")

    llama = sp["llama"]
    ids = llama.encode("Paris 你")
    assert llama.decode(ids[:-1]) == "Paris \ufffd\ufffd"  # two of the three byte tokens
    for cut in (1, 2, 3):  # the prompt ends after 2, 1 or 0 of its bytes
        pieces, tail = streamed(llama.incremental_decoder(prompt_token_ids=ids[:-cut]), ids[-cut:])
        assert ([piece for piece in pieces if piece], tail) == (["你"], "")
        check_after_prompt(llama, ids[:-cut], ids[-cut:], skip=True)


def test_long_prompt_keeps_only_a_tail(tok: Tokenizer, sp: dict[str, Tokenizer]) -> None:
    prompt = tok.encode("The capital of France is Paris. " * 200 + "And of Italy it is")
    generated = tok.encode(" Rome.", add_special_tokens=False)
    decoder = tok.incremental_decoder(prompt_token_ids=prompt)
    assert decoder.context_ids == tuple(prompt[-6:])
    assert "".join(decoder.step(token_id) for token_id in generated) + decoder.flush() == " Rome."

    # Six ids would start inside a byte-fallback character ("你好Ω": 3 + 3 + 2 byte tokens); the
    # context grows to start on a whole one, or "日", continuing the same run of bytes, would come out
    # as U+FFFD.
    llama = sp["llama"]
    ids = llama.encode("Paris 你好Ω日")
    prompt, generated = ids[:-3], ids[-3:]
    assert llama.decode(prompt[-6:]).startswith("\ufffd")
    decoder = llama.incremental_decoder(prompt_token_ids=prompt)
    assert decoder.context_ids == tuple(prompt[-8:])
    assert "".join(decoder.step(token_id) for token_id in generated) + decoder.flush() == "日"
    assert check_after_prompt(llama, prompt, generated, skip=True)


def test_incremental_decoder_after_prompt_without_decode_stream(
    tok: Tokenizer, sp: dict[str, Tokenizer], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The decode-everything fallback and a DecodeStream without `ids` (tokenizers < 0.22) agree."""
    from tokenizers.decoders import DecodeStream

    def without_ids(skip_special_tokens: bool = False, **kwargs: Any) -> DecodeStream:
        if kwargs:
            raise TypeError("DecodeStream() got an unexpected keyword argument")
        return DecodeStream(skip_special_tokens=skip_special_tokens)

    class Broken:
        def __init__(self, ids: list[int] | None = None, skip_special_tokens: bool = False) -> None:
            pass

        def step(self, tokenizer: object, token_id: int) -> str:
            raise RuntimeError("invalid prefix")

    rng = random.Random(9)
    for stand_in in (without_ids, Broken):
        monkeypatch.setattr("ferrum.tokenizer.incremental.DecodeStream", stand_in)
        llama_texts = ["The capital of France is Paris. 你好 👋🏽 café"]
        for tokenizer, texts in ((tok, STREAM_TEXTS), (sp["llama"], llama_texts)):
            for text in texts:
                ids = tokenizer.encode(text)
                for cut in sorted({0, 1, len(ids) // 2, len(ids) - 1, *rng.sample(range(len(ids)), 3)}):
                    for skip in (True, False):
                        check_after_prompt(tokenizer, ids[:cut], ids[cut:], skip)
        ids = sp["metaspace"].encode("The capital of France is Paris.")
        pieces, _ = streamed(sp["metaspace"].incremental_decoder(prompt_token_ids=ids[:6]), ids[6:])
        assert pieces[0] == " Paris"


# --- clean_up_tokenization_spaces (a non-BPE tokenizer) ------------------------------------------


def test_cleanup_stream_matches_whole_text() -> None:
    rng = random.Random(3)
    alphabet = [" ", " ", ".", "?", "!", ",", "'", "n", "t", "m", "s", "v", "e", "r", "x"]
    for _ in range(3000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 16)))
        stream, out, rest = CleanupStream(), "", text
        while rest:
            size = rng.randint(1, 4)
            out += stream.push(rest[:size])
            rest = rest[size:]
        assert out + stream.flush() == clean_up_tokenization(text), repr(text)


def test_word_level_tokenizer_with_cleanup(tmp_path: Path) -> None:
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import models, pre_tokenizers

    words = ["[UNK]", "hello", "world", "do", "n't", "i", "'m", "'", "s", ".", ",", "?", "!", "it"]
    raw = RawTokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    raw.save(str(tmp_path / "tokenizer.json"))
    config = {"unk_token": "[UNK]", "clean_up_tokenization_spaces": True}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    tok = Tokenizer.from_folder(tmp_path)
    rng = random.Random(4)
    for _ in range(300):
        ids = [rng.randrange(len(words)) for _ in range(rng.randint(1, 10))]
        expected = hf.decode(ids, skip_special_tokens=True)
        assert tok.decode(ids) == expected, ids
        pieces, tail = streamed(tok.incremental_decoder(), ids)
        assert "".join(pieces) + tail == expected, ids
    assert tok.decode([3, 4, 9]) == "don't."
