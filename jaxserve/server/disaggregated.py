"""A server's side of disaggregated prefill across servers (`jaxserve serve --role prefill|decode`, driven by
`jaxserve router`): a request's `kv_transfer_params` checked, the prefill side's hand-off put where decode servers
fetch it, the decode side's fetch.

Prefill (`PrefillSide`): a request must carry {"do_remote_decode": true} with the router's MAC (`KVTrust`), for one
sequence (n = 1, one prompt); its engine ends it once the first token is out, and its KV pages (trimmed to the
prompt's, copied to the host off the event loop) wait in a KVStore, served by a KVServer to holders of the secret
only, under the request's id; the answer carries the params the decode server needs, MACed, with digests of the
prompt's token ids and of the pages.

Decode (`fetch_prefilled`): a request must carry {"do_remote_prefill": true, transfer_id, remote_host, remote_port,
first_token_id, num_cached, num_prompt_tokens, prompt_digest, kv_digest, expires, mac}, the MAC checked (and the KV
port against --kv-transfer-peers) before anything else; the prompt must tokenize as on the prefill server (a 400
otherwise), then the pages are fetched and checked against kv_digest before the request is added (a failed fetch is
a 502 that says nothing of the peer, and adds nothing), and the answer holds what follows the first token, with the
fetch's seconds and bytes in its headers. So a decode server decodes a prompt only on the pages a prefill server
computed for it, and only such pages reach its prefix cache.

Neither role serves a request that does not come this way (400): a prefill engine decodes nothing, and a decode
engine is sized for decoding.
"""
from __future__ import annotations

import asyncio
import hashlib
import logging
import time

import numpy as np

from jaxserve.engine.client import HandedOff, Prefilled
from jaxserve.kv_transfer import KVServer, KVStore, KVTransferError, fetch_pages
from jaxserve.kv_transfer.auth import pages_digest
from jaxserve.kv_transfer.client import loop_run
from jaxserve.kv_transfer.store import KVStoreFull
from jaxserve.openai.errors import ApiError
from jaxserve.openai.http import KV_BYTES_HEADER, KV_SECONDS_HEADER
from jaxserve.openai.kv_transfer_params import FIELD, KVTransferParams, KVTransferParamsError, RemoteKV
from jaxserve.server.kv_trust import KVTrust

logger = logging.getLogger("jaxserve")

WILDCARD_HOSTS = {"", "0.0.0.0", "::"}
# What a prefill server holds waiting to be fetched, by default (--kv-transfer-max-bytes): the pages of about a
# hundred 1,000-token prompts of a 1B model; a decode server fetches within milliseconds, so this is slack for bursts
# and stalls, and what transfers nobody fetches (a router that gave up, a dead decode server) can pin at most.
DEFAULT_MAX_BYTES = 4 << 30
FETCH_FAILED = "fetching the prefilled KV pages failed"  # all a client hears of it: nothing of the peer


def take_params(body: dict, role: str, trust: KVTrust) -> KVTransferParams | None:
    """Removes `kv_transfer_params` from the body (it is no sampling field) and checks it against the server's role
    and `trust` (the router's MAC to a prefill server; the prefill server's, and the peers list, to a decode server):
    the params, or None for a plain request to a plain server."""
    params = body.pop(FIELD, None)
    if role == "both":
        if params is not None:
            raise ApiError(400, f"{FIELD} is for servers started with --role prefill or decode", FIELD)
        return None
    try:
        checked = KVTransferParams.for_role(params, role)
    except KVTransferParamsError as e:
        raise ApiError(400, str(e), FIELD) from None
    trust.require_secret(role)
    if checked.remote is None:
        trust.check_router(params, body)
    else:
        trust.check_remote(checked.remote)
    return checked


def prompt_digest(token_ids) -> str:
    """sha256 of the prompt's token ids (as int32): a decode server that tokenizes the request otherwise (another
    tokenizer or chat template) must not decode on pages computed for other tokens, nor a client pass one prompt's
    pages off as another's (the prefill server's MAC covers this digest)."""
    return hashlib.sha256(np.asarray(token_ids, np.int32).tobytes()).hexdigest()


def check_prompt(remote: RemoteKV, token_ids, vocab_size: int) -> None:
    """A 400 unless this server's prompt tokens are the prefill server's and the first token is in this server's
    vocabulary (checked before anything is fetched)."""
    n, want = len(token_ids), remote.num_prompt_tokens
    if n != want or prompt_digest(token_ids) != remote.prompt_digest:
        what = f"{n} tokens, the prefill server's {want}" if n != want else "other ids than the prefill server's"
        raise ApiError(400, f"the prompt tokenizes otherwise on this decode server ({what}): serve the same "
                            f"tokenizer and chat template on both", FIELD)
    if not 0 <= remote.first_token_id < vocab_size:
        raise ApiError(400, f"{FIELD}.first_token_id must be in [0, {vocab_size}), got {remote.first_token_id}",
                       FIELD)


def one_sequence(seqs: int) -> None:
    if seqs != 1:
        raise ApiError(400, f"disaggregated prefill runs one sequence per request (n = 1, one prompt), this one asks "
                            f"for {seqs}", "n")


class PrefillSide:
    """The KV store of a prefill server and the KVServer that serves it (`start` / `close` in its event loop).
    max_bytes: the store's bound (None: none); a prefill server whose store is full answers 503 (the router tries
    another). trust: the secret its KV port and its answers' MACs use, and that the router's requests must carry (the
    server's own: see Server)."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, ttl_s: float = 60.0,
                 max_bytes: int | None = DEFAULT_MAX_BYTES, trust: KVTrust | None = None):
        self.trust = trust or KVTrust()
        self.store = KVStore(ttl_s, max_bytes=max_bytes)
        self.kv_server = KVServer(self.store, host, port, secret=self.trust.secret)

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

    async def hand_off(self, handed: HandedOff, local_host: str) -> RemoteKV:
        """Puts a handed-off request's pages (on the host: see EngineClient.handed_off) in the store, under its
        request id; where they wait and what they hold, MACed, for the answer (a 503 if the store is full: the pages
        are dropped). local_host: the address the request came in on (see advertised_host)."""
        assert self.trust.secret is not None  # (take_params served no do_remote_decode without one)
        digest = await asyncio.to_thread(pages_digest, handed.kv)  # (~1.5 GB/s: off the loop)
        try:
            self.store.put(handed.request_id, handed.kv)
        except KVStoreFull as e:
            raise ApiError(503, f"this prefill server cannot hold the request's KV pages: {e}") from None
        expires = int(self.trust.clock() + self.store.ttl_s) + 1
        return RemoteKV(handed.request_id, self.advertised_host(local_host), self.kv_server.port, handed.first_token,
                        handed.num_cached, len(handed.prompt_token_ids), prompt_digest(handed.prompt_token_ids),
                        digest, expires, "").signed(self.trust.secret)


async def fetch_prefilled(remote: RemoteKV, timeout_s: float, max_bytes: int | None,
                          trust: KVTrust) -> tuple[Prefilled, dict]:
    """The pages `remote` (checked by take_params) names, fetched (at most max_bytes: what the prompt's pages take
    in this server's cache) and checked against its kv_digest: (Prefilled, the response headers reporting the fetch).
    A failed fetch is a 502 that says only that (why is logged here): a client must not learn what answers where."""
    started = time.perf_counter()
    try:
        kv = await fetch_pages(remote.remote_host, remote.remote_port, remote.transfer_id, timeout_s,
                               max_bytes=max_bytes, secret=trust.secret)
        if await loop_run(pages_digest, kv) != remote.kv_digest:  # (on the import thread, as the checksum)
            raise KVTransferError("the pages fetched are not those the prefill server's MAC covers")
    except (KVTransferError, OSError, ValueError) as e:  # (ValueError: a host name no resolver takes, say)
        logger.warning("KV transfer %r from %s:%d failed: %s", remote.transfer_id, remote.remote_host,
                       remote.remote_port, e)
        raise ApiError(502, FETCH_FAILED, FIELD) from None
    prefilled = Prefilled(kv, remote.num_cached, remote.first_token_id, started)
    headers = {KV_SECONDS_HEADER: f"{time.perf_counter() - started:.6f}", KV_BYTES_HEADER: str(prefilled.num_bytes)}
    return prefilled, headers
