"""The engine in a process of its own (ProcessEngineClient), against the in-process engine.

Real engine processes on the demo model in float32 (exact whatever the batch's shape, so outputs
compare token for token). One engine process is shared by the module's tests; the tests that kill
or stop their process, or fail its start, start their own.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import signal
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest
import pytest_asyncio

from ferrum.config.loader import ConfigError, ServerConfig, load_config
from ferrum.engine.async_engine import AsyncEngine, EngineClient, EngineDeadError
from ferrum.engine.builder import EngineSpec
from ferrum.engine.config import EngineConfig
from ferrum.engine.llm_engine import LLMEngine
from ferrum.engine.outputs import RequestOutput, TokenLogprob, merge_outputs
from ferrum.engine.process_client import ProcessEngineClient
from ferrum.engine.sampling_params import SamplingParams
from ferrum.engine.warm_start import discard, prestart, take
from ferrum.server.launch import build_engine, engine_in_own_process
from ferrum.weights.errors import CorruptWeightsError, SourceNotFoundError
from ferrum.weights.locations.model_files import ModelFiles
from ferrum.weights.spec.sources import File
from tests.live_server import MODEL_DIR, live_server

pytestmark = [
    pytest.mark.slow,
    pytest.mark.usefixtures("one_thread"),  # see tests/conftest.py
    pytest.mark.skipif(not (MODEL_DIR / "model.safetensors").is_file(), reason="demo model not present"),
]
on_module_loop = pytest.mark.asyncio(loop_scope="module")  # the shared clients live on this loop

# what the conftest `engine` fixture runs in-process
CONFIG = EngineSpec(
    EngineConfig(dtype="float32", kv_cache_memory_gb=0.1, max_model_len=1024),
    backend="cpu",
    device="cpu",
    files=ModelFiles(File(MODEL_DIR), MODEL_DIR, File(MODEL_DIR / "model.safetensors"), complete=True),
)
PROMPTS = [
    "The capital of France is",
    "Once upon a time",
    "def fibonacci(n):",
    "The quick brown fox",
    "In 1492, Columbus",
    "Name three primary colors.",
]


@pytest.fixture(scope="module")
def one_thread_children() -> Iterator[None]:
    """Engine processes started meanwhile use one intra-op thread (see conftest's one_thread)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OMP_NUM_THREADS", "1")
        yield


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def process_client(one_thread_children: None) -> AsyncIterator[ProcessEngineClient]:
    client = await ProcessEngineClient.launch(CONFIG)
    await client.start()
    yield client
    await client.shutdown()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def thread_client(engine: LLMEngine) -> AsyncIterator[AsyncEngine]:
    client = AsyncEngine(engine)
    await client.start()
    yield client
    await client.shutdown()


@pytest.fixture(params=["process", "thread"])
def client(request: pytest.FixtureRequest) -> EngineClient:
    name = "process_client" if request.param == "process" else "thread_client"
    fixture: EngineClient = request.getfixturevalue(name)
    return fixture


async def _collect(
    client: EngineClient, rid: str, prompt: list[int], params: SamplingParams
) -> list[RequestOutput]:
    return [out async for out in client.generate(rid, prompt, params)]


async def _wait_idle(client: EngineClient, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s = client.stats()
        if (s.num_running, s.num_waiting, s.kv_blocks_used) == (0, 0, 0):
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"engine not idle after {timeout}s: {client.stats()}")


def _tokens(outputs: list[RequestOutput]) -> list[int]:
    return [t for out in outputs for t in out.new_token_ids]


# -- merging deltas -----------------------------------------------------------------------------------


def test_merge_outputs_concatenates_and_keeps_the_last_finish() -> None:
    lp = [TokenLogprob(i, f"t{i}", -0.5, ()) for i in range(3)]
    parts = [
        RequestOutput("r", "Hel", (5,), (lp[0],), False, None, 4, 1),
        RequestOutput("r", "", (6,), (lp[1],), False, None, 4, 2),  # text held back (a partial character)
        RequestOutput("r", "lo!", (7,), (lp[2],), True, "stop", 4, 3),
    ]
    merged = merge_outputs(parts)
    assert merged == RequestOutput("r", "Hello!", (5, 6, 7), tuple(lp), True, "stop", 4, 3)
    assert merge_outputs(parts[:1]) is parts[0]
    no_logprobs = [RequestOutput("r", "a", (1,), None, False, None, 2, 1)] * 2
    assert merge_outputs(no_logprobs).new_logprobs is None
    with pytest.raises(ValueError):
        merge_outputs([])


# -- the setting --------------------------------------------------------------------------------------


def test_engine_process_setting(tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("model: m\nengine: {engine_process: true, max_num_seqs: 4}\n")
    config = load_config(cfg, {})
    assert config.engine_process == "on" and config.engine["max_num_seqs"] == 4
    assert config.engine["quantization"]["method"] == "auto"  # the server's default
    assert load_config(cfg, {"engine_process": "off"}).engine_process == "off"  # the flag wins
    assert load_config(None, {"model": "m"}).engine_process == "auto"
    cfg.write_text("model: m\nengine: {engine_process: sometimes}\n")
    with pytest.raises(ConfigError, match="engine_process must be auto, true or false"):
        load_config(cfg, {})
    cfg.write_text("model: m\nengine_process: true\n")  # it belongs under engine:
    with pytest.raises(ConfigError, match="unknown config key"):
        load_config(cfg, {})
    assert [engine_in_own_process("auto", kind) for kind in ("cpu", "cuda", "mps")] == [True, True, True]
    assert engine_in_own_process("on", "cpu") and not engine_in_own_process("off", "cuda")


# -- the shared engine process ------------------------------------------------------------------------


@on_module_loop
async def test_same_greedy_tokens_as_in_process(
    engine: LLMEngine, process_client: ProcessEngineClient
) -> None:
    tok = process_client.tokenizer
    prompts = [tok.encode(p) for p in PROMPTS]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    expected = engine.generate(prompts, params)
    assert process_client.max_model_len == engine.max_model_len == 1024
    finished_before = process_client.stats().requests_finished
    results = await asyncio.wait_for(
        asyncio.gather(*(_collect(process_client, f"same-{i}", p, params) for i, p in enumerate(prompts))),
        120,
    )
    assert [_tokens(r) for r in results] == expected
    assert all(r[-1].finished and r[-1].finish_reason == "length" for r in results)
    assert all(r[-1].request_id == f"same-{i}" for i, r in enumerate(results))
    texts = ["".join(o.new_text for o in r) for r in results]
    assert texts == [tok.decode(e) for e in expected]
    await _wait_idle(process_client)
    assert process_client.stats().requests_finished == finished_before + len(prompts)


@on_module_loop
async def test_abort_and_close_free_the_request(client: EngineClient) -> None:
    prompt = client.tokenizer.encode(PROMPTS[1])
    long = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    outs: list[RequestOutput] = []
    async for out in client.generate("abort-me", prompt, long):
        outs.append(out)
        if len(outs) == 2:
            await client.abort("abort-me")
    assert outs[-1].finished and outs[-1].finish_reason == "abort" and outs[-1].num_output_tokens < 200
    await _wait_idle(client)

    # closing the stream aborts too, and the id is free again at once
    gen = client.generate("close-me", prompt, long)
    await anext(gen)
    with pytest.raises(ValueError, match="already in use"):
        await anext(client.generate("close-me", prompt, long))
    await gen.aclose()  # type: ignore[attr-defined]
    short = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    again = await asyncio.wait_for(_collect(client, "close-me", prompt, short), 60)
    assert len(_tokens(again)) == 4 and again[-1].finish_reason == "length"  # none of the old request's
    await _wait_idle(client)


@on_module_loop
async def test_slow_reader_gets_merged_deltas(client: EngineClient) -> None:
    prompt = client.tokenizer.encode(PROMPTS[0])
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=1)
    # the reference through the same client, read at once (not engine.generate: the thread
    # client's loop thread drives that engine, and two threads must not step it at once)
    expected = _tokens(await asyncio.wait_for(_collect(client, "fast", prompt, params), 60))
    assert len(expected) == 24
    outs: list[RequestOutput] = []
    async for out in client.generate("slow", prompt, params):
        outs.append(out)
        await asyncio.sleep(0.25)  # a few engine steps pass before the next read
    assert _tokens(outs) == expected
    assert "".join(o.new_text for o in outs) == client.tokenizer.decode(expected)
    assert [lp.token_id for o in outs for lp in o.new_logprobs or ()] == expected
    assert len(outs) < len(expected) and max(len(o.new_token_ids) for o in outs) > 1  # merged
    assert outs[-1].finished and outs[-1].num_output_tokens == 24
    assert [o.num_output_tokens for o in outs] == sorted({o.num_output_tokens for o in outs})
    await _wait_idle(client)


@on_module_loop
async def test_prompt_too_long_is_checked_in_the_server_process(process_client: ProcessEngineClient) -> None:
    from ferrum.engine.limits import PromptTooLongError

    with pytest.raises(PromptTooLongError, match="maximum context length is 1024"):
        await anext(process_client.generate("long", [1] * 1000, SamplingParams(max_tokens=25)))
    assert process_client.is_ready()


# -- engine processes of their own ---------------------------------------------------------------------


@on_module_loop
async def test_killed_process_fails_waiting_requests(one_thread_children: None) -> None:
    client = await ProcessEngineClient.launch(CONFIG)
    await client.start()
    assert client.is_ready() and client.pid is not None
    prompt = client.tokenizer.encode(PROMPTS[2])
    long = SamplingParams(max_tokens=500, temperature=0.0, ignore_eos=True)
    streams = [client.generate(f"k-{i}", prompt, long) for i in range(3)]
    for stream in streams:
        await anext(stream)
    os.kill(client.pid, signal.SIGKILL)
    for stream in streams:
        with pytest.raises(EngineDeadError, match="exited unexpectedly"):
            async for _ in stream:
                pass
    assert not client.is_ready()
    with pytest.raises(EngineDeadError):
        await anext(client.generate("after", prompt, long))
    await asyncio.wait_for(client.shutdown(), 30)
    assert client.exitcode == -signal.SIGKILL


@on_module_loop
async def test_shutdown_stops_the_process_cleanly(one_thread_children: None) -> None:
    client = await ProcessEngineClient.launch(CONFIG)
    await client.start()
    prompt = client.tokenizer.encode(PROMPTS[3])
    stream = client.generate("running", prompt, SamplingParams(max_tokens=500, ignore_eos=True))
    await anext(stream)
    pid = client.pid
    await asyncio.wait_for(client.shutdown(), 30)
    assert client.exitcode == 0  # it stopped on StopLoop, not by a signal
    assert pid not in [p.pid for p in multiprocessing.active_children()]
    with pytest.raises(EngineDeadError, match="shut down"):
        async for _ in stream:
            pass
    assert not client.is_ready()
    await client.shutdown()  # twice is fine


@on_module_loop
async def test_prestarted_engine_process_is_the_one_launched(engine: LLMEngine, one_thread_children: None) -> None:
    """`ferrum serve` spawns its engine process before it imports torch (warm_start.prestart), so that both
    processes import at once; the launch then sends that process its spec instead of spawning another."""
    before = {p.pid for p in multiprocessing.active_children()}
    prestart()
    started = [p for p in multiprocessing.active_children() if p.pid not in before]
    assert [p.name for p in started] == ["ferrum-engine"]
    client = await ProcessEngineClient.launch(CONFIG)
    try:
        assert client.pid == started[0].pid
        await client.start()
        prompt = client.tokenizer.encode(PROMPTS[0])
        params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        result = await asyncio.wait_for(_collect(client, "prestarted", prompt, params), 60)
        assert _tokens(result) == engine.generate([prompt], params)[0]
    finally:
        await asyncio.wait_for(client.shutdown(), 30)
    assert client.exitcode == 0


def test_prestarted_engine_process_left_unused_exits(one_thread_children: None) -> None:
    """An engine on the server's thread (engine_process: off in a config file) leaves the prestarted
    process to no launch: discarding it closes its pipe and it exits by itself, importing nothing more."""
    before = {p.pid for p in multiprocessing.active_children()}
    prestart()
    (started,) = [p for p in multiprocessing.active_children() if p.pid not in before]
    discard()
    started.join(60)
    assert started.exitcode == 0
    assert take() is None  # taken once: a later launch spawns its own


def _bad_model_folder(folder: Path, weights: bytes | None) -> Path:
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (folder / name).write_bytes((MODEL_DIR / name).read_bytes())
    if weights is not None:
        (folder / "model.safetensors").write_bytes(weights)
    return folder


@on_module_loop
@pytest.mark.parametrize(
    "weights, error",
    [(None, SourceNotFoundError), (b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all", CorruptWeightsError)],
    ids=["missing-weights", "corrupt-weights"],
)
async def test_unloadable_model_gives_the_same_startup_error(
    tmp_path: Path, one_thread_children: None, weights: bytes | None, error: type[Exception]
) -> None:
    folder = _bad_model_folder(tmp_path, weights)
    before = multiprocessing.active_children()
    messages = {}
    for mode in ("off", "on"):
        config = ServerConfig(
            model=str(folder), backend="cpu", engine={"dtype": "float32"}, engine_process=mode
        )
        with pytest.raises(error) as info:
            await build_engine(config)
        messages[mode] = str(info.value)
    assert messages["on"] == messages["off"]
    assert str(folder) in messages["on"] and "safetensors" in messages["on"]
    assert multiprocessing.active_children() == before  # the failed engine process is gone


# -- the server ---------------------------------------------------------------------------------------


def _children(pid: int) -> list[str]:
    """The command lines of `pid`'s child processes."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            if ppid == pid:
                found.append((stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode())
        except (OSError, IndexError, ValueError):
            continue
    return found


def _server_pid(port: int) -> int:
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            args = cmdline.read_bytes().split(b"\0")
        except OSError:
            continue
        if b"ferrum.cli" in args and str(port).encode() in args:
            return int(cmdline.parent.name)
    raise AssertionError(f"no ferrum server on port {port}")


def test_live_server_with_engine_process(one_thread_children: None) -> None:
    args = ("--model", str(MODEL_DIR), "--backend", "cpu", "--dtype", "float32", "--engine-process", "on")
    with live_server(*args) as url:
        children = _children(_server_pid(int(url.rsplit(":", 1)[1])))
        assert any("multiprocessing.spawn" in c for c in children), children
        body = {
            "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 24,
            "temperature": 0,
        }
        r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        assert "Paris" in r.json()["choices"][0]["message"]["content"]
        with httpx.stream(
            "POST", f"{url}/v1/chat/completions", json={**body, "stream": True}, timeout=120
        ) as s:
            events = [line for line in s.iter_lines() if line.startswith("data: {")]
        streamed = "".join(json.loads(e[6:])["choices"][0]["delta"].get("content") or "" for e in events)
        assert streamed == r.json()["choices"][0]["message"]["content"]
        assert httpx.get(f"{url}/health").json() == {"status": "ok", "phase": "ready"}
        metrics = httpx.get(f"{url}/metrics").text
        assert "ferrum_requests_finished" in metrics and "ferrum_kv_blocks_total" in metrics
