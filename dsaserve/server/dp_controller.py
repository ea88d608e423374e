"""The data-parallel controller: the API process's client for N engine groups.

The groups are DP attention's attention groups (`--dp N --enable-dp-attention`: one engine
process, the groups' leaders among its ranks) or SGLang's data-parallel replicas (`--dp N`
alone: N engine processes of `--tp` ranks each, server/engine_processes.py); the dispatch is the
same. Each group (scheduler, KV pool, radix cache) has its own request socket; outputs of all
groups come back on one. A request goes to the group that already cached the longest page-aligned
prefix of it, where one did; otherwise by `--load-balance-method`: `round_robin`, or
`shortest_queue` (fewest requests in flight from this controller). A PD prefill under DP
attention (`follow_room`) sends room r to group r % N instead, where the decode sends its KV
destination (SGLang's `follow_bootstrap_room`); a batch's rooms may go to several groups.
Control calls fan out to every group and their stats come back summed, with each group's own
under "dp_groups".
"""

from __future__ import annotations

import asyncio
import itertools
from collections import OrderedDict
from typing import Any

import zmq

from dsaserve.engine.messages import GenerateRequest
from dsaserve.runtime import ipc
from dsaserve.server.engine_client import EngineClient
from dsaserve.web.errors import APIError

PREFIX_BLOCK = 16  # tokens per prefix key (the radix cache's page size in the tests)
PREFIX_MEMORY = 4096  # prefix keys remembered


class PrefixMap:
    """Which group last served each page-aligned prefix (hashes of growing prefixes, LRU)."""

    def __init__(self, block: int = PREFIX_BLOCK, capacity: int = PREFIX_MEMORY) -> None:
        self.block, self.capacity = block, capacity
        self.groups: OrderedDict[int, int] = OrderedDict()

    def _keys(self, ids: list[int]) -> list[int]:
        return [hash(tuple(ids[:end])) for end in range(self.block, len(ids) + 1, self.block)]

    def lookup(self, ids: list[int]) -> int | None:
        for key in reversed(self._keys(ids)):
            if key in self.groups:
                self.groups.move_to_end(key)
                return self.groups[key]
        return None

    def remember(self, ids: list[int], group: int) -> None:
        for key in self._keys(ids):
            self.groups[key] = group
            self.groups.move_to_end(key)
        while len(self.groups) > self.capacity:
            self.groups.popitem(last=False)


class DPEngineClient(EngineClient):
    def __init__(self, paths: ipc.IpcPaths, groups: int, method: str = "round_robin",
                 page_size: int | None = None, secret: str | None = None,
                 follow_room: bool = False) -> None:  # fmt: skip
        super().__init__(paths, secret)
        self.groups = groups
        self.method = method
        self.follow_room = follow_room
        self.sockets = [self.to_engine]
        for group in range(1, groups):
            sock = ipc.serve_socket(self.send_auth, self.send_context.socket(zmq.PUSH))
            sock.bind(paths.for_group(group).to_engine)
            self.sockets.append(sock)
        self.group_of: dict[str, int] = {}
        self.in_flight = [0] * groups
        self.turn = itertools.count()
        self.prefixes = PrefixMap(page_size or PREFIX_BLOCK)
        self.ready_infos: list[dict] = []
        self.dispatched = [0] * groups
        self._target: int | None = None  # the group `_send` addresses during a submit
        self.group_stats: list[dict] = [{} for _ in range(groups)]  # as each group published

    # ---- dispatch -------------------------------------------------------------------------
    def choose(self, request: GenerateRequest) -> int:
        if self.follow_room and request.bootstrap is not None:
            return request.bootstrap.room % self.groups
        cached = self.prefixes.lookup(list(request.input_ids))
        if cached is not None:
            return cached
        if self.method == "shortest_queue":
            return min(range(self.groups), key=lambda g: (self.in_flight[g], g))
        return next(self.turn) % self.groups

    async def submit(self, requests: list[GenerateRequest]):
        """To one group (the first request's choice); with `follow_room`, each request to its
        room's, and should one group refuse, the parts already sent are aborted."""
        if not self.follow_room:
            return await self._submit_to(self.choose(requests[0]), requests)
        parts: dict[int, list[GenerateRequest]] = {}
        for request in requests:
            parts.setdefault(self.choose(request), []).append(request)
        streams: dict[str, Any] = {}
        try:
            for group, part in parts.items():
                streams.update((s.rid, s) for s in await self._submit_to(group, part))
        except BaseException:
            for stream in streams.values():
                stream.end(abort=True, by_client=False)
            raise
        return [streams[request.rid] for request in requests]

    async def _submit_to(self, group: int, requests: list[GenerateRequest]):
        self._target = group
        try:
            streams = await super().submit(requests)
        finally:
            self._target = None
        for request in requests:
            self.group_of[request.rid] = group
            self.in_flight[group] += 1
        self.dispatched[group] += len(requests)
        self.prefixes.remember(list(requests[0].input_ids), group)
        return streams

    def _send_abort(self, rids: list[str]) -> None:
        for group in range(self.groups):
            mine = [rid for rid in rids if self.group_of.get(rid, 0) == group]
            if mine:
                try:
                    self._send_to(group, ipc.Abort(mine))
                except APIError:
                    pass

    def _send_bytes(self, data: bytes) -> None:
        """EngineClient's one send path: a submit goes to the chosen group, the rest to 0."""
        self._send_bytes_to(0 if self._target is None else self._target, data)

    def _send_to(self, group: int, message: ipc.ToEngine) -> None:
        self._send_bytes_to(group, ipc.encode(message))

    def _send_bytes_to(self, group: int, data: bytes) -> None:
        try:
            self.sockets[group].send(data, zmq.NOBLOCK)
        except zmq.Again as e:
            raise APIError(503, "engine is not accepting requests", retry_after=1) from e

    # ---- control and lifecycle ------------------------------------------------------------
    async def control(self, op: str, timeout: float = 30.0) -> Any:
        self._check_alive()
        calls = []
        for group in range(self.groups):
            call_id = next(self.control_ids)
            future = asyncio.get_running_loop().create_future()
            self.replies[call_id] = future
            self._send_to(group, ipc.Control(call_id, op))
            calls.append((call_id, future))
        try:
            results = await asyncio.wait_for(asyncio.gather(*(f for _, f in calls)), timeout)
        except TimeoutError as e:
            raise APIError(503, f"engine did not answer '{op}' within {timeout}s") from e
        finally:
            for call_id, _ in calls:
                self.replies.pop(call_id, None)
        return self._combine(op, list(results))

    def _combine(self, op: str, results: list) -> Any:
        if op == "flush_cache":
            return all(results)
        if op == "stats":
            return {**sum_stats(results), "dp_groups": results,
                    "dp_dispatched": list(self.dispatched)}  # fmt: skip
        if op == "info":
            return {**results[0], "stats": self._combine("stats", [r["stats"] for r in results])}
        return results[0]

    async def shutdown(self) -> None:
        if self.dead is None:
            for group in range(self.groups):
                try:
                    self._send_to(group, ipc.Shutdown())
                except APIError:
                    pass
        for task in self.tasks:
            task.cancel()

    def close(self) -> None:
        for sock in self.sockets[1:]:
            sock.close(linger=1000)
        super().close()

    def _dispatch(self, message: ipc.FromEngine) -> None:
        if isinstance(message, ipc.Stats):
            self.group_stats[message.group] = message.stats
            self.stats = self._combine("stats", self.group_stats)
            return
        if isinstance(message, ipc.Ready):
            self.ready_infos.append({**message.info, "group": message.group})
            if len(self.ready_infos) == self.groups and not self.ready.done():
                infos = sorted(self.ready_infos, key=lambda info: info["group"])
                self.group_stats = [dict(i["stats"]) for i in infos]
                self.stats = self._combine("stats", self.group_stats)
                pids = [info["pid"] for info in infos]
                self.ready.set_result({**infos[0], "stats": self.stats, "group_pids": pids})
            return
        if isinstance(message, ipc.Outputs):
            for output in message.outputs:
                if output.finished and output.rid in self.group_of:
                    self.in_flight[self.group_of.pop(output.rid)] -= 1
        elif isinstance(message, ipc.Rejected):
            for rid in message.rids:
                if rid in self.group_of:
                    self.in_flight[self.group_of.pop(rid)] -= 1
        super()._dispatch(message)


SETTINGS = ("spec_num_steps", "spec_block_size")  # the same on every group: not summed


def sum_stats(per_group: list[dict]) -> dict:
    """Counts summed over groups; rates recomputed from the sums where they can be: the
    speculative rates weighted by each group's verify steps (a group that verified nothing does
    not pull the server's accept length down)."""
    total: dict = {}
    for stats in per_group:
        for key, value in stats.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                total[key] = total.get(key, 0) + value
    prompt = total.get("prompt_tokens", 0)
    if "cache_hit_rate" in total:
        total["cache_hit_rate"] = total.get("cached_tokens", 0) / prompt if prompt else 0.0
    verifies = total.get("spec_verify_ct", 0)
    for key in ("avg_spec_accept_length", "spec_accept_rate"):
        if key in total:
            weighted = sum(g.get(key, 0.0) * g.get("spec_verify_ct", 0) for g in per_group)
            total[key] = weighted / verifies if verifies else 0.0
    for key in SETTINGS:
        if key in total:
            total[key] = per_group[0][key]
    return total


def load_report(stats: dict) -> list[dict]:
    """`/get_load`: one entry per attention group (one for a server without DP attention)."""
    groups = stats.get("dp_groups") or [stats]
    return [{"dp_rank": g, "num_reqs": s.get("num_running", 0) + s.get("num_waiting", 0)
             + s.get("pd_rooms_active", 0),
             "num_waiting_reqs": s.get("num_waiting", 0),
             "num_tokens": s.get("kv_used_tokens", 0)} for g, s in enumerate(groups)]  # fmt: skip


def dp_metrics_text(model: str, stats: dict) -> bytes:
    """Per-group gauges appended to /metrics under DP attention (the summed ones come first)."""
    lines = []
    names = {"num_running_reqs": "num_running", "num_queue_reqs": "num_waiting",
             "kv_used_tokens": "kv_used_tokens", "cache_hit_rate": "cache_hit_rate"}  # fmt: skip
    for metric, key in names.items():
        lines.append(f"# TYPE sglang:dp_{metric} gauge")
        for group, s in enumerate(stats.get("dp_groups") or []):
            labels = f'model_name="{model}",dp_rank="{group}"'
            lines.append(f"sglang:dp_{metric}{{{labels}}} {float(s.get(key, 0) or 0)}")
    return ("\n".join(lines) + "\n").encode() if stats.get("dp_groups") else b""
