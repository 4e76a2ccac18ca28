"""Start the server: load the tenants, bind the socket, run uvicorn until SIGTERM, then drain.

The socket is bound here, before uvicorn starts, so `--port 0` picks a free port that is known
when the ready line is printed: `aviatorc serve: listening on http://HOST:PORT` goes to stdout
once the engines run and `/health` answers (tests and scripts wait for it).

SIGTERM (or Ctrl-C) drains instead of cutting: new generation requests get 503 and `/health`
answers `draining`; the requests already accepted run for up to `--shutdown-timeout` seconds;
then each one still unfinished ends (a stream with an error event and `data: [DONE]`, a plain
request with 503), and the process exits 0 once every response is sent. A second signal exits
at once (uvicorn's own handling).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import sys
from types import FrameType
from typing import Any

from aviatorc.options import ServerLimits
from aviatorc.serve.engine import Finished
from aviatorc.serve.metrics import Registry
from aviatorc.serve.tenants import EngineOptions, ModelSpec, ServedModel, load_models

READY = "aviatorc serve: listening on"
# After the drain, how long responses may still take to reach their clients (a client that stopped
# reading its stream cannot hold the process).
_SEND_GRACE_S = 2
log = logging.getLogger("aviatorc.serve")


def serve(specs: list[ModelSpec], options: EngineOptions, *, host: str = "127.0.0.1", port: int = 8000,
          log_level: str = "warning", limits: ServerLimits | None = None) -> None:
    import uvicorn
    from sse_starlette.sse import AppStatus

    from aviatorc.serve.app import create_app
    from aviatorc.serve.limits import BodyLimits, head_timeout_protocol

    limits = limits or ServerLimits()
    shutdown_timeout_s = limits.shutdown_timeout_s
    registry = Registry()
    models = load_models(specs, options, registry)
    app = create_app(models, registry)
    limited = BodyLimits(app, max_request_bytes=limits.max_request_bytes, read_timeout_s=limits.read_timeout_s)
    sock = _bind(host, port)
    bound = sock.getsockname()[1]
    logging.basicConfig(level=getattr(logging, log_level.upper(), logging.WARNING),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # sse-starlette would cut every open stream at the first signal; the drain ends them itself.
    AppStatus.disable_automatic_graceful_drain()
    config = uvicorn.Config(limited, log_level=log_level, access_log=log_level in ("info", "debug"),
                            http=head_timeout_protocol(limits.read_timeout_s), timeout_graceful_shutdown=_SEND_GRACE_S)

    class DrainingServer(uvicorn.Server):
        loop: asyncio.AbstractEventLoop | None = None
        drain_started = False
        drain_task: asyncio.Task[None] | None = None

        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            if self.drain_started or self.loop is None or not self.started:
                super().handle_exit(sig, frame)  # a second signal, or one before the server answered
                return
            self.drain_started = True
            self.loop.call_soon_threadsafe(self._start_drain)  # a signal handler must not touch the loop itself

        def _start_drain(self) -> None:
            self.drain_task = asyncio.ensure_future(drain(self, app.state, models, limited, shutdown_timeout_s))

    server = DrainingServer(config)

    async def run() -> None:
        server.loop = asyncio.get_running_loop()
        task = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started and not task.done():
            await asyncio.sleep(0.02)
        if server.started:
            names = ", ".join(models)
            print(f"{READY} http://{host}:{bound} (models: {names})", flush=True)
        await task

    asyncio.run(run())
    if not server.started:
        sys.exit(1)


async def drain(server: Any, state: Any, models: dict[str, ServedModel], limited: Any, timeout_s: float) -> None:
    """Stop admitting, let the accepted requests run for up to `timeout_s`, end the rest, wait for
    their responses to be sent (briefly), then tell uvicorn to exit."""
    loop = asyncio.get_running_loop()
    state.draining = True
    running = sum(len(m.engine.running) + len(m.engine.waiting) for m in models.values())
    log.warning("shutting down: %d request(s) in progress get up to %g s", running, timeout_s)
    deadline = loop.time() + timeout_s
    while not all(m.engine.idle for m in models.values()) and loop.time() < deadline:
        await asyncio.sleep(0.02)
    for model in models.values():
        model.engine.end_all(Finished("shutdown", f"the server shut down before this request finished "
                                                  f"(--shutdown-timeout {timeout_s:g} s)"))
    deadline = loop.time() + _SEND_GRACE_S
    while limited.in_flight and loop.time() < deadline:
        await asyncio.sleep(0.02)
    server.should_exit = True


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as error:
        from aviatorc.errors import OptionError

        raise OptionError(f"cannot listen on {host}:{port}: {error.strerror}",
                          hint="choose another --port (0 picks a free one)") from None
    return sock
