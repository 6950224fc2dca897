"""Issue 48, items 1 and 10, on a live `jaxserve serve` of the default model, in a subprocess (where a segfault ends
the server, not pytest): crash-size schemas and grammars through every field that takes one are answered 400
naming the field, and the server is alive and answers after."""
import json
import os
import subprocess
import sys
import time

import aiohttp
import pytest

import deep_specs
from serving import free_port, http

CAP = 100_000  # grammar.MAX_SPEC_CHARS: the deepest chains that fit in it
MESSAGES = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def server(default_gguf_path, tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("deep-grammar-server") / "server.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "jaxserve.cli", "serve", "--model", str(default_gguf_path),
                                 "--port", str(port), "--max-model-len", "256", "--max-num-seqs", "2",
                                 "--no-warmup"], stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "JAX_PLATFORMS": "cpu"})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while True:
        try:
            if http("GET", url + "/health")[0] == 200:
                break
        except aiohttp.ClientError:
            pass
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.5)
    yield proc, url, log
    proc.kill()
    proc.wait(30)


def _named_tool(parameters: dict) -> dict:
    return {"tools": [{"type": "function", "function": {"name": "f", "parameters": parameters}}],
            "tool_choice": {"type": "function", "function": {"name": "f"}}}


CRASH_SIZE = [  # (the request's fields, the field the 400 names); each one segfaulted the server before the fix
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "deep", "schema": deep_specs.ref_chain(deep_specs.largest(deep_specs.ref_chain, CAP))}}},
     "response_format"),
    ({"structured_outputs": {"json": deep_specs.property_chain(2000)}}, "structured_outputs"),
    ({"guided_json": json.dumps(deep_specs.anchor_chain(deep_specs.largest(deep_specs.anchor_chain, CAP)))},
     "guided_json"),
    ({"structured_outputs": {"grammar": deep_specs.rule_chain(deep_specs.largest(deep_specs.rule_chain, CAP))}},
     "structured_outputs"),
    ({"guided_grammar": deep_specs.rule_chain_short(deep_specs.largest(deep_specs.rule_chain_short, CAP))},
     "guided_grammar"),
    (_named_tool(deep_specs.ref_chain(2500)), "tools"),
    # item 10: JSON text nested past Python's recursion limit (was a 500)
    ({"guided_json": "[" * 5000 + "]" * 5000}, "guided_json"),
]


@pytest.mark.parametrize("fields, param", CRASH_SIZE, ids=[f"{i}-{p}" for i, (_, p) in enumerate(CRASH_SIZE)])
def test_a_crash_size_spec_is_400_and_the_server_lives_on(server, fields, param):
    proc, url, log = server
    status, body = http("POST", url + "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 4, **fields})
    error = json.loads(body)["error"]
    assert (status, error["param"]) == (400, param), body[:500]
    assert "levels deep" in error["message"] or "nested too deeply" in error["message"], error
    assert proc.poll() is None, (proc.returncode, log.read_text()[-3000:])  # 139: a segfault
    status, body = http("POST", url + "/v1/chat/completions", {
        "messages": MESSAGES, "max_tokens": 8, "temperature": 0,
        "response_format": {"type": "json_schema", "json_schema": {"name": "ok", "schema": {"enum": ["yes", "no"]}}}})
    assert status == 200 and json.loads(json.loads(body)["choices"][0]["message"]["content"]) in ("yes", "no")
