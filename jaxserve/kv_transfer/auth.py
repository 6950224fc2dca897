"""Who may fetch a transfer, and what its pages are: the fetch request's MAC under the secret the prefill and decode
servers share (the KV port serves nobody else), and a digest of the pages that the prefill server's MAC covers (so a
decode server decodes only on the pages that server computed for that prompt). jax-free, numpy only."""
from __future__ import annotations

import hashlib
import json

import numpy as np

from jaxserve.hex_mac import CLOCK_SKEW_S, mac, mac_matches
from jaxserve.kv_transfer.layout import flatten_pages

FETCH_TTL_S = 60  # a fetch request's MAC is good this long (it goes out at once; the hosts' clocks may differ)


def fetch_mac(secret: bytes, transfer_id: str, expires: int) -> str:
    return mac(secret, "kv_fetch", [transfer_id, expires])


def fetch_auth(secret: bytes | None, transfer_id: str, now: float) -> dict:
    """The fields a fetch request carries to a KVServer with this secret (none without one)."""
    if secret is None:
        return {}
    expires = int(now) + FETCH_TTL_S
    return {"expires": expires, "mac": fetch_mac(secret, transfer_id, expires)}


def fetch_verified(secret: bytes, request: dict, now: float) -> bool:
    """Whether a fetch request was made by a holder of the secret, for its transfer id, and is unexpired, its expiry
    no later than a client writes one (now + FETCH_TTL_S), give or take the clocks' skew either way: a MAC that
    expires far in the future (a holder's bug, or one taken off the wire) is no fetch request good for ever."""
    expires, transfer_id = request.get("expires"), request.get("transfer_id")
    if not (isinstance(expires, int) and not isinstance(expires, bool) and isinstance(transfer_id, str)):
        return False
    if not now - CLOCK_SKEW_S <= expires <= now + FETCH_TTL_S + CLOCK_SKEW_S:
        return False
    return mac_matches(secret, "kv_fetch", [transfer_id, expires], request.get("mac"))


def pages_digest(kv) -> str:
    """sha256 (hex) of KVPages: each array's kind, dtype, shape and bytes, in order. Takes a while for big pages
    (about 1.5 GB/s): call it off the event loop."""
    kinds, arrays = flatten_pages(kv)
    h = hashlib.sha256(json.dumps(kinds).encode())
    for a in arrays:
        a = np.ascontiguousarray(np.asarray(a))
        h.update(json.dumps([a.dtype.name, list(a.shape)]).encode())
        h.update(memoryview(a.reshape(-1).view(np.uint8)))
    return h.hexdigest()
