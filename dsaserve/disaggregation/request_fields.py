"""The router's per-request fields in PD mode: `bootstrap_host`, `bootstrap_port` (null: this
server's `--disaggregation-bootstrap-port`) and `bootstrap_room` (an integer < 2^63), each a
scalar or a list (one per prompt). In regular mode they are accepted and ignored."""

from __future__ import annotations

from typing import Any

from dsaserve.args import ServerArgs
from dsaserve.engine.messages import Bootstrap, GenerateRequest
from dsaserve.web.errors import bad_request


def _each(value: Any, n: int, name: str) -> list[Any]:
    if not isinstance(value, list):
        return [value] * n
    if len(value) != n:
        raise bad_request(f"{name} has {len(value)} entries for {n} prompts", name)
    return value


def attach_bootstrap(args: ServerArgs, body: Any, requests: list[GenerateRequest]) -> None:
    """Give each engine request its room (in PD roles); 400 naming the field when missing."""
    if args.disaggregation_mode == "null":
        return
    role = args.disaggregation_mode
    if getattr(body, "n", 1) > 1:
        raise bad_request(f"n > 1 is not supported by a {role} server (one room per request)", "n")
    if body.bootstrap_room is None or body.bootstrap_host is None:
        raise bad_request(
            f"this is a {role} server (--disaggregation-mode {role}): requests need "
            "bootstrap_host and bootstrap_room; send them through sglang-router "
            "--pd-disaggregation",
            "bootstrap_room",
        )
    n = len(requests)
    rooms = _each(body.bootstrap_room, n, "bootstrap_room")
    hosts = _each(body.bootstrap_host, n, "bootstrap_host")
    ports = _each(body.bootstrap_port, n, "bootstrap_port")
    for request, room, host, port in zip(requests, rooms, hosts, ports):
        if room is None or host is None:
            raise bad_request(
                "bootstrap_room and bootstrap_host must not be null", "bootstrap_room"
            )
        port = args.disaggregation_bootstrap_port if port is None else port
        request.bootstrap = Bootstrap(host=host, port=int(port), room=int(room))
