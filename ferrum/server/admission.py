"""Admission control: how much work the server takes, and how taken work ends early.

Every HTTP request that reaches the engine holds a `Ticket` for its engine requests (one per
choice). At most the engine's running batch (`max_num_seqs`) plus `limits.max_waiting_requests`
engine requests are in flight, and at most `limits.max_waiting_tokens` prompt tokens wait for their
first step (a request waits until its first output). Past a limit a request is refused whole with
`limits.overload_status` (429 or 503) and `Retry-After`; what was admitted runs on unharmed.

A ticket ends early with a reason: its deadline passed (`limits.request_timeout_s`, or the request's
own `timeout`) or the server is shutting down. Its engine requests are then aborted (the streams
finish with finish_reason "abort") and the handler turns the reason into an error (`end_error`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal, NoReturn

from ferrum.config.server_settings import LimitsConfig
from ferrum.engine.outputs import RequestOutput
from ferrum.server.errors import APIError

log = logging.getLogger(__name__)

EndReason = Literal["deadline", "shutdown"]
RejectReason = Literal["max_requests", "max_waiting_tokens", "shutting_down", "not_ready"]


@dataclass(eq=False)
class Ticket:
    request_ids: tuple[str, ...]
    prompt_tokens: tuple[int, ...]  # per engine request
    deadline_s: float | None
    arrived: float  # time.monotonic() when the HTTP request arrived
    priority: int = 0
    waiting: set[int] = field(default_factory=set)  # indexes of engine requests without an output yet
    end_reason: EndReason | None = None
    first_token_s: float | None = None  # from arrival to the first token of any choice
    queue_time_s: float | None = None  # the longest any of its engine requests waited in the queue
    output_tokens: dict[int, int] = field(default_factory=dict)  # per engine request: handed on (all, once finished)
    finish_reasons: dict[int, str] = field(default_factory=dict)
    _abort: Callable[[str], object] | None = None
    _timer: asyncio.TimerHandle | None = None

    def started(self, index: int) -> None:
        """Engine request `index` gave its first output: it left the waiting queue."""
        self.waiting.discard(index)

    def handed_on(self, index: int, output: RequestOutput) -> None:
        """Engine request `index`'s `output` was taken by the response (sent, for a stream): a request the
        client leaves is logged with the tokens it got."""
        self.output_tokens[index] = output.num_output_tokens

    def finished(self, index: int, output: RequestOutput) -> None:
        self.output_tokens[index] = output.num_output_tokens
        self.finish_reasons[index] = output.finish_reason or "stop"

    @property
    def waiting_tokens(self) -> int:
        return sum(self.prompt_tokens[i] for i in self.waiting)

    def end(self, reason: EndReason) -> None:
        """Ends the request early: every engine request is aborted (a no-op for finished ones)."""
        if self.end_reason is None:
            self.end_reason = reason
            if self._abort is not None:
                for request_id in self.request_ids:
                    self._abort(request_id)

    def end_error(self) -> APIError | None:
        """The error a request that ended early answers with (None when it ran its course)."""
        if self.end_reason == "deadline":
            return APIError(408, f"The request did not finish within its deadline of {self.deadline_s:g} s.",
                            param="timeout", code="request_timeout", type="timeout_error")
        if self.end_reason == "shutdown":
            return APIError(503, "The server is shutting down; the request was stopped before it finished.",
                            code="server_shutting_down")
        return None


class Admission:
    def __init__(
        self,
        limits: LimitsConfig,
        max_running: Callable[[], int],
        abort: Callable[[str], object],
        on_reject: Callable[[RejectReason], None] | None = None,
    ) -> None:
        """`max_running`: the engine's running batch (read at each admission); `abort(request_id)`
        aborts one engine request (its stream then finishes)."""
        self.limits = limits
        self._max_running = max_running
        self._abort = abort
        self._on_reject = on_reject
        self.tickets: set[Ticket] = set()
        self.closed_reason: RejectReason | None = None  # set: every request is refused with 503
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def in_flight(self) -> int:
        return sum(len(t.request_ids) for t in self.tickets)

    @property
    def waiting_tokens(self) -> int:
        return sum(t.waiting_tokens for t in self.tickets)

    def admit(
        self,
        request_ids: Sequence[str],
        prompt_tokens: Sequence[int],
        *,
        arrived: float,
        timeout_s: float | None = None,
        priority: int = 0,
    ) -> Ticket:
        """A ticket for these engine requests, or an APIError (429/503 with Retry-After) when they do
        not fit. `timeout_s`: the request's own deadline (None: the server's default)."""
        if self.closed_reason is not None:
            self.refuse(self.closed_reason)
        capacity = self._max_running() + self.limits.waiting_requests(self._max_running())
        if self.in_flight + len(request_ids) > capacity:
            self.refuse("max_requests", f"The server has {self.in_flight} requests in flight, its limit "
                                         f"is {capacity}; try again shortly.")
        cap = self.limits.max_waiting_tokens
        tokens = sum(prompt_tokens)
        if cap is not None and self.waiting_tokens + tokens > cap:
            self.refuse("max_waiting_tokens", f"{self.waiting_tokens} prompt tokens are waiting to be processed "
                                               f"and this request adds {tokens}, past the limit of {cap}; "
                                               f"try again shortly.")
        deadline = timeout_s if timeout_s is not None else self.limits.request_timeout_s
        ticket = Ticket(tuple(request_ids), tuple(prompt_tokens), deadline, arrived, priority,
                        set(range(len(request_ids))), _abort=self._abort)
        if deadline is not None:
            ticket._timer = asyncio.get_running_loop().call_later(deadline, ticket.end, "deadline")
        self.tickets.add(ticket)
        self._idle.clear()
        return ticket

    def release(self, ticket: Ticket) -> None:
        if ticket._timer is not None:
            ticket._timer.cancel()
        self.tickets.discard(ticket)
        if not self.tickets:
            self._idle.set()

    def close(self, reason: RejectReason) -> None:
        """Refuse every new request from now on (503)."""
        self.closed_reason = reason

    async def drain(self, timeout_s: float) -> int:
        """Waits up to `timeout_s` for the admitted requests to finish; ends the rest ("shutdown")
        and waits for their handlers to let go. Returns how many were ended."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
            return 0
        except TimeoutError:
            pass
        ended = list(self.tickets)
        log.warning("shutdown: %d request(s) still running after %.0f s; ending them", len(ended), timeout_s)
        for ticket in ended:
            ticket.end("shutdown")
        try:
            await asyncio.wait_for(self._idle.wait(), 10.0)
        except TimeoutError:
            log.error("shutdown: %d request(s) did not end after their abort", len(self.tickets))
        return len(ended)

    def refuse(self, reason: RejectReason, message: str | None = None) -> NoReturn:
        """Raises the refusal's APIError (and counts it)."""
        if self._on_reject is not None:
            self._on_reject(reason)
        if reason == "shutting_down":
            raise APIError(503, "The server is shutting down and takes no new requests.", code="server_shutting_down")
        if reason == "not_ready":
            raise APIError(503, "The model is not loaded yet; see GET /ready.", code="model_not_ready",
                           headers={"Retry-After": str(max(1, self.limits.retry_after_s))})
        status = self.limits.overload_status
        raise APIError(status, message or "The server is overloaded; try again shortly.", code="server_overloaded",
                       type="rate_limit_exceeded" if status == 429 else "service_unavailable",
                       headers={"Retry-After": str(self.limits.retry_after_s)})
