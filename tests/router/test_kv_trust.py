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


NOT_TAGS = ["é", "\ud800", "é" * 64, "\ud800" * 64, "F" * 64, "0" * 63, "0" * 65, "0" * 64 + "\n", " " + "0" * 63]


def test_a_mac_that_is_no_tag_is_refused_not_a_crash():
    """Review of issue 48: hmac.compare_digest raises TypeError on non-ASCII text, so a client's mac of 'é' was a
    500 on either role server. Only 64 lowercase hex digits are compared; anything else is a plain refusal."""
    rng = random.Random(4849)
    signed = remote(rng).signed(SECRET)
    body = {"model": "m", "prompt": "x"}
    params = {"do_remote_decode": True, **router_auth(SECRET, body, 1000.0)}
    trust = KVTrust(SECRET, clock=lambda: 1000.0)
    for given in NOT_TAGS:
        assert not RemoteKV(**{**signed.to_json(), "mac": given}).verified(SECRET), repr(given)
        assert not router_verified(SECRET, dict(params, mac=given), body, 1000.0), repr(given)
        with pytest.raises(ApiError) as e:
            trust.check_router(dict(params, mac=given), body)
        assert e.value.status == 400 and e.value.message == NOT_AUTHENTICATED
    assert signed.verified(SECRET) and router_verified(SECRET, params, body, 1000.0)


def test_peers_match_an_address_in_any_of_its_forms_and_a_name_in_any_case():
    """Review of issue 48: --kv-transfer-peers compared raw strings, so "::ffff:10.0.0.7" (how a dual-stack socket
    names an IPv4 peer), an IPv6 address written out in full, or a name in capitals missed their entry."""
    rng = random.Random(4850)
    trust = KVTrust(SECRET, parse_peers("[::FFFF:10.0.0.7]:8190, [2001:DB8:0:0::1], KVHost:9"),
                    clock=lambda: 1_000_000_000.0)
    for host, port in (("10.0.0.7", 8190), ("::ffff:10.0.0.7", 8190), ("2001:db8::1", 5), ("2001:0db8::0:1", 5),
                       ("kvhost", 9), ("KVHOST", 9)):
        trust.check_remote(remote(rng, remote_host=host, remote_port=port).signed(SECRET))
    for host, port in (("10.0.0.7", 8191), ("10.0.0.8", 8190), ("2001:db8::2", 5), ("kvhost2", 9), ("kvhost", 10)):
        with pytest.raises(ApiError, match="not on this decode server's --kv-transfer-peers"):
            trust.check_remote(remote(rng, remote_host=host, remote_port=port).signed(SECRET))
    assert parse_peers("[::ffff:10.0.0.7]:1,Host") == {("10.0.0.7", 1), ("host", None)}
