"""`kv_transfer_params`, the field that carries disaggregated prefill across servers, typed: parsed and checked once
where it comes in, written back with `to_json` where it goes out (jax-free: the router reads it too).

Three forms travel (vLLM's names):
- the router to a prefill server: {"do_remote_decode": true} with the router's MAC (`router_auth`);
- a prefill server's answer: where the pages wait and what they hold (`RemoteKV`), MACed by the prefill server;
- the router to a decode server: that answer with {"do_remote_prefill": true} (fetch those pages, decode the rest).

A client must not be able to write any of them (issue 48: a decode server that trusts them connects wherever it is
told, and decodes a prompt on pages the client picked), so each carries an HMAC-SHA256 under a secret the router and
the role servers share (`--kv-transfer-secret`, or JAXSERVE_KV_SECRET): over a canonical encoding (a JSON list) of
every field and an expiry; the router's covers a digest of the request body it goes with.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import typing

from jaxserve.hex_mac import CLOCK_SKEW_S, mac, mac_matches
from jaxserve.openai.http import KV_TRANSFER_FIELD

FIELD = KV_TRANSFER_FIELD
SECRET_ENV = "JAXSERVE_KV_SECRET"
MIN_SECRET_CHARS = 16
ROUTER_AUTH_TTL_S = 60  # the router's MAC on a prefill request is good for this long (it is sent at once)
MAX_STRING_CHARS = 256  # a transfer id or a host name: the prefill server's own, short


class KVTransferParamsError(ValueError):
    """kv_transfer_params that do not hold what their reader needs (the message names the field)."""


def check_secret(secret: str | bytes | None) -> bytes | None:
    """The shared secret as bytes (None stays None); a ValueError if it is too short to be one."""
    if secret is None:
        return None
    raw = secret.encode() if isinstance(secret, str) else bytes(secret)
    if len(raw) < MIN_SECRET_CHARS:
        raise ValueError(f"the KV transfer secret must be at least {MIN_SECRET_CHARS} characters (a random one: "
                         "`openssl rand -hex 32`)")
    return raw


def body_digest(body: dict) -> str:
    """sha256 of a request body without its kv_transfer_params, canonically encoded (a JSON value read back and
    written again encodes the same: the router's digest is the server's)."""
    rest = {k: v for k, v in body.items() if k != FIELD}
    return hashlib.sha256(json.dumps(rest, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
                          .encode()).hexdigest()


def router_auth(secret: bytes, body: dict, now: float) -> dict:
    """The fields the router adds to {"do_remote_decode": true} for the prefill server to check (`router_verified`):
    only the router may have a prefill server hold pages for a transfer."""
    expires = int(now) + ROUTER_AUTH_TTL_S
    return {"expires": expires, "mac": mac(secret, "do_remote_decode", [expires, body_digest(body)])}


def router_verified(secret: bytes, params: dict, body: dict, now: float) -> bool:
    """Whether a prefill request's params carry the router's MAC for this body, unexpired."""
    expires = params.get("expires")
    if not isinstance(expires, int) or isinstance(expires, bool) or now > expires + CLOCK_SKEW_S:
        return False
    return mac_matches(secret, "do_remote_decode", [expires, body_digest(body)], params.get("mac"))


@dataclasses.dataclass(frozen=True)
class RemoteKV:
    """A request's KV pages waiting on a prefill server for a decode server to fetch, and what they hold; `mac` is
    the prefill server's over every other field."""
    transfer_id: str
    remote_host: str  # the prefill server's KV server
    remote_port: int
    first_token_id: int  # the token sampled after the prompt, on the prefill server
    num_cached: int  # tokens whose K/V the pages hold
    num_prompt_tokens: int
    prompt_digest: str  # sha256 of the prompt's token ids: the decode server must have tokenized the same prompt
    kv_digest: str  # sha256 of the pages (kv_transfer.auth.pages_digest): the decode server checks what it fetched
    expires: int  # wall-clock seconds: unfetched pages are gone by then
    mac: str

    @classmethod
    def from_json(cls, value) -> "RemoteKV":
        """KVTransferParamsError unless value is an object holding every field with its type (a bool is no int),
        each in its range."""
        if not isinstance(value, dict):
            raise KVTransferParamsError(f"{FIELD} must be an object")
        for name, kind in typing.get_type_hints(cls).items():
            got = value.get(name)
            if not isinstance(got, kind) or isinstance(got, bool):
                raise KVTransferParamsError(f"{FIELD}.{name} must be a {kind.__name__}")
            if kind is str and not 0 < len(got) <= MAX_STRING_CHARS:
                raise KVTransferParamsError(f"{FIELD}.{name} must be 1 to {MAX_STRING_CHARS} characters")
        remote = cls(**{f.name: value[f.name] for f in dataclasses.fields(cls)})
        remote.check_ranges()
        return remote

    def check_ranges(self) -> None:
        # A token id is an int32 on device: past it, the engine's arrays would fail (a 500), not this request.
        for name, low, high in (("remote_port", 1, 65535), ("first_token_id", 0, 2**31 - 1),
                                ("num_prompt_tokens", 1, 2**31 - 1), ("num_cached", 0, self.num_prompt_tokens)):
            if not low <= getattr(self, name) <= high:
                raise KVTransferParamsError(f"{FIELD}.{name} must be in [{low}, {high}], got {getattr(self, name)}")

    def _signed_fields(self) -> list:
        return [getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "mac"]

    def signed(self, secret: bytes) -> "RemoteKV":
        """These params with the MAC of the prefill server holding the secret."""
        return dataclasses.replace(self, mac=mac(secret, "remote_kv", self._signed_fields()))

    def verified(self, secret: bytes) -> bool:
        """Whether a server sharing the secret wrote these params (every field as it wrote them)."""
        return mac_matches(secret, "remote_kv", self._signed_fields(), self.mac)

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class KVTransferParams:
    """What a request to a role server (`jaxserve serve --role prefill|decode`) says of its KV transfer: to a prefill
    server, do_remote_decode (and the router's MAC, checked by the server: `router_verified`); to a decode server,
    do_remote_prefill and the pages to fetch."""
    do_remote_decode: bool = False
    do_remote_prefill: bool = False
    remote: RemoteKV | None = None  # with do_remote_prefill

    @classmethod
    def for_role(cls, value, role: str) -> "KVTransferParams":
        """A request's params as a server of `role` ("prefill" or "decode") takes them: KVTransferParamsError
        unless they ask that side (and, to a decode server, name the pages to fetch). What the other side would
        read is not checked, nor kept."""
        side = "do_remote_decode" if role == "prefill" else "do_remote_prefill"
        if not (isinstance(value, dict) and value.get(side) is True):
            raise KVTransferParamsError(f"this is a {role} server (--role {role}): requests come through "
                                        f"`jaxserve router` ({FIELD} with {side}: true)")
        if role == "prefill":
            return cls(do_remote_decode=True)
        return cls(do_remote_prefill=True, remote=RemoteKV.from_json(value))

    def to_json(self) -> dict:
        """The wire form: the sides asked (only those), and the pages' fields beside them."""
        flags = {name: True for name in ("do_remote_decode", "do_remote_prefill") if getattr(self, name)}
        return {**flags, **(self.remote.to_json() if self.remote is not None else {})}
