"""What a role server (`--role prefill|decode`) trusts of a request's `kv_transfer_params` (issue 48): only what
`jaxserve router` and the prefill servers wrote, proven by their HMACs under the shared secret
(`--kv-transfer-secret`, or JAXSERVE_KV_SECRET), and, on a decode server given `--kv-transfer-peers`, only KV ports on
that list. Everything is checked before the decode server connects anywhere; every refusal of params says the same
thing whatever they name, so that a client learns nothing of the network from it (no port-scan oracle)."""
from __future__ import annotations

import dataclasses
import ipaddress
import time
from typing import Callable

from jaxserve.openai.errors import ApiError
from jaxserve.openai.kv_transfer_params import (
    CLOCK_SKEW_S,
    FIELD,
    SECRET_ENV,
    RemoteKV,
    check_secret,
    router_verified,
)

NOT_AUTHENTICATED = (f"{FIELD} are not authenticated: role servers serve only requests sent by `jaxserve router` "
                     "sharing their --kv-transfer-secret")


@dataclasses.dataclass(frozen=True)
class KVTrust:
    """secret: shared by the router and every role server (None: this server serves no kv_transfer_params at all);
    peers: the prefill KV ports a decode server fetches from, as (host, port or None for any port) (None: any the
    prefill servers' MACs vouch for)."""
    secret: bytes | None = None
    peers: frozenset[tuple[str, int | None]] | None = None
    clock: Callable[[], float] = time.time

    @classmethod
    def of(cls, secret: str | bytes | None, peers: str | None = None) -> "KVTrust":
        """From the flags' values (a ValueError naming the flag if one is malformed)."""
        return cls(check_secret(secret), parse_peers(peers) if peers is not None else None)

    def require_secret(self, role: str) -> None:
        if self.secret is None:
            raise ApiError(400, f"this {role} server has no KV transfer secret (--kv-transfer-secret or "
                                f"{SECRET_ENV}): it serves no {FIELD}", FIELD)

    def check_router(self, params: dict, body: dict) -> None:
        """A 400 unless a prefill request's params carry the router's MAC for this body (the body without them)."""
        assert self.secret is not None  # (require_secret first)
        if not router_verified(self.secret, params, body, self.clock()):
            raise ApiError(400, NOT_AUTHENTICATED, FIELD)

    def check_remote(self, remote: RemoteKV) -> None:
        """A 400 unless a prefill server wrote these params (unchanged) and, with peers, names a KV port on the list."""
        assert self.secret is not None
        if not remote.verified(self.secret):
            raise ApiError(400, NOT_AUTHENTICATED, FIELD)
        if self.clock() > remote.expires + CLOCK_SKEW_S:  # (the prefill server's clock may be behind)
            raise ApiError(400, f"{FIELD} have expired: the prefill server has dropped the pages", FIELD)
        host = normal_host(remote.remote_host)
        if self.peers is not None and not {(host, remote.remote_port), (host, None)} & self.peers:
            raise ApiError(400, f"{FIELD} name a KV port not on this decode server's --kv-transfer-peers", FIELD)


def normal_host(host: str) -> str:
    """A host as --kv-transfer-peers compares it: an IP address in one form (an IPv4-mapped IPv6 address as the IPv4
    one, an IPv6 address compressed and in lower case), a name in lower case (names are case-blind). Nothing is
    resolved: a name on the list matches only params naming it, and an address only params naming that address."""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return host.lower()
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return str(address.ipv4_mapped)
    return str(address)


def parse_peers(spec: str) -> frozenset[tuple[str, int | None]]:
    """--kv-transfer-peers "HOST[:PORT],..." ([v6]:PORT for an IPv6 address) as (host, port or None), each host in
    its normal form (normal_host)."""
    peers = set()
    for item in (p.strip() for p in spec.split(",")):
        host, port = item, None
        if item.startswith("["):
            host, _, rest = item[1:].partition("]")
            port = rest[1:] if rest.startswith(":") else (None if not rest else "?")
        elif item.count(":") == 1:
            host, port = item.split(":")
        try:
            if ":" in host:
                ipaddress.IPv6Address(host)
            number = None if port is None else int(port)
        except ValueError:
            number = -1
        if not host or (number is not None and not 0 < number < 65536):
            raise ValueError(f"--kv-transfer-peers: {item!r} is not HOST, HOST:PORT or [IPv6]:PORT")
        peers.add((normal_host(host), number))
    return frozenset(peers)
