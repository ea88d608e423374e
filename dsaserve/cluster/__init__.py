"""What the processes of one deployment share to trust each other (docs/server.md, "Ports").

- `secret.py`: the cluster secret (`--cluster-secret`, the API key by default) and the keys
  derived from it for each surface.
- `addresses.py`: where internal surfaces listen (loopback unless a secret is set) and the
  address a process advertises to its peers.
- `zmq_auth.py`: ZMQ sockets between roles, authenticated by a CURVE handshake keyed by the secret.
- `frame_log.py`: one rate-limited log line per kind of frame dropped from another process.
"""
