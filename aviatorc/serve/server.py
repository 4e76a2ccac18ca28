"""Start the server: load the tenants, bind the socket, run uvicorn until interrupted.

The socket is bound here, before uvicorn starts, so `--port 0` picks a free port that is known
when the ready line is printed: `aviatorc serve: listening on http://HOST:PORT` goes to stdout
once the engines run and `/health` answers (tests and scripts wait for it).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import sys

from aviatorc.serve.metrics import Registry
from aviatorc.serve.tenants import EngineOptions, ModelSpec, load_models

READY = "aviatorc serve: listening on"


def serve(specs: list[ModelSpec], options: EngineOptions, *, host: str = "127.0.0.1", port: int = 8000,
          log_level: str = "warning") -> None:
    import uvicorn

    from aviatorc.serve.app import create_app

    registry = Registry()
    models = load_models(specs, options, registry)
    app = create_app(models, registry)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as error:
        from aviatorc.errors import OptionError

        raise OptionError(f"cannot listen on {host}:{port}: {error.strerror}",
                          hint="choose another --port (0 picks a free one)") from None
    bound = sock.getsockname()[1]
    logging.basicConfig(level=getattr(logging, log_level.upper(), logging.WARNING),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = uvicorn.Config(app, log_level=log_level, access_log=log_level in ("info", "debug"),
                            timeout_graceful_shutdown=5)
    server = uvicorn.Server(config)

    async def run() -> None:
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
