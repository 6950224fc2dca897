"""The Gateway API Inference Extension's model-server protocol (issue 51): the metrics its endpoint picker reads,
checked by name, type and meaning on a held engine (fake runner, its steps let through one by one: gates, not
timing), and usage.prompt_tokens_details.cached_tokens, whole and streamed, completions and chat."""
import asyncio
import json
import threading
import time

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from jaxserve import LoRARequest, SamplingParams
from jaxserve.batching.pools.data_parallel import merge_stats
from jaxserve.openai.metrics import GATEWAY_METRICS
from jaxserve.tokenizer import Tokenizer

from fake_runner import fake_llm
from serving import ServerThread, http, wait_idle

# The protocol's list (docs/proposals/003-model-server-protocol): each metric's type.
PROTOCOL_TYPES = {"TotalQueuedRequests": "gauge", "TotalRunningRequests": "gauge", "KVCacheUtilization": "gauge",
                  "LoRAInfo": "gauge", "CacheInfo": "gauge"}
PAGE_SIZE = 4


class StepGate:
    """A fake runner's gate: a step's read-back waits until the test allows that many steps (sync scheduling: one
    dispatch, then its waits and read-back), so the engine stops with exactly the steps allowed run."""

    def __init__(self, runner):
        self.runner, self.allowed, self.changed = runner, 0, threading.Condition()

    def wait(self, timeout):
        with self.changed:
            self.changed.wait_for(lambda: self.runner.events.count("dispatch") <= self.allowed, timeout)

    def allow(self, steps: int) -> None:
        with self.changed:
            self.allowed = steps
            self.changed.notify_all()


def wait_for(condition, what: str, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.01)


def scrape(st) -> dict:
    """/metrics parsed by Prometheus' own parser: {family name: family}."""
    status, body = http("GET", st.url + "/metrics")
    assert status == 200
    return {f.name: f for f in text_string_to_metric_families(body.decode())}


def one(families, name, **labels):
    """The sample of family `name` whose labels include `labels` (model_name "fake" unless given)."""
    want = {"model_name": "fake", **labels}
    found = [s for s in families[name].samples if want.items() <= s.labels.items()]
    assert len(found) == 1, (name, want, families[name].samples)
    return found[0]


def test_the_gateway_metrics_by_name_type_and_meaning():
    """Held after its second step: A (adapter a) and C (base, n=2) run, B (adapter b) waits for the one LoRA slot
    and D (base) for a batch slot. The queue, the batch (per sequence, as vLLM's child requests), the KV usage, the
    adapters running and waiting with max_lora and a fresh timestamp, and the cache's layout."""
    llm = fake_llm(max_loras=1, max_cpu_loras=2, max_num_seqs=3, num_pages=32, page_size=PAGE_SIZE,
                   max_num_batched_tokens=32, async_scheduling=False)
    gate = StepGate(llm.runner)
    llm.runner.gate = gate
    st = ServerThread(llm, "fake", allow_runtime_lora_updating=True)
    started = time.time()
    try:
        for name, shift in (("a", 1), ("b", 2)):
            body = {"lora_name": name, "lora_path": f"shift/{shift}"}
            status, _ = http("POST", st.url + "/v1/load_lora_adapter", body)
            assert status == 200

        async def main():
            async with aiohttp.ClientSession() as s:
                async def ask(model, prompt, n=1):
                    body = {"model": model, "prompt": prompt, "max_tokens": 8, "n": n, "ignore_eos": True}
                    async with s.post(st.url + "/v1/completions", json=body) as r:
                        return r.status, await r.json()
                a = asyncio.create_task(ask("a", [1, 2, 3]))
                # A alone in the first step, held at its read-back; the others queue behind it.
                await asyncio.to_thread(wait_for, lambda: llm.runner.events.count("dispatch") == 1, "A dispatched")
                rest = [asyncio.create_task(ask(m, p, n)) for m, p, n in
                        (("b", [4, 5, 6], 1), ("fake", [7, 8, 9], 2), ("fake", [10, 11, 12], 1))]
                await asyncio.to_thread(wait_for, lambda: st.engine._commands.qsize() == 3, "B, C, D queued")
                gate.allow(2)  # step 1 ends; step 2 admits the rest it can; held at step 3's read-back
                await asyncio.to_thread(wait_for, lambda: llm.runner.events.count("dispatch") == 3, "step 3")
                families = await asyncio.to_thread(scrape, st)
                gate.allow(10 ** 6)
                return families, await asyncio.gather(a, *rest)

        families, answers = asyncio.run(asyncio.wait_for(main(), 60))
        assert [status for status, _ in answers] == [200] * 4, answers
        for protocol, name in GATEWAY_METRICS.items():
            assert families[name].type == PROTOCOL_TYPES[protocol], (protocol, name, families[name].type)
        queued = one(families, GATEWAY_METRICS["TotalQueuedRequests"])
        running = one(families, GATEWAY_METRICS["TotalRunningRequests"])
        assert (queued.value, running.value) == (2, 3)  # B and D wait; A and C's two sequences run
        assert 0 < one(families, GATEWAY_METRICS["KVCacheUtilization"]).value <= 1
        lora = one(families, GATEWAY_METRICS["LoRAInfo"])
        assert (lora.labels["running_lora_adapters"], lora.labels["waiting_lora_adapters"],
                lora.labels["max_lora"]) == ("a", "b", "1")
        assert started <= lora.value <= time.time()
        cache = one(families, GATEWAY_METRICS["CacheInfo"])
        pages = llm.core.scheduler.cache.allocator.num_usable
        assert (cache.labels["block_size"], cache.labels["num_gpu_blocks"], cache.value) == (
            str(PAGE_SIZE), str(pages), 1)
        wait_idle(st)
    finally:
        gate.allow(10 ** 6)
        st.stop()


def test_no_lora_info_without_lora():
    """As vLLM: the LoRA info gauge exists only with LoRA enabled; the cache's layout always."""
    st = ServerThread(fake_llm(page_size=PAGE_SIZE), "fake")
    try:
        families = scrape(st)
        assert GATEWAY_METRICS["LoRAInfo"] not in families
        assert one(families, GATEWAY_METRICS["CacheInfo"]).labels["block_size"] == str(PAGE_SIZE)
    finally:
        st.stop()


def complete(st, path, body) -> dict:
    """A whole answer's usage, or a stream's final usage chunk (stream_options.include_usage)."""
    status, raw = http("POST", st.url + path, body)
    assert status == 200, raw
    if not body.get("stream"):
        return json.loads(raw)["usage"]
    chunks = [json.loads(line[6:]) for line in raw.decode().splitlines() if line.startswith("data: {")]
    assert not chunks[-1]["choices"]
    return chunks[-1]["usage"]


def test_cached_tokens_are_the_prefix_cache_hits(tiny_tokenized_dir):
    """A first prompt reports 0 cached tokens; a second sharing its prefix reports the prefix cache's hits (whole
    pages), whole and streamed alike, completions and chat; n=2 counts the prompt once, a batch of prompts sums."""
    tokenizer = Tokenizer.from_hf_dir(tiny_tokenized_dir)
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
    llm = fake_llm(vocab_size=tokenizer.vocab_size, tokenizer=tokenizer, max_model_len=256, num_pages=128,
                   page_size=PAGE_SIZE, max_num_batched_tokens=64)
    st = ServerThread(llm, "fake")

    def hits():
        return st.engine.stats().prefix_cache_hits

    def prompt(k):  # long enough for several pages; prompt k shares nothing with another k
        return [k * 10 + i % 7 + 1 for i in range(18)]
    try:
        for stream in (False, True):
            k = 2 * stream
            extra = {"stream": True, "stream_options": {"include_usage": True}} if stream else {}
            body = {"model": "fake", "max_tokens": 3, "ignore_eos": True, **extra}
            first = complete(st, "/v1/completions", {**body, "prompt": prompt(k)})
            assert first["prompt_tokens_details"] == {"cached_tokens": 0}, (stream, first)
            before = hits()
            second = complete(st, "/v1/completions", {**body, "prompt": prompt(k) + [60, 61], "n": 2})
            cached = second["prompt_tokens_details"]["cached_tokens"]
            assert cached == 16 and cached % PAGE_SIZE == 0, (stream, second)  # the 4 whole pages of 18 tokens
            assert hits() - before >= cached  # each of the n=2 sequences found them
            batch = complete(st, "/v1/completions", {**body, "prompt": [prompt(k) + [62], prompt(k + 1)]})
            assert batch["prompt_tokens_details"]["cached_tokens"] == 16, (stream, batch)  # 16 + 0
            before = hits()
            text = "a question long enough for a few pages of bytes"
            chat = {**body, "messages": [{"role": "user", "content": f"{k}: {text}"}]}
            assert complete(st, "/v1/chat/completions", chat)["prompt_tokens_details"]["cached_tokens"] == 0
            again = complete(st, "/v1/chat/completions", chat)
            assert again["prompt_tokens_details"]["cached_tokens"] == hits() - before > 0, (stream, again)
        wait_idle(st)
    finally:
        st.stop()


def test_data_parallel_totals():
    """Two replicas as one server: the adapters waiting and running are either replica's, max_lora and the pages
    add up (each replica runs its own adapters in its own pages), the page size is one replica's."""
    llm = fake_llm(num_replicas=2, max_loras=1, num_pages=32, page_size=PAGE_SIZE, async_scheduling=False)
    sp = SamplingParams(max_tokens=4, ignore_eos=True)
    for name, shift in (("a", 1), ("b", 2)):  # one to each replica (routing: the fewest sequences)
        llm.add_request({"prompt_token_ids": [1, 2, 3]}, sp, lora_request=LoRARequest(name, shift, f"shift/{shift}"))
    s = llm.stats()
    assert (s.waiting_lora_adapters, s.running_lora_adapters, s.num_waiting) == (("a", "b"), (), 2)
    pages = llm.replicas[0].scheduler.cache.allocator.num_usable
    assert (s.max_lora, s.page_size, s.pages_total) == (2, PAGE_SIZE, 2 * pages)
    llm.step()
    s = llm.stats()
    assert (s.waiting_lora_adapters, s.running_lora_adapters, s.num_running) == ((), ("a", "b"), 2)
    parts = [r.stats() for r in llm.replicas]
    assert merge_stats(parts).snapshot_time == max(p.snapshot_time for p in parts)  # the newest, not a sum


def test_offline_outputs_carry_num_cached_tokens():
    """LLM.generate's RequestOutput.num_cached_tokens, as vLLM's: 0 for a first prompt, the whole pages of a shared
    prefix for the next."""
    llm = fake_llm(num_pages=32, page_size=PAGE_SIZE)
    sp = SamplingParams(max_tokens=2, ignore_eos=True)
    prompt = list(range(1, 11))
    assert llm.generate({"prompt_token_ids": prompt}, sp, use_tqdm=False)[0].num_cached_tokens == 0
    again = llm.generate([{"prompt_token_ids": prompt + [20]}, {"prompt_token_ids": [30, 31]}], sp, use_tqdm=False)
    assert [o.num_cached_tokens for o in again] == [8, 0]  # 2 whole pages of the 10 shared tokens
