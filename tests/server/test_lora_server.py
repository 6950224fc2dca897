"""The server with LoRA adapters (issue 25): a request's `model` naming an adapter runs on its base engine with it,
whole and streamed, through the official client, as the offline LLM with the same adapter answers; /v1/models lists
the adapters under their base; vLLM's load and unload endpoints at run time while another request streams; an
unknown adapter is a 404, a bad one a 400; /metrics counts each adapter's requests; `jaxserve serve --lora-modules`
and its errors. The tiny random Llama with a byte tokenizer, adapters made with peft on it."""
import asyncio
import json

import aiohttp
import pytest

from jaxserve import LoRARequest, SamplingParams
from jaxserve.cli import main
from jaxserve.server.lora_modules import LoRAModulePath

from fake_runner import fake_llm
from peft_adapters import peft_adapter
from serving import ServerThread, http, metric_samples, wait_idle
from tiny import make_llm

BASE = "tiny"
PROMPTS = ["The cat", "Once upon"]
MAX_TOKENS = 10
LONG = 64  # tokens of the request that streams while adapters come and go: it outlasts them (~15 steps)


@pytest.fixture(scope="module")
def adapters(tiny_tokenized_dir, tmp_path_factory):
    """Two adapters of different ranks and targets, and a bad one (rank 16, above the server's limit of 8)."""
    import transformers
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_tokenized_dir).eval()
    root = tmp_path_factory.mktemp("lora-server")
    made = {}
    for seed, (name, r, modules) in enumerate([("sql", 4, ["q_proj", "v_proj"]),
                                                ("poet", 8, ["o_proj", "gate_proj", "down_proj"]),
                                                ("too-big", 16, ["q_proj"])]):
        with peft_adapter(hf, root / name, seed, b_std=0.2, r=r, lora_alpha=2 * r, target_modules=modules):
            made[name] = str(root / name)
    return made


def greedy(max_tokens=MAX_TOKENS):
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


@pytest.fixture(scope="module")
def served(tiny_tokenized_dir, adapters):
    """A server over one engine with the two adapters (and runtime loading), and what the offline LLM answers per
    adapter (None: the base model), worked out on the same engine before it serves."""
    llm = make_llm(tiny_tokenized_dir, enable_lora=True, max_loras=2, max_lora_rank=8)
    expected = {}
    for k, name in enumerate([None, "sql", "poet"]):
        # Ids the server will not give (it counts from 1), so the engine never sees one id under two names.
        lora = LoRARequest(name, 100 + k, adapters[name]) if name else None
        expected[name] = [o.outputs[0].text for o in llm.generate(PROMPTS, greedy(), lora_request=lora,
                                                                  use_tqdm=False)]
    expected["sql", "long"] = llm.generate(PROMPTS[0], greedy(LONG), lora_request=LoRARequest("sql", 101, adapters[
        "sql"]), use_tqdm=False)[0].outputs[0].text
    # Each adapter changes the answer, or the test proves nothing.
    assert len({tuple(expected[n]) for n in (None, "sql", "poet")}) == 3, expected
    st = ServerThread(llm, BASE, allow_runtime_lora_updating=True)
    for name in ("sql", "poet"):
        status, _ = http("POST", st.url + "/v1/load_lora_adapter", {"lora_name": name, "lora_path": adapters[name]})
        assert status == 200
    yield st, expected
    st.stop()


def client(st):
    from openai import OpenAI
    return OpenAI(base_url=st.url + "/v1", api_key="unused", max_retries=0)


def test_each_adapter_answers_as_the_offline_llm(served):
    """Whole and streamed, per adapter and the base beside them: the offline LLM's greedy text with that adapter;
    the answer names the adapter."""
    st, expected = served
    c = client(st)
    for name in (None, "sql", "poet"):
        model = name or BASE
        r = c.completions.create(model=model, prompt=PROMPTS, max_tokens=MAX_TOKENS, temperature=0,
                                 extra_body={"ignore_eos": True})
        assert r.model == model and [ch.text for ch in r.choices] == expected[name], name
        texts = ["", ""]
        for chunk in c.completions.create(model=model, prompt=PROMPTS, max_tokens=MAX_TOKENS, temperature=0,
                                          stream=True, extra_body={"ignore_eos": True}):
            assert chunk.model == model
            for ch in chunk.choices:
                texts[ch.index] += ch.text
        assert texts == expected[name], name
    wait_idle(st)


def test_adapters_and_the_base_model_at_once(served):
    """Requests on both adapters and the base model at once (batched together as they come): each its own answer."""
    from openai import AsyncOpenAI
    st, expected = served

    async def run():
        c = AsyncOpenAI(base_url=st.url + "/v1", api_key="unused", max_retries=0)
        names = [None, "sql", "poet"] * 2
        answers = await asyncio.gather(*(c.completions.create(
            model=name or BASE, prompt=PROMPTS, max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True})
            for name in names))
        return [[ch.text for ch in r.choices] for r in answers] == [expected[name] for name in names]

    assert asyncio.run(run())
    wait_idle(st)


def test_models_lists_the_adapters_under_their_base(served, adapters):
    st, _ = served
    cards = {m.id: m for m in client(st).models.list().data}
    assert list(cards) == [BASE, "sql", "poet"]
    assert cards[BASE].parent is None
    for name in ("sql", "poet"):  # vLLM's fields: root the adapter's path, parent its base model
        assert (cards[name].parent, cards[name].root) == (BASE, adapters[name])


def test_an_unknown_adapter_is_a_404(served):
    import openai
    st, _ = served
    with pytest.raises(openai.NotFoundError) as e:
        client(st).completions.create(model="sql2", prompt="hi", max_tokens=2)
    assert e.value.code == "model_not_found" and "`poet`" in e.value.message


def test_load_and_unload_while_another_request_streams(served, adapters):
    """While a long request streams with one adapter: a bad adapter is refused (400, the loader's message), a good
    one loads and answers at once, a duplicate name is a 400, and the streaming adapter is unloaded (new requests
    naming it are 404s; the running one finishes with it, its text the offline LLM's)."""
    st, expected = served
    url = st.url + "/v1"

    async def run():
        async with aiohttp.ClientSession() as s:
            async def stream_long():
                text, chunks = "", 0
                async with s.post(url + "/completions", json={
                        "model": "sql", "prompt": PROMPTS[0], "max_tokens": LONG, "temperature": 0,
                        "ignore_eos": True, "stream": True}) as r:
                    assert r.status == 200
                    async for line in r.content:
                        if line.startswith(b"data: {"):
                            body = json.loads(line[6:])
                            assert "error" not in body, body
                            text += body["choices"][0]["text"]
                            chunks += 1
                return text, chunks

            async def post(path, body):
                async with s.post(url + path, json=body) as r:
                    return r.status, await r.text()

            streaming = asyncio.create_task(stream_long())
            while not st.engine.stats().num_running:  # the stream has started
                await asyncio.sleep(0.01)
            unloaded = await post("/unload_lora_adapter", {"lora_name": "sql"})
            assert not streaming.done()  # unloaded while its request still streams
            gone = await post("/completions", {"model": "sql", "prompt": "hi", "max_tokens": 2})
            again = await post("/unload_lora_adapter", {"lora_name": "sql"})
            bad = await post("/load_lora_adapter", {"lora_name": "big", "lora_path": adapters["too-big"]})
            good = await post("/load_lora_adapter", {"lora_name": "verse", "lora_path": adapters["poet"]})
            duplicate = await post("/load_lora_adapter", {"lora_name": "verse", "lora_path": adapters["sql"]})
            async with s.post(url + "/completions", json={"model": "verse", "prompt": PROMPTS, "temperature": 0,
                                                          "max_tokens": MAX_TOKENS, "ignore_eos": True}) as r:
                verse = r.status, await r.json()
            assert not streaming.done()  # all of it while the long request streamed
            return await streaming, bad, good, duplicate, verse, unloaded, gone, again

    try:
        (text, chunks), bad, good, duplicate, verse, unloaded, gone, again = asyncio.run(run())
        assert chunks > 1 and text == expected["sql", "long"]
        message = json.loads(bad[1])["error"]["message"]  # the loader's: the adapter, the field, the fault
        assert bad[0] == 400 and "'big'" in message and "above max_lora_rank 8" in message, bad
        assert good == (200, "Success: LoRA adapter 'verse' added successfully."), good
        assert duplicate[0] == 400 and "already been loaded" in duplicate[1], duplicate
        assert verse[0] == 200 and [ch["text"] for ch in verse[1]["choices"]] == expected["poet"], verse
        assert verse[1]["model"] == "verse"
        assert unloaded == (200, "Success: LoRA adapter 'sql' removed successfully."), unloaded
        assert gone[0] == 404 and json.loads(gone[1])["error"]["code"] == "model_not_found", gone
        assert again[0] == 404 and "cannot be found" in again[1], again
        assert [m["id"] for m in json.loads(http("GET", url + "/models")[1])["data"]] == [BASE, "poet", "verse"]
        wait_idle(st)
    finally:  # as the other tests found it
        for name in ("sql", "verse"):
            if name in st.server.lora.adapters:
                http("POST", url + "/unload_lora_adapter", {"lora_name": name})
        status, _ = http("POST", url + "/load_lora_adapter", {"lora_name": "sql", "lora_path": adapters["sql"]})
        assert status == 200


@pytest.mark.parametrize("body, status, message", [
    ({"lora_path": "/x"}, 400, "Both 'lora_name' and 'lora_path'"),
    ({"lora_name": "x"}, 400, "Both 'lora_name' and 'lora_path'"),
    ({"lora_name": BASE, "lora_path": "/x"}, 400, "a served model's name"),
    ({"lora_name": "x", "lora_path": "/no/such/adapter"}, 400, "/no/such/adapter"),
    ({"lora_name": "x", "lora_path": "/x", "base_model_name": "other"}, 404, "`other` does not exist"),
])
def test_bad_loads_are_refused(served, body, status, message):
    st, _ = served
    got, text = http("POST", st.url + "/v1/load_lora_adapter", body)
    assert got == status and message in json.loads(text)["error"]["message"], text
    assert "x" not in st.server.lora.adapters


def test_metrics_count_each_adapters_requests(served):
    st, _ = served

    def counts():
        samples = metric_samples(http("GET", st.url + "/metrics")[1].decode())
        return {name: samples.get(("jaxserve:lora_requests_total",
                                   frozenset({f'model_name="{BASE}"', f'lora_name="{name}"'})))
                for name in ("sql", "poet")}
    before = counts()
    assert None not in before.values()  # a series from each adapter's load on
    c = client(st)
    c.completions.create(model="sql", prompt=PROMPTS, max_tokens=2)  # a batch: one per prompt
    c.completions.create(model="poet", prompt="hi", max_tokens=2)
    c.completions.create(model=BASE, prompt="hi", max_tokens=2)  # the base model: no adapter's
    after = counts()
    assert {n: after[n] - before[n] for n in after} == {"sql": 2, "poet": 1}
    wait_idle(st)


def _untrusted(root, good):
    """Adapters a client may name (issue 48), each a copy of `good` spoiled one way: name -> (path, message)."""
    import shutil

    def copy(name, **config):
        shutil.copytree(good, root / name)
        c = json.loads((root / name / "adapter_config.json").read_text())
        (root / name / "adapter_config.json").write_text(json.dumps({**c, **config}))
        return root / name
    made = {"paren": (copy("paren", rank_pattern={"(": 4}), "rank_pattern: key '(': only module names"),
            "backtracking": (copy("backtracking", alpha_pattern={"(.|.)*Z": 4}), "alpha_pattern: key '(.|.)*Z'")}
    # 2 GiB with an lm_head key in its header, sparse (no disk, no memory): refused from the header alone.
    path = copy("lm-head")
    text = json.dumps({"base_model.model.lm_head.lora_A.weight": {
        "dtype": "F32", "shape": [2, 2**28 - 512], "data_offsets": [0, 8 * (2**28 - 512)]}}).encode()
    with open(path / "adapter_model.safetensors", "wb") as f:
        f.write(len(text).to_bytes(8, "little") + text)
        f.truncate(8 + len(text) + 8 * (2**28 - 512))
    made["lm-head"] = (path, "base_model.model.lm_head.lora_A.weight: not a LoRA weight")
    nothing = "not found, not readable, or not a PEFT LoRA adapter"
    (root / "empty").mkdir()
    made.update({"nowhere": (root / "nowhere", nothing), "empty": (root / "empty", nothing)})
    return made


def test_untrusted_adapters_are_400s_and_the_server_goes_on(served, adapters, tmp_path):
    """A rank_pattern key that does not compile (before: a 500), one that backtracks without end (before: over 20 s
    on a thread shared with grammar compiles), a 2 GiB file with an lm_head key (before: read whole, 6.4 s and
    3.4 GB of RSS), and paths that hold no adapter (before: "adapter_config.json: missing" told what is on the
    disk): each a 400 with an OpenAI body, and the server serves on."""
    st, expected = served
    for name, (path, message) in _untrusted(tmp_path, adapters["sql"]).items():
        status, text = http("POST", st.url + "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path)})
        error = json.loads(text)["error"]
        assert status == 400 and message in error["message"], (name, text)
        assert (error["type"], error["param"]) == ("invalid_request_error", "lora_path"), (name, text)
        assert name not in st.server.lora.adapters
    assert http("GET", st.url + "/health")[0] == 200
    answer = client(st).completions.create(model="poet", prompt=PROMPTS, temperature=0, max_tokens=MAX_TOKENS,
                                           extra_body={"ignore_eos": True})
    assert [c.text for c in answer.choices] == expected["poet"]


def test_an_unloaded_adapters_metric_series_goes(served, adapters):
    """Before: every name ever loaded stayed in each scrape."""
    st, _ = served

    def series():
        samples = metric_samples(http("GET", st.url + "/metrics")[1].decode())
        return {dict(label.split("=") for label in labels)["lora_name"].strip('"')
                for name, labels in samples if name == "jaxserve:lora_requests_total"}
    body = {"lora_name": "brief", "lora_path": adapters["sql"]}
    assert http("POST", st.url + "/v1/load_lora_adapter", body)[0] == 200
    client(st).completions.create(model="brief", prompt="hi", max_tokens=2)
    assert series() == {"sql", "poet", "brief"}
    assert http("POST", st.url + "/v1/unload_lora_adapter", {"lora_name": "brief"})[0] == 200
    assert series() == {"sql", "poet"}
    wait_idle(st)


def test_runtime_loading_is_off_unless_allowed():
    """As vLLM's without VLLM_ALLOW_RUNTIME_LORA_UPDATING: the endpoints do not exist."""
    st = ServerThread(fake_llm(vocab_size=320), BASE)
    try:
        for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
            status, _ = http("POST", st.url + path, {"lora_name": "a", "lora_path": "/a"})
            assert status == 404
    finally:
        st.stop()


# ---- the command line ----

def test_lora_modules_specs():
    assert LoRAModulePath.parse("sql=/a/b=c") == LoRAModulePath("sql", "/a/b=c")
    assert LoRAModulePath.parse('{"name": "sql", "path": "/a", "base_model_name": "m"}') == LoRAModulePath(
        "sql", "/a", "m")
    assert LoRAModulePath.parse('{"name": "sql", "path": "/a"}') == LoRAModulePath("sql", "/a")


@pytest.mark.parametrize("argv, message", [
    (["--enable-lora", "--lora-modules", "sql"], "give NAME=PATH or JSON"),
    (["--enable-lora", "--lora-modules", "=/a"], "non-empty name and path"),
    (["--enable-lora", "--lora-modules", "sql="], "non-empty name and path"),
    (["--enable-lora", "--lora-modules", '{"name": "sql"'], "not valid JSON"),
    (["--enable-lora", "--lora-modules", '{"name": "sql", "path": "/a", "rank": 4}'], "name, path and base_model"),
    (["--enable-lora", "--lora-modules", "a=/a", "a=/b"], "'a' more than once"),
    (["--enable-lora", "--model", "m", "--lora-modules", "m=/a"], "already a served model's name"),
    (["--enable-lora", "--lora-modules", '{"name": "a", "path": "/a", "base_model_name": "x"}'], "'x' is not served"),
    (["--lora-modules", "a=/a"], "--lora-modules serves LoRA adapters: it needs --enable-lora"),
    (["--allow-runtime-lora-updating"], "it needs --enable-lora"),
])
def test_lora_flag_errors_are_one_line_before_anything_loads(argv, message, capsys):
    assert main(["serve", *argv]) == 1
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err


SERVE = ["--max-model-len", "32", "--max-num-seqs", "2", "--max-num-batched-tokens", "16", "--block-size", "4",
         "--no-warmup", "--enable-lora", "--max-lora-rank", "8"]


def test_serve_loads_the_lora_modules(tiny_tokenized_dir, adapters, monkeypatch, capsys):
    """`jaxserve serve --lora-modules` loads each adapter on its engine before serving; a bad one ends the run with
    the loader's message on one line; VLLM_ALLOW_RUNTIME_LORA_UPDATING turns the endpoints on."""
    import jaxserve.server
    seen = {}

    async def fake_serve(server, host, port, grace_period_s=30.0, ready=None):
        seen.update(adapters={n: a.lora_request.lora_path for n, a in server.lora.adapters.items()},
                    runtime=server.allow_runtime_lora_updating)
        for engine in server.engines():
            engine.shutdown(30)
    monkeypatch.setattr(jaxserve.server, "serve", fake_serve)
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")
    assert main(["serve", "--model", tiny_tokenized_dir, *SERVE, "--lora-modules", f"sql={adapters['sql']}",
                 json.dumps({"name": "poet", "path": adapters["poet"]})]) == 0
    assert seen == {"adapters": {"sql": adapters["sql"], "poet": adapters["poet"]}, "runtime": True}
    assert main(["serve", "--model", tiny_tokenized_dir, *SERVE, "--lora-modules",
                 f"big={adapters['too-big']}"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("jaxserve: error: --lora-modules big: ") and len(err.strip().splitlines()) == 1, err
