"""`dsaserve plan --web`: serve the web console's Deploy panel on its own, with no model."""

from __future__ import annotations

import asyncio

import uvicorn


def serve_console(host: str, port: int) -> int:
    """Serve `/console` and the planner routes until interrupted; prints the URL once listening."""
    from dsaserve.server.console import build_console_app

    config = uvicorn.Config(build_console_app(), host=host, port=port, log_level="warning")
    server = uvicorn.Server(config)
    asyncio.run(_serve(server))
    return 0


async def _serve(server: uvicorn.Server) -> None:
    serving = asyncio.create_task(server.serve())
    while not server.started and not serving.done():
        await asyncio.sleep(0.02)
    if server.started:
        bound_host, bound_port = server.servers[0].sockets[0].getsockname()[:2]
        print(f"dsaserve console: http://{bound_host}:{bound_port}/console/", flush=True)
    await serving
