"""A server's side of disaggregated prefill across servers (`jaxserve serve --role prefill|decode`, driven by
`jaxserve router`): a request's `kv_transfer_params` checked, the prefill side's hand-off put where decode servers
fetch it, the decode side's fetch.

Prefill (`PrefillSide`): a request must carry {"do_remote_decode": true}, for one sequence (n = 1, one prompt); its
engine ends it once the first token is out, and its KV pages (trimmed to the prompt's, copied to the host off the
event loop) wait in a KVStore, served by a KVServer, under the request's id; the answer carries the params the
decode server needs. A request that its first token ended is answered whole and holds nothing.

Decode (`fetch_prefilled`): a request must carry {"do_remote_prefill": true, transfer_id, remote_host, remote_port,
first_token_id, num_cached, num_prompt_tokens, prompt_digest}; the prompt must tokenize as on the prefill server
(a 400 otherwise), then the pages are fetched before the request is added (a failed fetch is a 502 and adds
nothing), and the answer holds what follows the first token, with the fetch's seconds and bytes in its headers.

Neither role serves a request that does not come this way (400): a prefill engine decodes nothing, and a decode
engine is sized for decoding.
"""
from __future__ import annotations

import asyncio
import time
import zlib

import numpy as np

from jaxserve.engine.async_engine import Prefilled
from jaxserve.cache import pages_needed
from jaxserve.cache.transfer import kv_bytes, trimmed
from jaxserve.openai.http import KV_BYTES_HEADER, KV_SECONDS_HEADER, KV_TRANSFER_FIELD
from jaxserve.kv_transfer import KVServer, KVStore, KVTransferError, fetch_pages
from jaxserve.kv_transfer.store import KVStoreFull
from jaxserve.openai.api import ApiError

FIELD = KV_TRANSFER_FIELD
WILDCARD_HOSTS = {"", "0.0.0.0", "::"}
_DECODE_KEYS = {"do_remote_prefill": bool, "transfer_id": str, "remote_host": str, "remote_port": int,
                "first_token_id": int, "num_cached": int, "num_prompt_tokens": int, "prompt_digest": int}


def take_params(body: dict, role: str) -> dict | None:
    """Removes `kv_transfer_params` from the body (it is no sampling field) and checks it against the server's role:
    the params, or None for a plain request to a plain server."""
    params = body.pop(FIELD, None)
    if role == "both":
        if params is not None:
            raise ApiError(400, f"{FIELD} is for servers started with --role prefill or decode", FIELD)
        return None
    side = "do_remote_decode" if role == "prefill" else "do_remote_prefill"
    if not (isinstance(params, dict) and params.get(side) is True):
        raise ApiError(400, f"this is a {role} server (--role {role}): requests come through `jaxserve router` "
                            f"({FIELD} with {side}: true)", FIELD)
    if role == "decode":
        for key, kind in _DECODE_KEYS.items():
            if not isinstance(params.get(key), kind) or isinstance(params[key], bool) and kind is not bool:
                raise ApiError(400, f"{FIELD}.{key} must be a {kind.__name__}", FIELD)
    return params


def prompt_digest(token_ids) -> int:
    """crc32 of the prompt's token ids (as int32): a decode server that tokenizes the request otherwise (another
    tokenizer or chat template) must not decode on pages computed for other tokens."""
    return zlib.crc32(np.asarray(token_ids, np.int32).tobytes())


def check_prompt(params: dict, token_ids) -> None:
    """A 400 unless this server's prompt tokens are the prefill server's (checked before anything is fetched)."""
    n, want = len(token_ids), params["num_prompt_tokens"]
    if n != want or prompt_digest(token_ids) != params["prompt_digest"]:
        what = f"{n} tokens, the prefill server's {want}" if n != want else f"other ids than the prefill server's"
        raise ApiError(400, f"the prompt tokenizes otherwise on this decode server ({what}): serve the same "
                            f"tokenizer and chat template on both", FIELD)


def one_sequence(seqs: int) -> None:
    if seqs != 1:
        raise ApiError(400, f"disaggregated prefill runs one sequence per request (n = 1, one prompt), this one asks "
                            f"for {seqs}", "n")


class PrefillSide:
    """The KV store of a prefill server and the KVServer that serves it (`start` / `close` in its event loop).
    max_bytes: the store's bound; a prefill server whose store is full answers 503 (the router tries another)."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, ttl_s: float = 60.0, max_bytes: int | None = None):
        self.store = KVStore(ttl_s, max_bytes=max_bytes)
        self.kv_server = KVServer(self.store, host, port)

    async def start(self) -> None:
        await self.kv_server.start()

    async def close(self) -> None:
        await self.kv_server.close()

    def advertised_host(self, local_host: str) -> str:
        """The KV server's address for decode servers: its own, or, bound to a wildcard (0.0.0.0, ::) that no one
        can connect to, the local address the router's HTTP request came in on (reachable from the router's side of
        the network, and so, as a rule, from the decode servers')."""
        return local_host if self.kv_server.host in WILDCARD_HOSTS else self.kv_server.host

    def check_room(self) -> None:
        """A 503 when the store is full: checked before the prefill runs (a put may still find it full: see
        hand_off)."""
        if self.store.full():
            raise ApiError(503, f"this prefill server holds {self.store.max_bytes} bytes of KV transfers waiting to "
                                f"be fetched (--kv-transfer-max-bytes): retry later or on another")

    async def hand_off(self, transfer_id: str, hand_off, page_size: int, local_host: str) -> dict:
        """Puts a HandOff's pages (trimmed to its cached tokens, on the host: off the event loop) in the store; the
        params that fetch them (a 503 if the store is full: the pages are dropped). local_host: the address the
        request came in on (see advertised_host)."""
        kv = await asyncio.to_thread(trimmed, hand_off.kv, pages_needed(hand_off.num_cached, page_size))
        try:
            self.store.put(transfer_id, kv)
        except KVStoreFull as e:
            raise ApiError(503, f"this prefill server cannot hold the request's KV pages: {e}") from None
        return {"transfer_id": transfer_id, "remote_host": self.advertised_host(local_host),
                "remote_port": self.kv_server.port,
                "first_token_id": hand_off.seq.output_token_ids[0], "num_cached": hand_off.num_cached,
                "num_prompt_tokens": len(hand_off.seq.prompt_token_ids),
                "prompt_digest": prompt_digest(hand_off.seq.prompt_token_ids)}


async def fetch_prefilled(params: dict, timeout_s: float, max_bytes: int | None = None) -> tuple[Prefilled, dict]:
    """The pages the params name, fetched (at most max_bytes: what the prompt's pages take in this server's cache): (Prefilled, the response
    headers reporting the fetch). A failed fetch is a 502."""
    started = time.perf_counter()
    try:
        kv = await fetch_pages(params["remote_host"], params["remote_port"], params["transfer_id"], timeout_s,
                               max_bytes=max_bytes)
    except KVTransferError as e:
        raise ApiError(502, f"fetching the prefilled KV pages failed: {e}", FIELD) from None
    headers = {KV_SECONDS_HEADER: f"{time.perf_counter() - started:.6f}", KV_BYTES_HEADER: str(kv_bytes(kv))}
    return Prefilled(kv, params["num_cached"], params["first_token_id"], started), headers
