"""The engine process: receive requests over ZMQ, run `engine.step()`, send outputs back.

It polls without blocking while the engine has work and blocks (briefly, to notice a dead parent)
when idle. Admission control (`--max-queued-requests`) happens here, where the queue is. Nothing a
client sends ends this process: a request the engine refuses or fails on is answered with an error
for that request alone (`Rejected`, or an `error` finish), and a message that does not decode is
refused, not fatal. The engine stats are published after every change (`Stats`, before the outputs
of the same step), so the API answers `/get_server_info` and `/metrics` without waiting for a step.
A step that exceeds `--watchdog-timeout`, or an exception outside any request, ends the process;
the API process sees the death and answers 503.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import msgspec
import zmq

from dsaserve.args import ServerArgs
from dsaserve.cluster.frame_log import FrameLog
from dsaserve.cluster.secret import cluster_secret
from dsaserve.distributed.parallel_state import ParallelSizes, ParallelState
from dsaserve.engine.messages import GenerateRequest, RequestOutput
from dsaserve.engine.ranks.rounds import Stopped
from dsaserve.engine.startup import pick_device
from dsaserve.runtime import heartbeat, ipc
from dsaserve.runtime.quick_exit import skip_final_collection
from dsaserve.runtime.ranks import LocalRanks, start_ranks

logger = logging.getLogger(__name__)
IDLE_POLL_MS = 200
DP_IDLE_POLL_MS = 5  # DP attention: an idle group's leader must join the busy groups' ops soon
DP_QUIET_S = 1.0  # ... until every group has been idle this long; then it polls as usual


@runtime_checkable
class DrivenEngine(Protocol):
    """What the engine process drives: `Engine`, a disaggregation role around one (PD), or a
    test's double. Requests come in, outputs go out; nothing here parses JSON or text."""

    model_config: Any  # its `vocab_size` (None where unknown) and `context_length`
    context_length: int  # the longest prompt + output it serves
    generation_defaults: dict  # the checkpoint's generation_config.json defaults

    def add_request(self, request: GenerateRequest) -> None: ...  # ValueError: refused
    def abort(self, rid: str) -> RequestOutput | None: ...
    def step(self) -> list[RequestOutput]: ...
    def has_work(self) -> bool: ...
    def idle(self) -> bool: ...  # join other ranks' rounds while idle; True: another group busy
    def stats(self) -> dict: ...
    def flush_cache(self) -> bool: ...
    def close(self, graceful: bool = True) -> None: ...


Reject = Callable[[list[str], str, int], None]  # refuse requests: rids, message, HTTP status
# Builds the engine of one attention group on its ranks; `reject` refuses requests later (PD).
EngineFactory = Callable[[ServerArgs, ParallelState, Reject], DrivenEngine]


def run_engine_process(args: ServerArgs, paths: ipc.IpcPaths, parent_pid: int,
                       factory: EngineFactory, replica: int = 0) -> None:  # fmt: skip
    """Entry point of the spawned engine process: start this node's other ranks (--tp > 1),
    build what `factory` makes on them, and serve it until told to stop. With `--dp N` (no DP
    attention) the API process spawns N of them; this is `replica`, on its own devices."""
    enter_replica(args, replica)
    skip_final_collection()
    # Serving, the API process decides when we stop (after draining), also when a whole process
    # group is signalled; if the API process dies instead, the loop notices the new parent and
    # exits. Starting, there is nothing to drain: SIGTERM ends the start (a native build's
    # compiler included, kernels/native_build.py), and so does the API process's death.
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s: %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _stop_starting)
    threading.Thread(target=_exit_when_orphaned, args=(parent_pid,), daemon=True).start()
    paths = msgspec.structs.replace(paths, first_slot=replica * ParallelSizes.from_args(args).tp)
    heartbeat.start_beating(paths.heartbeat, paths.first_slot)  # rank 0; /health reads it
    context = zmq.Context()
    auth = ipc.auth_sockets(context, paths, cluster_secret(args))  # TCP: DP attention over nodes
    inbox = ipc.dial_socket(auth, context.socket(zmq.PULL))
    inbox.connect(paths.for_group(replica).to_engine)
    outbox = ipc.dial_socket(auth, context.socket(zmq.PUSH))
    outbox.connect(paths.from_engine)
    ranks = None
    try:
        sizes = ParallelSizes.from_args(args)
        if sizes.tp > 1:
            ranks = start_ranks(args, pick_device(args.device).type, paths, factory)
        if sizes.nnodes > 1:  # the other nodes' ranks beat through the store
            heartbeat.relay_from_store(ranks.parallel.store, paths.heartbeat,
                                       range(sizes.ranks_per_node, sizes.tp))  # fmt: skip
        parallel = ranks.parallel if ranks is not None else ParallelState.single()
        engine = factory(args, parallel, _rejecter(outbox))
    except Exception as e:  # report, do not hang the API process
        outbox.send(ipc.encode(ipc.Fatal(f"engine failed to start: {type(e).__name__}: {e}")))
        traceback.print_exc()
        if ranks is not None:
            ranks.kill()
        outbox.close(linger=2000)
        sys.exit(1)
    except SystemExit:  # SIGTERM, or the API process died, while starting
        if ranks is not None:
            ranks.kill()
        raise
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    serve_engine(engine, args, inbox, outbox, parent_pid, group=replica, ranks=ranks)


def enter_replica(args: ServerArgs, replica: int) -> None:
    """`--dp N` replicas: replica r's ranks take CUDA devices r*tp .. r*tp+tp-1 (of those
    visible), and on CPU the cores are shared out (unless OMP_NUM_THREADS or --threads says)."""
    sizes = ParallelSizes.from_args(args)
    if sizes.replicas == 1:
        return
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    devices = visible.split(",") if visible else [str(i) for i in range(sizes.replicas * sizes.tp)]
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(devices[replica * sizes.tp :][: sizes.tp])
    if "OMP_NUM_THREADS" not in os.environ and args.threads is None:
        share = (os.cpu_count() or 1) // (sizes.replicas * sizes.tp)
        os.environ["OMP_NUM_THREADS"] = str(max(1, share))


def _stop_starting(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)  # unwinds the start: `finally` blocks stop what they began


def _exit_when_orphaned(parent_pid: int) -> None:
    """The API process died: stop a start in progress (once serving, SIGTERM is ignored and the
    engine loop notices the new parent itself)."""
    while os.getppid() == parent_pid:
        time.sleep(0.5)
    os.kill(os.getpid(), signal.SIGTERM)


def _rejecter(outbox: Any) -> Reject:
    def reject(rids: list[str], message: str, status: int) -> None:
        outbox.send(ipc.encode(ipc.Rejected(rids, message, status=status)))

    return reject


def serve_engine(engine: DrivenEngine, args: ServerArgs, inbox: Any, outbox: Any, parent_pid: int,
                 group: int = 0, ranks: LocalRanks | None = None) -> None:  # fmt: skip
    """Serve `engine` until told to stop, then tear down: the engine's ranks leave their rounds
    (after a failure they are ended instead), the ones this process started are stopped."""
    outbox.send(ipc.encode(ipc.Ready(engine_info(engine), group)))
    code = EngineLoop(engine, args, inbox, outbox, parent_pid, group, ranks).run()
    try:
        engine.close(graceful=code == 0)
    except Exception:  # the other ranks are gone already
        code = code or 1
    if ranks is not None:
        ranks.stop(timeout=10.0 if code == 0 else 0.0)
    outbox.close(linger=2000)
    inbox.close(linger=0)
    sys.exit(code)


def run_group_leader(
    args: ServerArgs, paths: ipc.IpcPaths, parallel: ParallelState, factory: EngineFactory
) -> int:
    """DP attention: the first rank of group g > 0 is an engine with its own request socket."""
    parent = os.getppid()
    context = zmq.Context()
    auth = ipc.auth_sockets(context, paths, cluster_secret(args))  # TCP: another node's
    inbox = ipc.dial_socket(auth, context.socket(zmq.PULL))
    inbox.connect(paths.for_group(parallel.dp_rank).to_engine)
    outbox = ipc.dial_socket(auth, context.socket(zmq.PUSH))
    outbox.connect(paths.from_engine)
    engine = factory(args, parallel, _rejecter(outbox))
    serve_engine(engine, args, inbox, outbox, parent, group=parallel.dp_rank)
    return 0


def engine_info(engine: DrivenEngine) -> dict:
    return {
        "pid": os.getpid(),
        "vocab_size": engine.model_config.vocab_size,
        "context_length": int(engine.context_length),
        "generation_defaults": dict(engine.generation_defaults or {}),
        "stats": engine.stats(),
    }


class EngineLoop:
    """Message handling and stepping; `run()` returns the process exit code."""

    def __init__(self, engine: DrivenEngine, args: ServerArgs, inbox: Any, outbox: Any,
                 parent: int, group: int = 0, ranks: LocalRanks | None = None) -> None:  # fmt: skip
        self.engine = engine
        self.args = args
        self.inbox = inbox
        self.outbox = outbox
        self.parent = parent
        self.step_started: float | None = None
        self.stopping = False
        self.pending: list[ipc.FromEngine] = []  # sent after the stats of the same iteration
        self.published: dict | None = None
        self.group = group  # the attention group (or --dp replica) whose stats these are
        self.ranks = ranks  # the ranks this process started (ended by the watchdog)
        self.dp = args.dp_size if args.enable_dp_attention else 1
        self.others_busy = False
        self.last_busy = time.monotonic()
        self.frames = FrameLog(logger, "the API process")  # undecodable messages, logged sparingly

    def _idle_poll_ms(self) -> int:
        if self.dp > 1 and time.monotonic() - self.last_busy < DP_QUIET_S:
            return DP_IDLE_POLL_MS
        return IDLE_POLL_MS

    def run(self) -> int:
        threading.Thread(target=self._watchdog, daemon=True).start()
        try:
            while not self.stopping and os.getppid() == self.parent:
                busy = self.engine.has_work() or self.others_busy
                self.last_busy = time.monotonic() if busy else self.last_busy
                self._receive(0 if busy else self._idle_poll_ms())
                self._flush()  # admissions and aborts show before the step runs
                if self.engine.has_work() and not self.stopping:
                    self._step()
                    self._flush()
                elif not self.stopping:  # rank heartbeat / other DP groups' ops
                    self.others_busy = self.engine.idle()
            return 0
        except Stopped:  # another group's leader stopped every rank
            return 0
        except Exception as e:
            traceback.print_exc()
            self._send(ipc.Fatal(f"engine error: {type(e).__name__}: {e}"))
            return 1

    def _step(self) -> None:
        self.step_started = time.monotonic()
        outputs = self.engine.step()
        self.step_started = None
        if outputs:
            self.pending.append(ipc.Outputs(list(outputs)))

    def _flush(self) -> None:
        """Publish the stats if they changed, then what this iteration produced."""
        stats = self.engine.stats()
        if stats != self.published:
            self.published = stats
            self._send(ipc.Stats(stats, self.group))
        pending, self.pending = self.pending, []
        for message in pending:
            self._send(message)

    def _receive(self, timeout_ms: int) -> None:
        if not self.inbox.poll(timeout_ms):
            return
        while True:
            try:
                data = self.inbox.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                message = ipc.decode_to_engine(data)
            except (msgspec.DecodeError, msgspec.ValidationError) as e:
                self._refuse_undecodable(data, e)
                continue
            self._handle(message)

    def _refuse_undecodable(self, data: bytes, error: Exception) -> None:
        """A message that does not decode: refuse the requests it names (so none is left
        waiting), keep serving."""
        self.frames.dropped("undecodable", str(error))
        try:
            raw = msgspec.msgpack.decode(data)
            rids = [str(r["rid"]) for r in raw.get("requests", []) if isinstance(r, dict)]
        except Exception:
            return
        if rids:
            self.pending.append(ipc.Rejected(rids, f"malformed request: {error}"[:300], 400))

    def _handle(self, message: ipc.ToEngine) -> None:
        if isinstance(message, ipc.Submit):
            self._admit(message.requests)
        elif isinstance(message, ipc.Abort):
            finals = [self._abort(rid) for rid in message.rids]
            if any(finals):
                self.pending.append(ipc.Outputs([f for f in finals if f is not None]))
        elif isinstance(message, ipc.Control):
            self.pending.append(ipc.ControlReply(message.id, self._control(message.op)))
        elif isinstance(message, ipc.Shutdown):
            self.stopping = True

    def _abort(self, rid: str) -> Any:
        try:
            return self.engine.abort(rid)
        except Exception:  # a bug, not the client's: log it and keep serving
            traceback.print_exc()
            return None

    def _admit(self, requests: list) -> None:
        limit = self.args.max_queued_requests
        if limit is not None and self.engine.stats().get("num_waiting", 0) + len(requests) > limit:
            message = f"too many queued requests (--max-queued-requests {limit})"
            self.pending.append(ipc.Rejected([r.rid for r in requests], message))
            return
        for i, request in enumerate(requests):
            try:
                self.engine.add_request(request)
            except Exception as e:  # refused for this request alone, never a crash
                for added in requests[:i]:
                    self._abort(added.rid)
                status = 400 if isinstance(e, ValueError | TypeError) else 500
                if status == 500:
                    traceback.print_exc()
                message = str(e) if status == 400 else f"engine error: {type(e).__name__}"
                self.pending.append(ipc.Rejected([r.rid for r in requests], message, status))
                return

    def _control(self, op: str) -> Any:
        try:
            return self._control_op(op)
        except Exception:
            traceback.print_exc()
            return None

    def _control_op(self, op: str) -> Any:
        if op == "stats":
            return self.engine.stats()
        if op == "flush_cache":
            return bool(self.engine.flush_cache())
        if op == "info":
            return engine_info(self.engine)
        return None

    def _send(self, message: ipc.FromEngine) -> None:
        self.outbox.send(ipc.encode(message))

    def _watchdog(self) -> None:
        while True:
            time.sleep(1.0)
            started = self.step_started
            if started is not None and time.monotonic() - started > self.args.watchdog_timeout:
                print(f"watchdog: a step took over {self.args.watchdog_timeout}s", file=sys.stderr)
                if self.ranks is not None:
                    self.ranks.kill()
                os._exit(3)
