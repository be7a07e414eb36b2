"""Who may call the server: API keys on every route but the open ones (wrong, missing and right keys,
from flags, a key file and FERRUM_API_KEY), CORS, TLS, a proxy's root path; the small routes
(/version, /v1/backends, /tokenize, /detokenize) on the demo model; the request log line (JSON, without
the prompt; a dropped stream's with the tokens it sent)."""

from __future__ import annotations

import json
import ssl
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from ferrum.server.metrics import METRIC_NAMES
from tests.live_server import MODEL_DIR, ServerProcess, server_process

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not (MODEL_DIR / "config.json").is_file(), reason="demo model not prepared"),
]

FLAG_KEY, FILE_KEY, ENV_KEY = "sk-flag-0123456789", "sk-file-abcdef", "sk-env-xyz"
OPEN = {"/health", "/ready", "/version", "/docs", "/redoc", "/openapi.json", "/metrics"}
# one well-formed call per route
CALLS: dict[str, tuple[str, dict[str, Any] | None]] = {
    "/health": ("GET", None),
    "/ready": ("GET", None),
    "/version": ("GET", None),
    "/docs": ("GET", None),
    "/redoc": ("GET", None),
    "/openapi.json": ("GET", None),
    "/metrics": ("GET", None),
    "/v1/models": ("GET", None),
    "/v1/models/{model_id}": ("GET", None),
    "/v1/backends": ("GET", None),
    "/v1/completions": ("POST", {"prompt": "Hi", "max_tokens": 2}),
    "/v1/chat/completions": ("POST", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}),
    "/v1/responses": ("POST", {"input": "Hi", "max_output_tokens": 2}),
    "/tokenize": ("POST", {"prompt": "Hello world"}),
    "/detokenize": ("POST", {"tokens": [1, 2, 3]}),
}


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    keys = tmp_path_factory.mktemp("keys") / "keys.txt"
    keys.write_text(f"# one key per line\n{FILE_KEY}\n")
    with server_process("--model", str(MODEL_DIR), "--backend", "cpu", "--max-model-len", "256",
                        "--api-key", FLAG_KEY, "--api-key-file", str(keys), "--cors-origin", "https://app.example",
                        "--log-format", "json", env={"FERRUM_API_KEY": ENV_KEY}) as server:
        yield server


def call(base: str, path: str, headers: dict[str, str] | None = None) -> httpx.Response:
    method, body = CALLS[path]
    url = base + path.replace("{model_id}", "SmolLM2-135M-Instruct")
    return httpx.request(method, url, json=body, headers=headers or {}, timeout=60)


def test_every_route_is_covered(keyed: ServerProcess) -> None:
    routes = set(httpx.get(f"{keyed.url}/openapi.json").json()["paths"]) | {"/docs", "/redoc", "/openapi.json"}
    assert routes == set(CALLS)


@pytest.mark.parametrize("path", sorted(CALLS))
def test_missing_wrong_and_right_keys(keyed: ServerProcess, path: str) -> None:
    missing = call(keyed.url, path)
    wrong = call(keyed.url, path, {"Authorization": f"Bearer {FLAG_KEY}x"})
    not_bearer = call(keyed.url, path, {"Authorization": FLAG_KEY})
    if path in OPEN:
        assert missing.status_code == 200 and wrong.status_code == 200, (missing.text, wrong.text)
        return
    for refused in (missing, wrong, not_bearer):
        assert refused.status_code == 401, refused.text
        error = refused.json()["error"]
        assert error["code"] == "invalid_api_key" and refused.headers["www-authenticate"] == "Bearer"
        assert FLAG_KEY not in refused.text
    assert "Missing API key" in missing.json()["error"]["message"]
    for key in (FLAG_KEY, FILE_KEY):  # a flag's and the key file's: each accepted
        ok = call(keyed.url, path, {"Authorization": f"Bearer {key}"})
        assert ok.status_code == 200, (key, ok.text)
    # FERRUM_API_KEY is set too, but --api-key wins over the environment (the key file adds to either)
    assert call(keyed.url, path, {"Authorization": f"Bearer {ENV_KEY}"}).status_code == 401


def test_keys_never_reach_the_log(keyed: ServerProcess) -> None:
    call(keyed.url, "/v1/completions", {"Authorization": f"Bearer {FLAG_KEY}"})
    call(keyed.url, "/v1/completions", {"Authorization": f"Bearer {FLAG_KEY}-wrong"})
    log = keyed.log()
    assert '"logger": "ferrum.request"' in log  # JSON lines, the request line among them
    for key in (FLAG_KEY, FILE_KEY, ENV_KEY):
        assert key not in log


def test_cors_is_answered_for_the_configured_origin_only(keyed: ServerProcess) -> None:
    preflight = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization, content-type"}
    ok = httpx.options(f"{keyed.url}/v1/chat/completions", headers=preflight)
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == "https://app.example"
    other = httpx.options(f"{keyed.url}/v1/chat/completions", headers={**preflight, "Origin": "https://evil.example"})
    assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
    simple = httpx.get(f"{keyed.url}/health", headers={"Origin": "https://app.example"})
    assert simple.headers["access-control-allow-origin"] == "https://app.example"


def test_small_routes(keyed: ServerProcess) -> None:
    auth = {"Authorization": f"Bearer {FLAG_KEY}"}
    version = httpx.get(f"{keyed.url}/version").json()
    assert set(version) == {"version"} and version["version"]
    backends = httpx.get(f"{keyed.url}/v1/backends", headers=auth).json()["data"]
    cpu = next(b for b in backends if b["name"] == "cpu")
    assert cpu["selected"] and cpu["kind"] == "cpu" and "float32" in cpu["capabilities"]["dtypes"]
    assert cpu["status"]["initialized"] and cpu["capabilities"]["total_memory_bytes"] > 0
    tokens = httpx.post(f"{keyed.url}/tokenize", json={"prompt": "Hello world"}, headers=auth).json()
    assert tokens["count"] == len(tokens["tokens"]) > 0 and tokens["max_model_len"] == 256
    text = httpx.post(f"{keyed.url}/detokenize", json={"tokens": tokens["tokens"]}, headers=auth).json()
    assert text == {"prompt": "Hello world"}
    chat = httpx.post(f"{keyed.url}/tokenize", headers=auth,
                      json={"messages": [{"role": "user", "content": "Hello world"}]}).json()
    assert chat["count"] > tokens["count"]  # the template adds its markers
    bad = httpx.post(f"{keyed.url}/detokenize", json={"tokens": [10**9]}, headers=auth)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    both = httpx.post(f"{keyed.url}/tokenize", json={"prompt": "a", "messages": []}, headers=auth)
    assert both.status_code == 400


def test_environment_key_and_metrics_behind_it() -> None:
    with server_process("--model", str(MODEL_DIR), "--backend", "cpu", "--max-model-len", "128",
                        "--metrics-require-key", "--root-path", "/ferrum", env={"FERRUM_API_KEY": ENV_KEY}) as server:
        assert httpx.get(f"{server.url}/v1/models").status_code == 401
        assert httpx.get(f"{server.url}/v1/models", headers={"Authorization": f"Bearer {ENV_KEY}"}).status_code == 200
        assert httpx.get(f"{server.url}/metrics").status_code == 401
        ok = httpx.get(f"{server.url}/metrics", headers={"Authorization": f"Bearer {ENV_KEY}"})
        assert ok.status_code == 200 and "ferrum_num_requests_running" in ok.text
        # behind a proxy that keeps the prefix: routes answer under it too, and the docs name it
        assert httpx.get(f"{server.url}/ferrum/ready").status_code == 200
        spec = httpx.get(f"{server.url}/ferrum/openapi.json").json()
        assert spec["servers"] == [{"url": "/ferrum"}]


def test_tls(tmp_path: Path) -> None:
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                    str(cert), "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)
    trust = ssl.create_default_context(cafile=str(cert))
    with server_process("--model", str(MODEL_DIR), "--backend", "cpu", "--max-model-len", "128",
                        "--ssl-keyfile", str(key), "--ssl-certfile", str(cert), ready=False, scheme="https") as server:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"{server.url}/ready", verify=trust).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert server.proc.poll() is None and time.monotonic() < deadline, server.log()[-3000:]
            time.sleep(0.3)
        reply = httpx.post(f"{server.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, verify=trust)
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 2
        with pytest.raises(httpx.HTTPError):  # plain HTTP to the TLS port is no answer
            httpx.get(server.url.replace("https", "http") + "/health", timeout=5)


def test_one_json_line_per_request_without_the_prompt(keyed: ServerProcess) -> None:
    body = {"prompt": "A secret prompt 7731", "max_tokens": 3, "temperature": 0}
    r = httpx.post(f"{keyed.url}/v1/completions", json=body, headers={"Authorization": f"Bearer {FLAG_KEY}"},
                   timeout=60)
    assert r.status_code == 200
    lines = [json.loads(line) for line in keyed.log().splitlines() if line.startswith("{")]
    mine = [line for line in lines if line.get("logger") == "ferrum.request" and line.get("id") == r.json()["id"]]
    assert len(mine) == 1, lines[-5:]
    line = mine[0]
    assert line["status"] == 200 and line["outcome"] == "ok" and line["route"] == "completions"
    assert line["prompt_tokens"] == r.json()["usage"]["prompt_tokens"] and line["completion_tokens"] == 3
    assert 0 <= line["queue_s"] <= line["ttft_s"] <= line["duration_s"]
    assert "prompt" not in line and "secret prompt 7731" not in keyed.log()


def request_line(server: ServerProcess, request_id: str, timeout_s: float = 10) -> dict[str, Any]:
    """The request log line of `request_id`, waited for (a stream's is written once it has closed)."""
    deadline = time.monotonic() + timeout_s
    while True:
        lines = [json.loads(line) for line in server.log().splitlines() if line.startswith("{")]
        mine = [line for line in lines if line.get("logger") == "ferrum.request" and line.get("id") == request_id]
        if mine or time.monotonic() > deadline:
            assert len(mine) == 1, lines[-5:]
            return mine[0]
        time.sleep(0.1)


def test_a_dropped_stream_is_logged_with_the_tokens_it_sent(keyed: ServerProcess) -> None:
    prompt = [1, 504, 3458, 314, 216]  # token ids: prompt_tokens is known
    body = {"prompt": prompt, "max_tokens": 200, "ignore_eos": True, "stream": True, "logprobs": 0}
    received, request_id = 0, None
    with httpx.stream("POST", f"{keyed.url}/v1/completions", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {FLAG_KEY}"}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                request_id = chunk["id"]
                received += len(chunk["choices"][0]["logprobs"]["tokens"])
                if received >= 24:
                    break  # the client goes away mid-stream
    assert request_id is not None
    logged = request_line(keyed, request_id)
    assert logged["outcome"] == "disconnected" and logged["prompt_tokens"] == len(prompt)
    assert received <= logged["completion_tokens"] <= received + 16, (received, logged)  # and those in flight


def test_metrics_expose_every_family_after_a_request(keyed: ServerProcess) -> None:
    auth = {"Authorization": f"Bearer {FLAG_KEY}"}
    assert httpx.post(f"{keyed.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, headers=auth,
                      timeout=60).status_code == 200
    text = httpx.get(f"{keyed.url}/metrics", timeout=10).text
    exposed = {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")}
    assert METRIC_NAMES <= exposed, METRIC_NAMES - exposed
