"""Where internal surfaces listen, and the address a process gives its peers.

Internal surfaces (the PD bootstrap server and KV ZMQ ports, the torch.distributed store and the
rank channels) listen on `--host` only when a cluster secret authenticates them, or when `--host`
is a loopback address; flags that would open one elsewhere without a secret are refused at start
(`exposure_error`).

`advertise_host` is what a process registers for its peers to reach it; never a wildcard:
`--disaggregation-advertise-host`, else SGLang's `$SGLANG_HOST_IP` (or `$HOST_IP`), else a
concrete `--host`, else the address of the interface that reaches the peer (a decode: the
prefill's bootstrap host) or `--dist-init-addr` (node 0: that address itself), else that of the
default route, else 127.0.0.1. Finding an interface sends no packet (a UDP socket's connect).
"""

from __future__ import annotations

import fcntl
import ipaddress
import os
import socket
import struct
import sys
from typing import Any

from dsaserve.cluster.secret import SECRET_HINT, cluster_secret

ADVERTISE_ENVS = ("SGLANG_HOST_IP", "HOST_IP")  # SGLang's get_local_ip_auto reads these
WILDCARDS = ("", "0.0.0.0", "::", "[::]", "*")
DEFAULT_ROUTE_PROBE = "192.0.2.1"  # TEST-NET-1: only the routing table is consulted
SIOCGIFADDR = 0x8915  # Linux: an interface's IPv4 address


def is_wildcard(host: str) -> bool:
    return host in WILDCARDS


def is_loopback(host: str) -> bool:
    """Whether every address `host` names is a loopback one."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(i[4][0]).is_loopback for i in infos)


def split_host_port(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def tcp_endpoint(host: str, port: int | None) -> str:
    """A ZMQ address (`port` None: for `bind_to_random_port`)."""
    where = f"[{host}]" if ":" in host else host
    return f"tcp://{where}" if port is None else f"tcp://{where}:{port}"


def exposure_error(args: Any) -> str | None:
    """Why these flags would open an internal surface beyond loopback without a secret."""
    if cluster_secret(args):
        return None
    if args.disaggregation_mode != "null" and not is_loopback(args.host):
        return (f"--host {args.host}: the {args.disaggregation_mode}'s bootstrap and KV ports "
                f"would listen beyond loopback unauthenticated; set {SECRET_HINT} on every role, "
                "or use --host 127.0.0.1")  # fmt: skip
    if args.dist_init_addr and not is_loopback(split_host_port(args.dist_init_addr)[0]):
        return (f"--dist-init-addr {args.dist_init_addr}: the torch.distributed store and rank "
                f"channels would listen beyond loopback unauthenticated; set {SECRET_HINT} on "
                "every node")  # fmt: skip
    return None


def internal_host(args: Any) -> str:
    """The address internal surfaces bind: `--host`, or loopback when nothing authenticates."""
    if cluster_secret(args) or is_loopback(args.host):
        return args.host
    return "127.0.0.1"


def advertise_host(args: Any, peer: str | None = None) -> str:
    """The address this process registers for peers (`peer`: a host it will be reached from)."""
    given = args.disaggregation_advertise_host or next(
        (os.environ[name] for name in ADVERTISE_ENVS if os.environ.get(name)), None
    )
    if given:
        return given.strip().strip("[]")
    if not is_wildcard(args.host):
        return args.host
    dist = _dist_host(args)
    if dist and not peer and is_local_address(dist):  # node 0: its own address there
        return dist
    for target in (peer, dist, DEFAULT_ROUTE_PROBE):
        found = route_source(target) if target else None
        if found:
            return found
    return "127.0.0.1"


def _dist_host(args: Any) -> str | None:
    return split_host_port(args.dist_init_addr)[0] if args.dist_init_addr else None


def route_source(host: str) -> str | None:
    """This host's address on the interface the routing table picks to reach `host`."""
    try:
        family, _, _, _, address = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect(address)
            return probe.getsockname()[0]
    except (OSError, IndexError):
        return None


def is_local_address(host: str) -> bool:
    """Whether `host` is an address of this machine (one a socket can bind)."""
    try:
        family, _, _, _, address = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0]
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.bind(address)
            return True
    except (OSError, IndexError):
        return False


def interface_of(address: str) -> str | None:
    """The name of this machine's interface that holds `address` (Linux, IPv4; else None), for
    GLOO_SOCKET_IFNAME and the like."""
    if sys.platform != "linux":
        return None
    names = [name for _, name in socket.if_nameindex()]
    if is_loopback(address):  # all of 127/8 is on the loopback interface
        return next((n for n in names if (_ipv4_of(n) or "").startswith("127.")), None)
    return next((n for n in names if _ipv4_of(n) == address), None)


def _ipv4_of(name: str) -> str | None:
    request = struct.pack("256s", name[:15].encode())
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            packed = fcntl.ioctl(probe.fileno(), SIOCGIFADDR, request)
        except OSError:
            return None
    return socket.inet_ntoa(packed[20:24])
