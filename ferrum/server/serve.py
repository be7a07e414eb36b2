"""`ferrum serve`: HTTP first, then the model, then serving until a signal, then a drain.

1. The listening socket is bound first (a port in use is an error before anything loads), the
   backend chosen, and uvicorn started on the socket: `/health` answers 200 from here on and
   `/ready` 503 with the start-up phase (fetching, loading with progress, warming).
2. The engine is built (ferrum.server.launch.build_engine) and attached; `/ready` turns 200. A
   failed start logs its reason, keeps `/ready` saying it for `failed_start_linger_s`, and then
   raises (the command exits non-zero).
3. On SIGTERM or SIGINT (first one): `/ready` turns 503, new requests get 503, in-flight requests
   run on for up to `shutdown_timeout_s`, the rest are ended (their streams finish with
   finish_reason "abort" and an error event saying the server is shutting down), then HTTP stops,
   the engine and the device are freed, and `serve` returns (exit status 0). A second signal
   skips the wait. An engine process ignores the terminal's SIGINT: the server stops it.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
import ssl
import time
from collections.abc import Callable
from types import FrameType

import uvicorn

from ferrum.config.loader import ServerConfig
from ferrum.engine.async_engine import EngineClient
from ferrum.engine.heap import freeze_startup_heap
from ferrum.server.api import Server, backend_card, create_app
from ferrum.server.launch import StartupError, build_engine, check_local_folder, choose_backend
from ferrum.server.state import ServerState

log = logging.getLogger("ferrum")


class EngineStopped(RuntimeError):
    """The engine stopped by itself while serving (its process or a tensor-parallel rank died, a
    step failed): `ferrum serve` exits with status 1 rather than answer 503 for ever."""


class _Http(uvicorn.Server):
    """uvicorn, whose SIGINT/SIGTERM start Ferrum's drain instead of its own shutdown (and are not
    raised again at exit, so that a drained server exits 0)."""

    def __init__(self, config: uvicorn.Config, on_signal: asyncio.Event) -> None:
        super().__init__(config)
        self._on_signal = on_signal
        self._signals = 0
        self.on_second_signal: Callable[[], None] = lambda: None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self._signals += 1
        if self._signals == 1:
            log.info("signal %d: draining (a second signal stops at once)", sig)
            self._on_signal.set()
        else:
            log.warning("signal %d again: ending every request now", sig)
            self.on_second_signal()


def bind_socket(host: str, port: int) -> socket.socket:
    """The listening socket, bound now (StartupError naming the address when it is taken)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP named, not left 0: asyncio turns Nagle's algorithm off (TCP_NODELAY) only on connections
    # whose socket says TCP. With proto 0 a kept-alive connection's small SSE writes waited for the
    # client's delayed ACK: chunks held 40-50 ms and arriving together (first token at 47 ms where a fresh
    # connection saw it at 3 ms). The option is set here too, where accepted connections inherit it.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise StartupError(f"cannot listen on {host}:{port}: the address is already in use") from None
        raise StartupError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    sock.listen(2048)
    sock.setblocking(False)
    return sock


def _check_tls(config: ServerConfig) -> None:
    api = config.server.api
    if api.ssl_certfile is None or api.ssl_keyfile is None:
        return
    try:
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(api.ssl_certfile, api.ssl_keyfile)
    except (OSError, ssl.SSLError) as exc:
        raise StartupError(f"cannot use TLS files {api.ssl_certfile} and {api.ssl_keyfile}: {exc}") from None


async def serve(config: ServerConfig, stop: asyncio.Event | None = None) -> None:
    """Serves until a signal (or `stop` is set: `ferrum run` serves from a thread, where signals do not
    arrive) and a drain; raises what stopped a failed start (after the linger)."""
    settings = config.server
    check_local_folder(config)  # a local folder that is no model fails before anything starts
    _check_tls(config)
    sock = bind_socket(config.host, config.port)
    started = time.perf_counter()
    state = ServerState()
    backend, device_name = await choose_backend(config)
    registry_backends = [backend]

    def backends() -> list[dict[str, object]]:
        return [backend_card(b, b is backend) for b in registry_backends]

    app = create_app(None, config.model_name, settings, state, backends, config.engine_config().quantization)
    server: Server = app.state.server
    stop = stop or asyncio.Event()
    api = settings.api
    http = _Http(
        uvicorn.Config(
            app, log_config=None, access_log=False, log_level=settings.logging.level.lower(),
            ssl_keyfile=str(api.ssl_keyfile) if api.ssl_keyfile else None,
            ssl_certfile=str(api.ssl_certfile) if api.ssl_certfile else None,
            timeout_graceful_shutdown=5, timeout_keep_alive=5,
        ),
        stop,
    )

    def end_every_request() -> None:
        for ticket in list(server.admission.tickets):
            ticket.end("shutdown")

    http.on_second_signal = end_every_request
    http_task = asyncio.create_task(http.serve(sockets=[sock]), name="http")
    scheme = "https" if api.ssl_certfile else "http"
    log.info("listening on %s://%s:%d%s (GET /ready says when the model is loaded)", scheme, config.host,
             config.port, api.root_path)
    engine: EngineClient | None = None
    stopping = asyncio.create_task(stop.wait())
    try:
        load = asyncio.create_task(build_engine(config, state.progress, (backend, device_name)), name="load")
        await asyncio.wait({load, stopping, http_task}, return_when=asyncio.FIRST_COMPLETED)
        if not load.done():  # a signal (or HTTP failed) during the start: give up on it
            load.cancel()
            await asyncio.gather(load, return_exceptions=True)
            _reap(load)
            return
        try:
            engine, backend = load.result()
        except Exception as exc:
            await _linger_failed(state, exc, settings.lifecycle.failed_start_linger_s, stop)
            raise
        await engine.start()
        server.attach(engine)
        state.set_ready()
        freeze_startup_heap()
        log.info("model %s ready in %.2fs; serving on %s://%s:%d%s", config.model_name,
                 time.perf_counter() - started, scheme, config.host, config.port, api.root_path)
        dead = asyncio.create_task(engine.wait_dead(), name="engine-dead")
        await asyncio.wait({stopping, http_task, dead}, return_when=asyncio.FIRST_COMPLETED)
        if dead.done():  # every request has failed with it; a supervisor restarts the server
            state.fail(str(dead.result()))
            log.critical("the engine stopped: %s; the server exits", dead.result())
            raise EngineStopped(f"the engine stopped: {dead.result()}")
        dead.cancel()
        await _drain(state, server, settings.lifecycle.shutdown_timeout_s)
    finally:
        stopping.cancel()
        http.should_exit = True
        await asyncio.gather(http_task, return_exceptions=True)
        if engine is not None:
            await engine.shutdown()  # stops stepping first: then the backend may free the device
        await backend.shutdown()
        state.stopped()
        sock.close()
        log.info("stopped")


async def _linger_failed(state: ServerState, exc: BaseException, linger_s: float, stop: asyncio.Event) -> None:
    reason = f"{type(exc).__name__}: {exc}"
    state.fail(reason)
    log.error("the model could not be loaded: %s", reason)
    if linger_s > 0:
        try:
            await asyncio.wait_for(stop.wait(), linger_s)
        except TimeoutError:
            pass


async def _drain(state: ServerState, server: Server, timeout_s: float) -> None:
    state.begin_drain()
    server.admission.close("shutting_down")
    waiting = server.admission.in_flight
    log.info("draining: %d request(s) in flight, up to %.0f s", waiting, timeout_s)
    ended = await server.admission.drain(timeout_s)
    log.info("drained: %d finished, %d ended by the shutdown", max(waiting - ended, 0), ended)


def _reap(task: asyncio.Task[object]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.info("start-up stopped: %s", task.exception())
