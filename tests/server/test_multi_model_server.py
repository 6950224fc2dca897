"""Several models behind one server: the request's `model` picks the engine, /v1/models lists them, an unknown one
is a 404, /metrics and /health cover every engine; and `jaxserve serve --model A --model B` and its errors.
Two tiny random Llamas without tokenizers: prompts are token ids, answers are compared by their logprobs."""
import asyncio
import json
import threading
from types import SimpleNamespace

import aiohttp
import jax
import pytest

from jaxserve import SamplingParams
from jaxserve.cli import build_parser, main
from jaxserve.engine_config import EngineConfig
from jaxserve.options import CPU_KV_CACHE_BYTES
from jaxserve.server import Server
from jaxserve.server.served_model import AutoTools

from serving import ServerThread, http, metric_samples, wait_idle
from tiny import make_llm

PROMPT = [5, 6, 7, 8, 9]
# Two models' equal share of the default KV budget where it is a fixed one (CPU); none on an accelerator.
CPU_SHARE = CPU_KV_CACHE_BYTES // 2 if jax.devices()[0].platform == "cpu" else None
BODY = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True, "logprobs": 0}


def reference(llm) -> list[float]:
    """The model's own greedy logprobs for BODY, from its LLM."""
    out = llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                                                                    logprobs=0), use_tqdm=False)[0].outputs[0]
    return [entry[t].logprob for t, entry in zip(out.token_ids, out.logprobs)]


@pytest.fixture(scope="module")
def two(tiny_dir, other_tiny_dir):
    llms = {"a": make_llm(tiny_dir, max_model_len=64), "b": make_llm(other_tiny_dir, max_model_len=32)}
    expected = {name: reference(llm) for name, llm in llms.items()}
    assert expected["a"] != pytest.approx(expected["b"], abs=1e-4)  # two different models, or the test proves nothing
    st = ServerThread(llms)
    yield st, expected
    st.stop()


def idle(st):
    for engine in st.engines.values():
        wait_idle(SimpleNamespace(server=st.server, engine=engine))


def test_each_model_answers_as_its_own_llm(two):
    st, expected = two
    for name in ("a", "b", "a"):
        status, content = http("POST", st.url + "/v1/completions", {**BODY, "model": name})
        r = json.loads(content)
        assert status == 200 and r["model"] == name, content
        assert r["choices"][0]["logprobs"]["token_logprobs"] == pytest.approx(expected[name], abs=1e-4)
        status, content = http("POST", st.url + "/v1/completions", {**BODY, "model": name, "stream": True})
        chunks = [json.loads(line[6:]) for line in content.decode().splitlines() if line.startswith("data: {")]
        assert status == 200 and content.endswith(b"data: [DONE]\n\n") and {c["model"] for c in chunks} == {name}
        streamed = [lp for c in chunks for ch in c["choices"] for lp in ch["logprobs"]["token_logprobs"]]
        assert streamed == pytest.approx(expected[name], abs=1e-4)
    # No model named: the first one, as a single-model server does.
    r = json.loads(http("POST", st.url + "/v1/completions", BODY)[1])
    assert r["model"] == "a" and r["choices"][0]["logprobs"]["token_logprobs"] == pytest.approx(expected["a"],
                                                                                                 abs=1e-4)
    # Both at once, while the other runs.

    async def both():
        async with aiohttp.ClientSession() as s:
            async def one(name):
                async with s.post(st.url + "/v1/completions", json={**BODY, "model": name}) as r:
                    return name, (await r.json())["choices"][0]["logprobs"]["token_logprobs"]
            return await asyncio.gather(*(one(name) for name in ("a", "b", "b", "a")))
    for name, logprobs in asyncio.run(both()):
        assert logprobs == pytest.approx(expected[name], abs=1e-4)
    # Each model's own limits: b's max_model_len is 32.
    status, content = http("POST", st.url + "/v1/completions", {**BODY, "model": "b", "max_tokens": 40})
    assert status == 400 and "32" in json.loads(content)["error"]["message"]
    assert http("POST", st.url + "/v1/completions", {**BODY, "model": "a", "max_tokens": 40})[0] == 200
    idle(st)


def test_models_lists_both_and_an_unknown_model_is_a_404(two):
    st, _ = two
    status, content = http("GET", st.url + "/v1/models")
    data = json.loads(content)["data"]
    assert status == 200 and [(m["id"], m["object"], m["max_model_len"]) for m in data] == [("a", "model", 64),
                                                                                          ("b", "model", 32)]
    for path in ("/v1/completions", "/v1/chat/completions"):
        body = {**BODY, "model": "gpt-4"} if path == "/v1/completions" else {"model": "gpt-4", "messages": []}
        status, content = http("POST", st.url + path, body)
        error = json.loads(content)["error"]
        assert status == 404, content
        assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", "model", "model_not_found")
        assert "gpt-4" in error["message"] and "`a`" in error["message"] and "`b`" in error["message"]
    status, content = http("POST", st.url + "/v1/completions", {**BODY, "model": 3})
    assert status == 400 and json.loads(content)["error"]["param"] == "model"
    idle(st)


def test_metrics_have_a_series_per_model(two):
    st, _ = two

    def value(samples, metric, model, **labels):
        return samples.get((metric, frozenset(f'{k}="{v}"' for k, v in {"model_name": model, **labels}.items())), 0)
    before = metric_samples(http("GET", st.url + "/metrics")[1].decode())
    for _ in range(2):
        assert http("POST", st.url + "/v1/completions", {**BODY, "model": "b"})[0] == 200
    assert http("POST", st.url + "/v1/completions", {**BODY, "model": "a"})[0] == 200
    idle(st)
    after = metric_samples(http("GET", st.url + "/metrics")[1].decode())
    for model, requests in (("a", 1), ("b", 2)):
        def grew(metric, **labels):
            return value(after, metric, model, **labels) - value(before, metric, model, **labels)
        assert grew("jaxserve:request_success_total", finished_reason="length") == requests
        assert grew("jaxserve:time_to_first_token_seconds_count") == requests
        assert grew("jaxserve:e2e_request_latency_seconds_count") == requests
        assert grew("jaxserve:generation_tokens_total") == 8 * requests
        for gauge in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
            assert ("jaxserve:" + gauge, frozenset({f'model_name="{model}"'})) in after, gauge


def test_health_needs_every_engine(two, monkeypatch):
    st, _ = two
    assert http("GET", st.url + "/health") == (200, b'{"status": "ok"}')
    monkeypatch.setattr(st.engines["b"], "alive", lambda: False)
    assert http("GET", st.url + "/health")[0] == 503


class BlockedTokenizer:
    """Stands in for model a's tokenizer: encode() waits until `release` is set (outside the GIL, as native
    tokenizing does), so requests to a pile up tokenizing for as long as the test wants."""

    def __init__(self):
        self.calls, self.release = [], threading.Event()

    def encode(self, text, add_special_tokens=True):
        self.calls.append(len(text))
        self.release.wait(60)
        return [5, 6, 7]


def test_one_models_tokenizing_does_not_hold_up_another(two):
    """More requests to a than any shared thread pool has threads, each stuck tokenizing: b still answers at once,
    and a's requests are all served once their tokenizer lets go."""
    st, _ = two
    a = st.server.models["a"]
    assert http("POST", st.url + "/v1/completions", {**BODY, "model": "b"})[0] == 200  # compiled before timing
    tok, original = BlockedTokenizer(), a.tokenizer
    a.tokenizer = tok
    many = 40  # past the most threads asyncio's default executor has (32)

    async def scenario():
        async with aiohttp.ClientSession() as s:
            async def ask(name, prompt):
                async with s.post(st.url + "/v1/completions",
                                  json={"model": name, "prompt": prompt, "max_tokens": 1}) as r:
                    return r.status
            to_a = [asyncio.create_task(ask("a", "x" * 100)) for _ in range(many)]
            while a.in_flight < many:  # all admitted: tokenizing, or waiting for a tokenizing thread
                await asyncio.sleep(0.01)
            try:
                b = await asyncio.wait_for(ask("b", PROMPT), 20)
            except TimeoutError:
                b = "timed out"
            assert not tok.release.is_set()
            assert 0 < len(tok.calls) <= 2  # a tokenizes on its own 2 threads; its other requests wait for them
            tok.release.set()
            return b, await asyncio.gather(*to_a)
    try:
        b, statuses = asyncio.run(scenario())
    finally:
        tok.release.set()
        a.tokenizer = original
    assert b == 200, "model b waited for model a's tokenizing"
    assert statuses == [200] * many
    idle(st)


def test_server_arguments():
    with pytest.raises(ValueError, match="at least one engine"):
        Server({})
    with pytest.raises(TypeError, match="model_name"):
        Server({"a": object()}, "a")
    with pytest.raises(TypeError, match="model name"):
        Server(object())


# ---- the command line ----

def parse(*argv):
    return build_parser().parse_args(["serve", *argv])


def test_tool_flags_as_vllms(capsys):
    assert (parse().enable_auto_tool_choice, parse().tool_call_parser) == (False, None)
    args = parse("--enable-auto-tool-choice", "--tool-call-parser", "llama3_json")
    assert (args.enable_auto_tool_choice, args.tool_call_parser) == (True, "llama3_json")
    with pytest.raises(SystemExit):
        parse("--tool-call-parser", "pythonic")
    assert "invalid choice: 'pythonic'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="--tool-call-parser must be one of"):
        AutoTools("pythonic")


def test_one_config_per_model_with_the_budget_split():
    configs = EngineConfig.per_model_from_cli_args(parse("--model", "a.gguf", "--model", "b", "--max-num-seqs", "8",
                                                         "--quantization", "int8"))
    # On CPU the 2 GiB default split in two; on an accelerator each gets half the utilization.
    share = dict(max_num_seqs=8, quantization="int8", gpu_memory_utilization=0.45, kv_cache_memory_bytes=CPU_SHARE)
    assert configs == [EngineConfig(model="a.gguf", **share), EngineConfig(model="b", **share)]
    configs = EngineConfig.per_model_from_cli_args(parse("--model", "a", "--model", "b", "--model", "c",
                                                         "--kv-cache-memory-bytes", "1000000"))
    assert configs == [EngineConfig(model=m, kv_cache_memory_bytes=1000000) for m in "abc"]  # each, as given
    # One model (or none): as before.
    assert EngineConfig.per_model_from_cli_args(parse("--model", "a")) == [EngineConfig(model="a")]
    assert EngineConfig.per_model_from_cli_args(parse()) == [EngineConfig()]
    assert EngineConfig.from_cli_args(parse("--model", "a", "--gpu-memory-utilization", "0.5")) == EngineConfig(
        model="a", gpu_memory_utilization=0.5)
    with pytest.raises(ValueError, match="per_model_from_cli_args"):
        EngineConfig.from_cli_args(parse("--model", "a", "--model", "b"))


@pytest.mark.parametrize("argv, message", [
    (["--model", "a", "--model", "b", "--served-model-name", "x"], "given 1 times for 2 model(s)"),
    (["--served-model-name", "x", "--served-model-name", "y"], "given 2 times for 1 model(s)"),
    (["--model", "a", "--model", "a"], "'a' names several"),
    (["--model", "a", "--model", "b", "--served-model-name", "x", "--served-model-name", "x"], "'x' names several"),
    (["--model", "a", "--served-model-name", ""], "must not be empty"),
    (["--model", "a", "--model", "b", "--coordinator-address", "localhost:1234", "--num-processes", "2",
      "--process-id", "0"], "multi-process run"),
    (["--model", "a", "--model", "b", "--max-num-seqs", "0"], "max_num_seqs"),
])
def test_serve_errors_are_one_line_before_anything_loads(argv, message, capsys):
    assert main(["serve", *argv]) == 1
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err


def test_serve_builds_an_engine_per_model(tiny_dir, other_tiny_dir, monkeypatch):
    """cmd_serve over two models: a server with an engine each, under the names given, each with its budget share."""
    import jaxserve.server
    seen = {}

    async def fake_serve(server, host, port, grace_period_s=30.0, ready=None):
        seen.update({name: m.engine.llm for name, m in server.models.items()})
        seen["auto_tools"] = {m.auto_tools for m in server.models.values()}
        for engine in server.engines():
            engine.shutdown(30)
    monkeypatch.setattr(jaxserve.server, "serve", fake_serve)
    assert main(["serve", "--model", tiny_dir, "--model", other_tiny_dir, "--served-model-name", "first",
                 "--served-model-name", "second", "--max-model-len", "32", "--max-num-seqs", "2",
                 "--max-num-batched-tokens", "16", "--block-size", "4", "--no-warmup", "--enable-auto-tool-choice",
                 "--tool-call-parser", "qwen3_coder"]) == 0
    assert seen.pop("auto_tools") == {AutoTools("qwen3_coder", enabled=True)}  # vLLM's flags, for every model
    assert list(seen) == ["first", "second"]
    assert [llm.engine_config.model for llm in seen.values()] == [tiny_dir, other_tiny_dir]
    assert all(llm.engine_config.kv_cache_memory_bytes == CPU_SHARE for llm in seen.values())
    assert all(llm.engine_config.gpu_memory_utilization == 0.45 for llm in seen.values())
