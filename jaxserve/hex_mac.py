"""HMAC-SHA256 tags as the KV transfer's parties write and check them: hex, over a canonical encoding (compact ASCII
JSON of a label and the fields). One rule for both users, the kv_transfer_params' MACs (`openai/`) and the KV port's
fetch requests (`kv_transfer/`): a tag given is compared only if it is one (64 lowercase hex digits), since
`hmac.compare_digest` raises a TypeError on non-ASCII text, and a client's '\\u00e9' must be a refusal, not a 500.
A leaf: stdlib only."""
from __future__ import annotations

import hashlib
import hmac
import json
import re

CLOCK_SKEW_S = 30  # what the hosts' clocks may differ by (expiries are wall-clock seconds, hosts apart)
_HEX_TAG = re.compile(r"[0-9a-f]{64}")  # what `mac` writes, and all a tag given may be


def mac(secret: bytes, label: str, fields: list) -> str:
    """HMAC-SHA256 (hex) over [label, *fields] as compact ASCII JSON: unambiguous, and the same on every host."""
    message = json.dumps([label, *fields], separators=(",", ":"), ensure_ascii=True).encode()
    return hmac.new(secret, message, hashlib.sha256).hexdigest()


def is_hex_tag(given) -> bool:
    """Whether `given` has a tag's form (a str of 64 lowercase hex digits): nothing else is compared."""
    return isinstance(given, str) and _HEX_TAG.fullmatch(given) is not None


def mac_matches(secret: bytes, label: str, fields: list, given) -> bool:
    """Whether `given` is the MAC of [label, *fields] under the secret (in constant time); False for anything that
    is not a tag's form, whatever its type or text."""
    return is_hex_tag(given) and hmac.compare_digest(mac(secret, label, fields), given)
