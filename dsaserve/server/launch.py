"""`dsaserve serve`: check the flags, start the engine process, serve HTTP until told to stop.

The API process (this one) runs uvicorn and answers `/health` 503 until the engine is ready. On
SIGTERM or Ctrl-C it drains: new requests get 503, in-flight ones may finish for up to
`--shutdown-timeout` seconds, the rest are aborted; then the engine process is stopped (and killed
if it does not stop) so no child is left behind. A second signal skips the drain.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import time
from typing import Any

import uvicorn

from dsaserve.args import ArgsError, ServerArgs
from dsaserve.cluster.secret import cluster_secret
from dsaserve.distributed.parallel_state import ParallelSizes
from dsaserve.runtime import ipc
from dsaserve.runtime.heartbeat import Heartbeats
from dsaserve.runtime.hub import resolve_checkpoints
from dsaserve.runtime.memory_fit import check_memory_fit
from dsaserve.runtime.node import serve_node
from dsaserve.runtime.preflight import preflight
from dsaserve.runtime.quick_exit import skip_final_collection
from dsaserve.server.app import build_app
from dsaserve.server.body_decoder import BodyDecoder
from dsaserve.server.dp_controller import DPEngineClient
from dsaserve.server.engine_client import EngineClient
from dsaserve.server.engine_processes import default_factory, start_engines, stop_engines
from dsaserve.server.metrics import Metrics
from dsaserve.server.parsers.choice import (
    ParserConfigError,
    resolve_reasoning_parser,
    resolve_tool_parser,
)
from dsaserve.server.state import ServerState
from dsaserve.server.templates import model_type_of
from dsaserve.server.tokenizer_manager import TokenizerManager
from dsaserve.web.http_limits import uvicorn_limits

logger = logging.getLogger("dsaserve.server")


def main(argv: list[str] | None = None, engine_factory: Any = None) -> int:
    """`dsaserve serve`. `engine_factory` builds what the engine process drives (its
    EngineFactory, runtime/engine_process.py; picklable): by default the engine in its
    --disaggregation-mode role; a test passes its own double."""
    skip_final_collection()  # stopped promptly on SIGTERM (runtime/quick_exit.py)
    try:
        args = resolve_checkpoints(ServerArgs.from_cli(argv), say)  # Hub ids: once, here
        for note in preflight(args):  # every flag, once, before any process starts
            print(f"dsaserve serve: {note}", file=sys.stderr, flush=True)
        fit = check_memory_fit(args)  # before a weight file is opened
        if fit:
            say(fit)
        if args.node_rank > 0:
            return serve_node(args, engine_factory or default_factory())
        tokenizer = load_tokenizer(args)
    except (ArgsError, ParserConfigError) as e:
        print(f"dsaserve serve: error: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s: %(message)s")
    return asyncio.run(serve(args, tokenizer, engine_factory))


def say(phase: str) -> None:
    """A start-up phase, on stderr as it begins."""
    print(f"dsaserve serve: {phase}", file=sys.stderr, flush=True)


def load_tokenizer(args: ServerArgs) -> Any:
    """The checkpoint's tokenizer (and template); checks the parser flags against it."""
    from transformers import AutoTokenizer

    path = args.tokenizer_path or args.model_path
    if not os.path.isdir(path):
        raise ArgsError(f"--model-path {path}: no such checkpoint folder")
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=args.trust_remote_code)
    except Exception as e:
        raise ArgsError(f"cannot load the tokenizer from {path}: {e}") from e
    template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else ""
    model_type = model_type_of(args.model_path)
    vocab = set(tokenizer.get_vocab())
    resolve_reasoning_parser(args.reasoning_parser, template or "", vocab, model_type)
    resolve_tool_parser(args.tool_call_parser, template or "", model_type)
    return tokenizer


class DrainingServer(uvicorn.Server):
    """uvicorn, with a drain before exit on the first signal and no re-raised signal after."""

    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self.state = state
        self.loop: asyncio.AbstractEventLoop | None = None

    def handle_exit(self, sig: int, frame: Any) -> None:
        if self.state.draining or not self.state.ready or self.loop is None:
            self.should_exit = True
            self.force_exit = self.state.draining
            return
        self.state.draining = True
        self.loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self.drain()))

    async def drain(self) -> None:
        deadline = time.monotonic() + self.state.args.shutdown_timeout
        logger.info("draining %d request(s)", self.state.in_flight)
        while self.state.in_flight > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        engine: EngineClient = self.state.engine
        leftover = engine.in_flight_rids()
        if leftover:
            logger.info("aborting %d request(s) after the drain", len(leftover))
            engine.abort(leftover)
            await asyncio.sleep(0.2)
        self.should_exit = True


async def serve(args: ServerArgs, tokenizer: Any, engine_factory: Any = None) -> int:
    groups = args.dp_size  # attention groups (DP attention) or engine replicas (--dp alone)
    if args.nnodes > 1 and groups > 1:  # DP attention over nodes: groups' leaders elsewhere
        paths = ipc.IpcPaths.tcp(args.dist_init_addr.rpartition(":")[0].strip("[]"), groups)
    else:
        paths = ipc.IpcPaths.fresh()
    if groups > 1:
        engine = DPEngineClient(paths, groups, args.load_balance_method, args.page_size,
                                cluster_secret(args),
                                follow_room=args.disaggregation_mode == "prefill")  # fmt: skip
    else:
        engine = EngineClient(paths)
    engines = start_engines(args, paths, engine_factory)
    engine.start(engines)
    watch = asyncio.create_task(engines.end_with_first())
    sizes = ParallelSizes.from_args(args)
    ranks = sizes.tp * sizes.replicas  # every node's, every replica's (runtime/heartbeat.py)
    state = ServerState(args=args, engine=engine, body_decoder=BodyDecoder(),
                        heartbeats=Heartbeats(paths.heartbeat, ranks))  # fmt: skip
    state.body_decoder.start()
    config = uvicorn.Config(build_app(state), host=args.host, port=args.port,
                            log_level=args.log_level, timeout_graceful_shutdown=5,
                            access_log=args.log_level == "debug",
                            **uvicorn_limits(args.header_timeout))  # fmt: skip
    server = DrainingServer(config, state)
    server.loop = asyncio.get_running_loop()
    serving = asyncio.create_task(server.serve())
    code = 0
    try:
        code = await _become_ready(server, serving, state, tokenizer)
        if code == 0:
            await serving
    finally:
        server.should_exit = True
        await asyncio.gather(serving, return_exceptions=True)
        watch.cancel()
        await stop_engines(engine, engines, started=bool(state.engine_info))
        state.body_decoder.close()
        paths.cleanup(groups)
    return code


async def _become_ready(
    server: DrainingServer, serving: asyncio.Task, state: ServerState, tokenizer: Any
) -> int:
    engine: EngineClient = state.engine
    ready = asyncio.ensure_future(engine.wait_ready())
    await asyncio.wait([ready, serving], return_when=asyncio.FIRST_COMPLETED)
    if not ready.done():  # a signal (or a failed HTTP start) while the engine was starting
        ready.cancel()
        print("dsaserve serve: stopped during start-up", file=sys.stderr, flush=True)
        return 1
    try:
        info = ready.result()
    except Exception as e:
        print(f"dsaserve serve: error: {e}", file=sys.stderr)
        return 1
    state.engine_info = info
    state.tokenizer_manager = TokenizerManager(state.args, tokenizer, info)
    state.metrics = Metrics(state.tokenizer_manager.model_name, state.args.hicache_storage_backend)
    engine.metrics = state.metrics
    while not server.started and not serving.done():
        await asyncio.sleep(0.02)
    if serving.done():
        print("dsaserve serve: error: the HTTP server did not start", file=sys.stderr)
        return 1
    state.ready = True
    host, port = server.servers[0].sockets[0].getsockname()[:2]
    print(f"dsaserve ready: http://{host}:{port} (model {state.tokenizer_manager.model_name})",
          flush=True)  # fmt: skip
    return 0
