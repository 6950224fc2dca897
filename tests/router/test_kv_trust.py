"""kv_transfer_params' MACs (issue 48 item 2): what the prefill server writes verifies only unchanged and under its
secret; the router's MAC binds the body it goes with; --kv-transfer-peers parsing. jax-free, no server."""
import random

import pytest

from jaxserve.openai.errors import ApiError
from jaxserve.openai.kv_transfer_params import RemoteKV, body_digest, check_secret, router_auth, router_verified
from jaxserve.server.kv_trust import NOT_AUTHENTICATED, KVTrust, parse_peers

SECRET = b"unit-test-secret-0123456789"


def remote(rng: random.Random, **change) -> RemoteKV:
    fields = dict(transfer_id=f"cmpl-{rng.getrandbits(64):x}-0", remote_host="10.0.0.7", remote_port=8190,
                  first_token_id=rng.randrange(50_000), num_cached=rng.randrange(1, 100), num_prompt_tokens=100,
                  prompt_digest=f"{rng.getrandbits(256):064x}", kv_digest=f"{rng.getrandbits(256):064x}",
                  expires=2_000_000_000, mac="")
    return RemoteKV(**{**fields, **change})


def test_remote_kv_verifies_only_unchanged_and_under_its_secret():
    rng = random.Random(48)
    signed = remote(rng).signed(SECRET)
    assert signed.verified(SECRET) and RemoteKV.from_json(signed.to_json()).verified(SECRET)
    assert not signed.verified(b"another-secret-0123456789")
    for name, value in signed.to_json().items():
        if name != "mac":
            changed = value + 1 if isinstance(value, int) else value + "x"
            assert not RemoteKV(**{**signed.to_json(), name: changed}).verified(SECRET), name
    assert not remote(rng).verified(SECRET)  # no MAC at all


def test_the_routers_mac_binds_its_body_and_expires():
    body = {"model": "m", "prompt": "x" * 100, "temperature": 0.7, "stop": ["\n"], "logit_bias": {"5": -1e30}}
    params = {"do_remote_decode": True, **router_auth(SECRET, body, 1000.0)}
    assert router_verified(SECRET, params, dict(reversed(list(body.items()))), 1000.0)  # (key order is no matter)
    assert router_verified(SECRET, params, dict(body, kv_transfer_params=params), 1000.0)  # (they are not the body)
    assert not router_verified(SECRET, params, dict(body, prompt="y"), 1000.0)
    assert not router_verified(SECRET, params, body, 1000.0 + 3600)
    assert not router_verified(b"another-secret-0123456789", params, body, 1000.0)
    assert not router_verified(SECRET, {"do_remote_decode": True}, body, 1000.0)
    assert body_digest(body) != body_digest(dict(body, temperature=0.70001))


def test_trust_refuses_alike_and_checks_peers_after_the_mac():
    rng = random.Random(7)
    trust = KVTrust(SECRET, parse_peers("10.0.0.7:8190, [::1]:9000, kvhost"), clock=lambda: 1_000_000_000.0)
    trust.check_remote(remote(rng).signed(SECRET))
    trust.check_remote(remote(rng, remote_host="kvhost", remote_port=1).signed(SECRET))  # any port of kvhost
    for forged in (remote(rng), remote(rng, remote_port=22), remote(rng).signed(b"another-secret-0123456789")):
        with pytest.raises(ApiError) as e:
            trust.check_remote(forged)
        assert e.value.status == 400 and e.value.message == NOT_AUTHENTICATED
    with pytest.raises(ApiError, match="not on this decode server's --kv-transfer-peers"):
        trust.check_remote(remote(rng, remote_port=22).signed(SECRET))
    with pytest.raises(ApiError, match="have expired"):
        trust.check_remote(remote(rng, expires=1).signed(SECRET))
    with pytest.raises(ApiError, match="no KV transfer secret"):
        KVTrust().require_secret("decode")


def test_peers_and_secret_flags():
    assert parse_peers("a:1,[::1]:2,b, [fe80::1]") == {("a", 1), ("::1", 2), ("b", None), ("fe80::1", None)}
    for bad in ("a:0", "a:x", ":1", "[::1]x", "a:1:2", ""):
        with pytest.raises(ValueError, match="--kv-transfer-peers"):
            parse_peers(bad)
    with pytest.raises(ValueError, match="at least 16"):
        check_secret("short")
    assert check_secret("0123456789abcdef") == b"0123456789abcdef" and check_secret(None) is None
