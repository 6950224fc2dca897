"""Moving a sequence's KV pages between processes (prefill server -> decode server, issue 26).

The prefill side puts a handed-off sequence's pages in a `KVStore` under a transfer id; a `KVServer` in its event
loop serves them; the decode side calls `fetch_pages(host, port, transfer_id, timeout)`. Two paths behind that:
bytes over the KVServer's socket (`codec`: a checked header, raw arrays, crc32; works everywhere), or, when both
sides hold a `JaxTransferEndpoint`, `jax.experimental.transfer` pulling device buffers directly.
"""
from jaxserve.kv_transfer.client import fetch_pages
from jaxserve.kv_transfer.codec import decode_pages, encode_pages
from jaxserve.kv_transfer.errors import KVTransferError
from jaxserve.kv_transfer.jax_transfer import JaxTransferEndpoint
from jaxserve.kv_transfer.server import KVServer
from jaxserve.kv_transfer.store import KVStore

__all__ = ["JaxTransferEndpoint", "KVServer", "KVStore", "KVTransferError", "decode_pages", "encode_pages",
           "fetch_pages"]
