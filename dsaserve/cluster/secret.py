"""The cluster secret: one string every process of a deployment holds, and nobody else.

`--cluster-secret`, else `$DSASERVE_CLUSTER_SECRET`, else SGLang's
`$SGLANG_DISAGGREGATION_BOOTSTRAP_AUTH_TOKEN`, else the API key (`--api-key`,
`$DSASERVE_API_KEY`), as SGLang's bootstrap falls back to it. Each surface uses its own key
derived from it (HMAC-SHA256 with a label), so a key leaked from one (say, HiCache's) says
nothing about another's.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Any

SECRET_ENV = "DSASERVE_CLUSTER_SECRET"
SECRET_HINT = f"--cluster-secret (or ${SECRET_ENV})"


def cluster_secret(args: Any) -> str | None:
    """The deployment's secret, or None: then internal surfaces stay on loopback."""
    return args.cluster_secret or args.api_key or None


def derive(secret: str, label: str) -> bytes:
    """A 32-byte key for one surface (`label`), derived from the secret."""
    return hmac.new(secret.encode(), f"dsaserve/{label}".encode(), hashlib.sha256).digest()


def bearer(secret: str | None) -> dict[str, str]:
    """The header that authenticates a request to another process's HTTP surface."""
    return {"Authorization": f"Bearer {secret}"} if secret else {}


def bearer_ok(header: str | None, secret: str | None) -> bool:
    """Whether an Authorization header carries the secret (always, when there is none)."""
    if not secret:
        return True
    scheme, _, given = (header or "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(given.encode(), secret.encode())
