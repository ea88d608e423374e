"""Authenticated ZMQ sockets between processes of one deployment: CURVE keyed by the secret.

With a cluster secret every socket a role binds is a CURVE server and every socket it connects is
a CURVE client, both with keypairs derived from the secret; a ZAP handler (one thread per
context) admits only the client key derived from it. So the check happens once per connection,
in libzmq's handshake: a peer without the secret never completes it, its bytes never reach our
parser, and frames travel encrypted (the decode's pool addresses, transfer metadata and room ids
among them). A MAC per frame would also authenticate, but leave those in clear and still hand
every unauthenticated byte to our parser. Without a secret, sockets are plain (and bound to
loopback, cluster/addresses.py).
"""

from __future__ import annotations

import logging
import threading
import time

import zmq
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85

from dsaserve.cluster.secret import derive

logger = logging.getLogger(__name__)
MAX_MESSAGE_BYTES = 32 * 1024 * 1024  # larger inbound messages drop the connection (libzmq)
DENIED_LOG_INTERVAL_S = 60.0


class ZmqAuth:
    """Applies the deployment's CURVE keys to the sockets of one `zmq.Context`."""

    def __init__(self, context: zmq.Context, secret: str | None) -> None:
        self.enabled = bool(secret)
        self.authenticator: ThreadAuthenticator | None = None
        if not secret:
            return
        self.server_secret = z85.encode(derive(secret, "zmq/server"))
        self.server_public = zmq.curve_public(self.server_secret)
        self.client_secret = z85.encode(derive(secret, "zmq/client"))
        self.client_public = zmq.curve_public(self.client_secret)
        self.authenticator = ThreadAuthenticator(context, log=logging.getLogger("dsaserve.zap"))
        self.authenticator.start()
        self.authenticator.configure_curve_callback("*", _OnlyKey(self.client_public))

    def serve(self, sock: zmq.Socket) -> zmq.Socket:
        """Before `bind`: a socket that accepts only peers holding the secret."""
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        if self.enabled:
            sock.curve_server = True
            sock.curve_secretkey = self.server_secret
            sock.curve_publickey = self.server_public
        return sock

    def dial(self, sock: zmq.Socket) -> zmq.Socket:
        """Before `connect`: a socket that proves it holds the secret."""
        if self.enabled:
            sock.curve_serverkey = self.server_public
            sock.curve_publickey = self.client_public
            sock.curve_secretkey = self.client_secret
        return sock

    def close(self) -> None:
        if self.authenticator is not None:
            self.authenticator.stop()
            self.authenticator = None


class _OnlyKey:
    """ZAP: admit the one client key derived from the secret; log refusals (rate-limited)."""

    def __init__(self, key: bytes) -> None:
        self.key = key
        self.last_log = -DENIED_LOG_INTERVAL_S
        self.lock = threading.Lock()

    def callback(self, domain: str, key: bytes) -> bool:
        if key == self.key:
            return True
        with self.lock:
            now = time.monotonic()
            if now - self.last_log >= DENIED_LOG_INTERVAL_S:
                self.last_log = now
                logger.warning("refused a ZMQ peer whose key is not the cluster secret's")
        return False
