"""What a client may cost the server: body size, read time, and the drain on shutdown.

- `BodyLimits`, an ASGI middleware: a request body larger than `max_request_bytes` is refused
  with 413 before any of it is parsed (at once when `Content-Length` says so, otherwise as soon
  as the bytes read pass the limit); a body whose next bytes take longer than `read_timeout_s`
  is refused with 408. The 413's head goes out at once; the rest of the body is then read and
  dropped (at most `DRAIN_BYTES`, for at most `DRAIN_S`) before the answer ends, since closing a
  connection with unread bytes resets it, and the reset can destroy the answer before the client
  reads it. It also counts the requests in flight, so the drain knows when every
  response has been sent.
- `head_timeout_protocol`: uvicorn's h11 protocol with a deadline for a request's head. uvicorn
  times out only idle keep-alive connections; a client that sends one header byte every few
  seconds would hold a connection (and a file descriptor) for ever.

The errors have OpenAI's body (`aviatorc.serve.protocol.error_body`), as every other 4xx.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

DRAIN_BYTES = 256 << 20  # of a refused body, read and dropped so that the client reads the refusal
DRAIN_S = 5.0


def error_bytes(status: int, message: str, kind: str = "invalid_request_error") -> bytes:
    from aviatorc.serve.protocol import error_body  # pydantic: the serve extra, which the CLI may lack

    return json.dumps(error_body(status, message, kind)).encode()


class BodyLimits:
    """Reads each request's body within the limits before the app sees it (see the module docstring)."""

    def __init__(self, app: ASGIApp, *, max_request_bytes: int, read_timeout_s: float) -> None:
        self.app = app
        self.max_request_bytes = max_request_bytes
        self.read_timeout_s = read_timeout_s
        self.in_flight = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        self.in_flight += 1
        try:
            await self._http(scope, receive, send)
        finally:
            self.in_flight -= 1

    async def _http(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = dict(scope["headers"])
        declared = headers.get(b"content-length")
        if declared is not None:
            if not declared.isdigit():
                await _respond(send, 400, "the Content-Length header is not a number")
                return
            if int(declared) > self.max_request_bytes:
                # A client waiting for "100 Continue" never sends the body: nothing to drain.
                waits = headers.get(b"expect", b"").lower() == b"100-continue"
                await _respond(send, 413, self._too_large(f"{int(declared)} bytes"), drain=None if waits else receive)
                return
        body = bytearray()
        while True:
            try:
                message = await asyncio.wait_for(receive(), self.read_timeout_s)
            except TimeoutError:
                await _respond(send, 408, f"the request body did not arrive within {self.read_timeout_s:g} s")
                return
            if message["type"] != "http.request":  # the client went away
                return
            body += message.get("body", b"")
            if len(body) > self.max_request_bytes:
                more = message.get("more_body", False)
                await _respond(send, 413, self._too_large(f"more than {self.max_request_bytes} bytes"),
                               drain=receive if more else None)
                return
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Message:  # the body once, then the client's own events (a disconnect)
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": bytes(body), "more_body": False}

        await self.app(scope, replay, send)

    def _too_large(self, size: str) -> str:
        return f"the request body has {size}; this server takes at most {self.max_request_bytes} (--max-request-bytes)"


async def _respond(send: Send, status: int, message: str, *, drain: Receive | None = None) -> None:
    """An error answer that closes the connection; with `drain`, what the client still sends of its
    body is read and dropped between the answer's head and its end (see the module docstring)."""
    kind = "invalid_request_error" if status != 408 else "timeout_error"
    body = error_bytes(status, message, kind)
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close")]})
    if drain is not None:
        await _drain(drain)
    await send({"type": "http.response.body", "body": body})


async def _drain(receive: Receive) -> None:
    """Read and drop request body bytes until the body ends, DRAIN_BYTES or DRAIN_S."""
    loop = asyncio.get_running_loop()
    deadline, dropped = loop.time() + DRAIN_S, 0
    while dropped < DRAIN_BYTES:
        try:
            message = await asyncio.wait_for(receive(), deadline - loop.time())
        except TimeoutError:
            return
        if message["type"] != "http.request":
            return
        dropped += len(message.get("body", b""))
        if not message.get("more_body", False):
            return


def head_timeout_protocol(read_timeout_s: float) -> type:
    """uvicorn's h11 protocol, closing a connection whose request head takes more than `read_timeout_s`
    (from the connection's start, or from the end of its previous response) with 408."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    timeout = error_bytes(408, f"the request head did not arrive within {read_timeout_s:g} s", "timeout_error")
    response = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
                b"content-length: %d\r\n\r\n" % len(timeout)) + timeout

    class HeadTimeoutH11(H11Protocol):  # type: ignore[misc]
        _head_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm()

        def handle_events(self) -> None:
            super().handle_events()
            if self.cycle is not None and not self.cycle.response_complete:  # a head arrived: its request runs
                self._disarm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._disarm()
            if not self.transport.is_closing():
                self._head_timer = self.loop.call_later(read_timeout_s, self._too_slow)

        def _disarm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _too_slow(self) -> None:
            self._head_timer = None
            if not self.transport.is_closing() and (self.cycle is None or self.cycle.response_complete):
                self.transport.write(response)
                self.transport.close()

    return HeadTimeoutH11
