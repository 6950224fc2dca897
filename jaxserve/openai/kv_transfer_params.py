"""`kv_transfer_params`, the field that carries disaggregated prefill across servers, typed: parsed and checked once
where it comes in, written back with `to_json` where it goes out (jax-free: the router reads it too).

Three forms travel (vLLM's names):
- the router to a prefill server: {"do_remote_decode": true} (hand the request's KV pages off after its first token);
- a prefill server's answer: where the pages wait and what they hold (`RemoteKV`);
- the router to a decode server: that answer with {"do_remote_prefill": true} (fetch those pages, decode the rest).
"""
from __future__ import annotations

import dataclasses
import typing

from jaxserve.openai.http import KV_TRANSFER_FIELD

FIELD = KV_TRANSFER_FIELD


class KVTransferParamsError(ValueError):
    """kv_transfer_params that do not hold what their reader needs (the message names the field)."""


@dataclasses.dataclass(frozen=True)
class RemoteKV:
    """A request's KV pages waiting on a prefill server for a decode server to fetch, and what they hold."""
    transfer_id: str
    remote_host: str  # the prefill server's KV server
    remote_port: int
    first_token_id: int  # the token sampled after the prompt, on the prefill server
    num_cached: int  # tokens whose K/V the pages hold
    num_prompt_tokens: int
    prompt_digest: int  # crc32 of the prompt's token ids: the decode server must have tokenized the same prompt

    @classmethod
    def from_json(cls, value) -> "RemoteKV":
        """KVTransferParamsError unless value is an object holding every field with its type (a bool is no int)."""
        if not isinstance(value, dict):
            raise KVTransferParamsError(f"{FIELD} must be an object")
        for name, kind in typing.get_type_hints(cls).items():
            got = value.get(name)
            if not isinstance(got, kind) or isinstance(got, bool):
                raise KVTransferParamsError(f"{FIELD}.{name} must be a {kind.__name__}")
        return cls(**{f.name: value[f.name] for f in dataclasses.fields(cls)})

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class KVTransferParams:
    """What a request to a role server (`jaxserve serve --role prefill|decode`) says of its KV transfer: to a prefill
    server, do_remote_decode; to a decode server, do_remote_prefill and the pages to fetch."""
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
