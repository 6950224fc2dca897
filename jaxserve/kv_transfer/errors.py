"""The one error a KV transfer raises, whatever broke: a caller fails that request and frees its pages."""


class KVTransferError(RuntimeError):
    """A KV transfer failed: corrupt or truncated data, an unknown or expired transfer id, a timeout, a refused or
    dropped connection. The message says which."""
