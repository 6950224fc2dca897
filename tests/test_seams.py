"""The protocols between layers hold what their callers use: the Runner the host loop drives (the model runner and
the fake one serve all of it), the EngineClient the server talks to (AsyncEngine serves all of it), and the typed
kv_transfer_params the role servers and the router pass."""
from __future__ import annotations

import typing

import pytest

from jaxserve.engine.async_engine import AsyncEngine
from jaxserve.engine.client import EngineClient
from jaxserve.openai.kv_transfer_params import KVTransferParams, KVTransferParamsError, RemoteKV
from jaxserve.runner.model_runner import ModelRunner
from jaxserve.runner.protocol import Runner

from fake_runner import FakeRunner, fake_llm


def members(protocol) -> set[str]:
    """A protocol's methods, properties and attributes."""
    return {n for n in vars(protocol) if not n.startswith("_")} | set(typing.get_type_hints(protocol))


def test_both_runners_serve_the_runner_protocol():
    fake = FakeRunner(num_pages=8, page_size=4)
    assert not [m for m in members(Runner) if not hasattr(fake, m)]
    # The model runner's attributes are set as it builds its cache (too costly here); its methods are on the class.
    assert not [m for m in members(Runner) - set(typing.get_type_hints(Runner)) if not hasattr(ModelRunner, m)]


def test_the_async_engine_serves_the_engine_client_protocol():
    engine = AsyncEngine(fake_llm(max_model_len=48, vocab_size=40))
    try:
        assert not [m for m in members(EngineClient) if not hasattr(engine, m)]
        assert (engine.max_model_len, engine.vocab_size, engine.page_size, engine.role) == (48, 40, 4, "both")
        assert engine.tokenizer is None and engine.enable_lora is False
    finally:
        engine.shutdown(10)


REMOTE = {"transfer_id": "t", "remote_host": "h", "remote_port": 1, "first_token_id": 2, "num_cached": 3,
          "num_prompt_tokens": 4, "prompt_digest": "d" * 64, "kv_digest": "e" * 64, "expires": 5, "mac": "f" * 64}


def test_kv_transfer_params_round_trip_through_their_wire_form():
    to_prefill = KVTransferParams.for_role({"do_remote_decode": True, "transfer_id": 7}, "prefill")
    assert to_prefill == KVTransferParams(do_remote_decode=True) and to_prefill.to_json() == {"do_remote_decode": True}
    remote = RemoteKV.from_json(REMOTE)
    assert remote.to_json() == REMOTE and remote.remote_port == 1
    to_decode = KVTransferParams(do_remote_prefill=True, remote=remote).to_json()
    assert to_decode == {"do_remote_prefill": True, **REMOTE}
    assert KVTransferParams.for_role(to_decode, "decode").remote == remote


@pytest.mark.parametrize("value, role, message", [
    (None, "prefill", "this is a prefill server"),
    ({"do_remote_prefill": True, **REMOTE}, "prefill", "do_remote_decode: true"),
    ({"do_remote_prefill": 1, **REMOTE}, "decode", "do_remote_prefill: true"),
    ({"do_remote_prefill": True, **REMOTE, "remote_port": True}, "decode", "kv_transfer_params.remote_port must be "
                                                                             "a int"),
    ({"do_remote_prefill": True, **dict(REMOTE, transfer_id=None)}, "decode", "transfer_id must be a str"),
    # Issue 48 item 3: out of range, a 500 in the engine before
    ({"do_remote_prefill": True, **REMOTE, "first_token_id": -3}, "decode", r"first_token_id must be in \[0, "),
    ({"do_remote_prefill": True, **REMOTE, "first_token_id": 2**31}, "decode", "first_token_id must be in"),
    ({"do_remote_prefill": True, **REMOTE, "num_cached": 5}, "decode", r"num_cached must be in \[0, 4\]"),
    ({"do_remote_prefill": True, **REMOTE, "remote_port": 0}, "decode", "remote_port must be in"),
    ({"do_remote_prefill": True, **REMOTE, "remote_host": "h" * 300}, "decode", "remote_host must be 1 to 256"),
])
def test_kv_transfer_params_refused_say_what_is_wrong(value, role, message):
    with pytest.raises(KVTransferParamsError, match=message):
        KVTransferParams.for_role(value, role)
