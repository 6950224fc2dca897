"""Structured output (llguidance): the tokenizer bridge on every vocabulary we load, each kind of grammar on the
default model and Gemma 3, and the engine's handling of constrained rows (n, seeds, stop strings, logprobs,
streaming, speculation, preemption, bad grammars) on a tiny random model, which under a grammar must still write
grammar-valid text."""
import asyncio
import json
import re
import time

import jsonschema
import numpy as np
import pytest
import regex

from jaxserve import LLM, SamplingParams
from jaxserve.engine.async_engine import AsyncEngine
from jaxserve.sample.token_mask import allowed_ids
from jaxserve.sampling_params import StructuredOutputsParams as Structured
from jaxserve.structured_output import compile_grammar, fill_masks
from jaxserve.structured_output import grammar as grammar_module
from jaxserve.tokenizer import Tokenizer
from jaxserve.weights.gguf import open_gguf

from hf_models import save_tiny_model
from tiny import TINY_PAGE_BYTES, make_llm

# What a random model can finish: every string, number and list bounded.
SCHEMA = {"type": "object", "properties": {
    "id": {"type": "integer", "minimum": 0, "maximum": 999}, "ok": {"type": "boolean"},
    "tag": {"enum": ["a", "bc", "déf"]}, "name": {"type": "string", "maxLength": 6}},
    "required": ["id", "ok", "tag", "name"], "additionalProperties": False}
REGEX = r"[a-z]{2,4}-[0-9]{1,3}"
CHOICES = ["yes", "no", "maybe not"]
LARK = 'start: sum\nsum: NUMBER | NUMBER "+" NUMBER | NUMBER "+" NUMBER "+" NUMBER\nNUMBER: /[1-9][0-9]{0,2}/\n'
LARK_LANGUAGE = r"[1-9][0-9]{0,2}(\+[1-9][0-9]{0,2}){0,2}"
# Each kind with a check of a finished output, written without llguidance.
KINDS = {
    "json": (Structured(json=SCHEMA), lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
    "json_object": (Structured(json_object=True), lambda t: isinstance(json.loads(t), dict)),
    "regex": (Structured(regex=REGEX), lambda t: re.fullmatch(REGEX, t) is not None),
    "choice": (Structured(choice=CHOICES), lambda t: t in CHOICES),
    "grammar": (Structured(grammar=LARK), lambda t: re.fullmatch(LARK_LANGUAGE, t) is not None),
}


@pytest.fixture(scope="module")
def smol_tokenizer(default_gguf_path):
    return Tokenizer.from_gguf_fields(open_gguf(default_gguf_path))


@pytest.fixture(scope="module")
def tiny_smol_dir(smol_tokenizer, tmp_path_factory):
    """A tiny random Llama of SmolLM2's vocabulary, with SmolLM2's tokenizer saved beside it as an HF directory's
    (Tokenizer.save): the byte-level BPE of an HF checkpoint (no Qwen3 tokenizer can be fetched offline)."""
    path = tmp_path_factory.mktemp("tiny-smol")
    save_tiny_model("llama", path, vocab_size=smol_tokenizer.vocab_size)
    smol_tokenizer.save(path)
    return path


@pytest.fixture(scope="module")
def tokenizers_by_name(smol_tokenizer, tiny_smol_dir, gemma3_llm):
    return {"smollm2-gguf": smol_tokenizer, "smollm2-hf-dir": Tokenizer.from_hf_dir(tiny_smol_dir),
            "gemma3-gguf": gemma3_llm.tokenizer}  # from its GGUF: the shared engine's (reading the file is slow)


@pytest.fixture(scope="module")
def tiny(tiny_smol_dir):
    return make_llm(tiny_smol_dir, max_model_len=160, max_num_batched_tokens=32)


def greedy(kind: str, **kw) -> SamplingParams:
    return SamplingParams(**{"temperature": 0, "max_tokens": 120, "structured_outputs": KINDS[kind][0], **kw})


def assert_valid(kind: str, completion) -> None:
    assert completion.finish_reason == "stop", (kind, completion.text, completion.finish_reason)
    assert KINDS[kind][1](completion.text), (kind, completion.text)


# ---- the bridge ----

TOKENIZERS = ["smollm2-gguf", "smollm2-hf-dir", "gemma3-gguf"]


@pytest.mark.parametrize("name", TOKENIZERS)
def test_the_mask_allows_exactly_what_the_matcher_takes(tokenizers_by_name, name):
    """At the start, at random cuts of a valid output and at its end, the parallel fill's mask allows exactly the
    tokens llguidance's matcher takes one at a time (a brute force over the whole vocabulary), but where the grammar
    forces bytes (it then allows its own tokenization's first token, not the ones that spell less of them), and EOS,
    allowed alone at the end."""
    tok = tokenizers_by_name[name]
    V = tok.vocab_size
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "n": {"type": "integer"},
                                               "tag": {"enum": ["café", "日本"]}},
              "required": ["name", "n", "tag"], "additionalProperties": False}
    grammar = compile_grammar(Structured(json=schema), tok, V)
    ids = tok.encode('{"name": "Zoë 🦊", "n": -42, "tag": "日本"}', add_special_tokens=False)
    seed = int(np.random.default_rng().integers(1 << 31))
    cuts = sorted({0, len(ids)} | set(np.random.default_rng(seed).integers(1, len(ids), 2).tolist()))
    for cut in cuts:
        m = grammar.matcher()
        assert all(m.accept(t) for t in ids[:cut])
        allowed = set(allowed_ids(fill_masks([m])[0], V).tolist())
        brute = {t for t in range(V) if m.allows([t]) == 1}
        where = f"{name}, seed {seed}, after {cut} tokens"
        if cut == len(ids):
            assert allowed == set(tok.eos_token_ids) and not brute and m.is_terminated, where
            continue
        forced, spelled = m.forced_bytes, [tok.token_bytes(t) for t in allowed]
        assert allowed <= brute and ids[cut] in brute, where
        for t in brute - allowed:
            b = tok.token_bytes(t)
            # >=: Gemma spells some bytes twice (a piece, and its <0xNN> byte-fallback token); one is allowed.
            assert forced.startswith(b) and any(forced.startswith(s) and len(s) >= len(b) for s in spelled), where


@pytest.mark.parametrize("name", TOKENIZERS)
def test_the_mask_allows_exactly_the_tokens_whose_bytes_continue_the_text(tokenizers_by_name, name):
    """Checked without llguidance: a token is allowed iff its bytes (`Tokenizer.token_bytes`) keep the text a
    prefix of the regex's language (Python's `regex`, partial matching), and EOS iff the text is a whole match."""
    tok = tokenizers_by_name[name]
    V = tok.vocab_size
    pattern = r"[a-z]+( [0-9]{1,3})?!"
    grammar = compile_grammar(Structured(regex=pattern), tok, V)
    # Only tokens spelled in the pattern's alphabet can continue it (a special token is spelled by no text).
    spelled = {t: tok.token_bytes(t).decode("utf-8", "replace") for t in range(V) if t not in tok.special_token_ids}
    candidates = {t: s for t, s in spelled.items() if re.fullmatch(r"[a-z0-9 !]+", s)}
    for prefix in ["", "ab", "abc 1", "abc 12", "xyz!"]:
        m = grammar.matcher()
        assert all(m.accept(t) for t in tok.encode(prefix, add_special_tokens=False))
        want = set(tok.eos_token_ids) if regex.fullmatch(pattern, prefix) else set()
        want |= {t for t, s in candidates.items() if regex.fullmatch(pattern, prefix + s, partial=True)}
        assert set(allowed_ids(fill_masks([m])[0], V).tolist()) == want, f"{name}, after {prefix!r}"


# ---- every kind, on real models ----

CHATS = {
    "json": "Describe a person as JSON: Alice, 30 years old, likes chess.",
    "json_object": 'Write {"color": "blue"} and nothing else.',
    "regex": "Invent a short code word and a number.",
    "choice": "Is the sky blue? Answer yes or no.",
    "grammar": "What is 12 plus 30? Write it as a sum.",
}
REAL_SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 3}},
    "required": ["name", "age", "hobbies"], "additionalProperties": False}


def _every_kind(llm: LLM) -> None:
    kinds = {**KINDS, "json": (Structured(json=REAL_SCHEMA),
                               lambda t: jsonschema.validate(json.loads(t), REAL_SCHEMA) is None)}
    conversations = [[{"role": "user", "content": CHATS[k]}] for k in kinds]
    params = [SamplingParams(temperature=0, max_tokens=60, structured_outputs=s) for s, _ in kinds.values()]
    outs = llm.chat(conversations, params, use_tqdm=False)
    for (kind, (_, check)), out in zip(kinds.items(), outs):
        c = out.outputs[0]
        assert c.finish_reason == "stop" and check(c.text), (kind, c.text, c.finish_reason)
    llm.core.assert_idle_and_clean()


def test_every_kind_on_the_default_model(default_llm):
    _every_kind(default_llm)


def test_every_kind_on_gemma3(gemma3_llm):
    _every_kind(gemma3_llm)


# ---- the engine, on a tiny random model (the HF directory's tokenizer) ----

def test_a_random_model_writes_every_kind_validly_and_seeds_repeat(tiny):
    """n = 2 samples of each kind: every output is valid and ends with the grammar ("stop", before max_tokens);
    the same seed gives the same text again."""
    prompts = ["Hello", "The answer is", "{", "x", "Once upon a time"]
    params = [SamplingParams(n=2, temperature=1.0, seed=i, max_tokens=120, structured_outputs=KINDS[k][0])
              for i, k in enumerate(KINDS)]
    first = tiny.generate(prompts, params, use_tqdm=False)
    again = tiny.generate(prompts[:1], params[:1], use_tqdm=False)
    for kind, out in zip(KINDS, first):
        for c in out.outputs:
            if kind == "json_object" and c.finish_reason == "length":  # any object: a random one may nest on
                m = compile_grammar(KINDS[kind][0], tiny.tokenizer, tiny.vocab_size).matcher()
                assert all(m.accept(t) for t in c.token_ids) and not m.is_terminated
                continue
            assert_valid(kind, c)
            assert c.text == tiny.tokenizer.decode(c.token_ids)
    assert [c.text for c in first[0].outputs] == [c.text for c in again[0].outputs]
    assert first[0].outputs[0].text != first[0].outputs[1].text  # n samples of one seed differ
    tiny.core.assert_idle_and_clean()


def test_the_grammars_end_ends_the_sequence_and_max_tokens_may_cut_it(tiny):
    done, cut = tiny.generate(["Well", "Well"], [
        SamplingParams(temperature=1.0, seed=3, max_tokens=50, ignore_eos=True, structured_outputs=KINDS["choice"][0]),
        SamplingParams(temperature=1.0, seed=3, max_tokens=3, structured_outputs=KINDS["json"][0])], use_tqdm=False)
    c = done.outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason is None and c.text in CHOICES
    assert len(c.token_ids) < 50
    c = cut.outputs[0]
    assert c.finish_reason == "length" and len(c.token_ids) == 3 and c.text.startswith('{"id":')


def test_stop_strings_and_logprobs_under_a_grammar(tiny):
    out = tiny.generate("Code:", SamplingParams(temperature=0.8, seed=5, max_tokens=40, stop=["-"], logprobs=3,
                                                structured_outputs=KINDS["regex"][0]), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == "-"
    assert re.fullmatch(r"[a-z]{2,4}", out.text), out.text
    assert len(out.logprobs) == len(out.token_ids)
    for token, entry in zip(out.token_ids, out.logprobs):
        assert token in entry and len(entry) >= 3  # the chosen token's, and the model's top 3 (masked or not)
        assert all(lp.logprob <= 0 for lp in entry.values())


def test_streaming_under_a_grammar(tiny_smol_dir):
    async def run():
        engine = AsyncEngine(make_llm(tiny_smol_dir, max_model_len=160, max_num_batched_tokens=32))
        try:
            texts, finish = {0: "", 1: ""}, {}
            stream = await engine.add_request("Hi", SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=120,
                                                                   structured_outputs=KINDS["json"][0]))
            async for out in stream:
                for c in out.outputs:
                    texts[c.index] += c.text
                    if c.finish_reason:
                        finish[c.index] = c.finish_reason
            return texts, finish
        finally:
            engine.shutdown()

    texts, finish = asyncio.run(run())
    assert finish == {0: "stop", 1: "stop"}
    for text in texts.values():
        jsonschema.validate(json.loads(text), SCHEMA)


def test_a_slow_compile_leaves_the_event_loop_free(tiny_smol_dir):
    """A schema that takes a while to compile is compiled on a thread: the event loop goes on meanwhile."""
    big = {"type": "object", "properties": {f"field_{i}": {"type": "string", "pattern": f"[a-z]{{1,{i % 7 + 2}}}x"}
                                            for i in range(1500)}}

    async def run():
        engine = AsyncEngine(make_llm(tiny_smol_dir, max_model_len=160))
        compile_grammar(Structured(regex="a"), engine.tokenizer, engine.vocab_size)  # the bridge
        grammar_module._cache.clear()
        gaps, stop = [], asyncio.Event()

        async def tick():
            last = time.perf_counter()
            while not stop.is_set():
                await asyncio.sleep(0.005)
                now = time.perf_counter()
                gaps.append(now - last)
                last = now
        ticker = asyncio.create_task(tick())
        try:
            start = time.perf_counter()
            stream = await engine.add_request("Hi", SamplingParams(max_tokens=2, structured_outputs=Structured(
                json=big)))
            took = time.perf_counter() - start
            async for _ in stream:
                pass
            return took, max(gaps)
        finally:
            stop.set()
            await ticker
            engine.shutdown()

    took, worst_gap = asyncio.run(run())
    # The compile took long enough to see (~0.2-1 s by machine; the loop ticks every 5 ms), and no tick waited
    # for it: compiled on the event loop, one gap would be the whole compile.
    assert took > 0.05 and worst_gap < took / 2, (took, worst_gap)


BAD = [
    (Structured(json="{not json"), "structured_outputs.json: not valid JSON"),
    (Structured(json="[1, 2]"), "structured_outputs.json: a JSON schema is an object"),
    (Structured(json={"type": "strin"}), "structured_outputs.json: .*strin"),
    (Structured(json={"type": "array", "uniqueItems": True}), "structured_outputs.json: .*uniqueItems"),
    (Structured(json={"type": "string", "format": "bogus"}), "structured_outputs.json: .*bogus"),
    (Structured(json={"$ref": "#/nowhere"}), "structured_outputs.json: .*nowhere"),
    (Structured(regex="(("), "structured_outputs.regex: .*unclosed group"),
    (Structured(regex="a" * (grammar_module.MAX_SPEC_CHARS + 1)), "structured_outputs.regex: .* at most"),
    (Structured(grammar="start: foo"), "structured_outputs.grammar: .*foo"),
    (Structured(choice=[f"choice number {i}" for i in range(30_000)]), "structured_outputs.choice: .* at most"),
    # 3 kB that multiply out (allOf of anyOfs) to 8 ** 5 alternatives: past llguidance's bound on a grammar's size
    (Structured(json={"allOf": [{"anyOf": [{"type": "object", "properties": {f"k{j}_{i}": {"type": "integer"}}}
                                           for i in range(8)]} for j in range(5)]}),
     "structured_outputs.json: .*too large"),
]


def test_a_bad_grammar_is_refused_and_hurts_no_other_request(tiny):
    good = tiny.add_request("Hello", SamplingParams(temperature=1.0, seed=1, max_tokens=120,
                                                    structured_outputs=KINDS["json"][0]))
    tiny.step()
    for spec, message in BAD:
        with pytest.raises(ValueError, match="(?s)" + message):
            tiny.make_request("Hello", SamplingParams(structured_outputs=spec))
        tiny.step()
    aborted = tiny.add_request("Hello", SamplingParams(max_tokens=100, structured_outputs=KINDS["json_object"][0]))
    tiny.step()
    tiny.abort_request(aborted.request_id)
    assert aborted.seqs[0].output.grammar is None  # its matcher let go at once
    while tiny.has_unfinished_requests():
        tiny.step()
    c = good.seqs[0]
    assert c.finish_reason == "stop" and c.output.grammar is None
    jsonschema.validate(json.loads(c.text), SCHEMA)
    tiny.core.assert_idle_and_clean()


def test_a_model_without_a_tokenizer_cannot_take_a_grammar(tiny_dir):
    with pytest.raises(ValueError, match="structured_outputs.regex: .*tokenizer"):
        make_llm(tiny_dir).make_request({"prompt_token_ids": [1, 2]}, SamplingParams(
            structured_outputs=Structured(regex="a")))


def test_speculation_leaves_a_constrained_greedy_output_unchanged(tiny_tokenized_dir):
    """Beside sequences that speculate (n-gram, every step), a constrained greedy sequence does not, and writes
    what it writes without speculation. (The 320-token model: a random model of SmolLM2's vocabulary never repeats
    itself, so prompt lookup would find nothing to propose.)"""
    seed = int(np.random.default_rng().integers(1 << 31))
    pattern = np.random.default_rng(seed).integers(0, 319, 5).tolist()
    repetitive = {"prompt_token_ids": pattern * 4}
    plain = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    prompts = ["Hello", repetitive, "Once", repetitive]
    params = [greedy("json"), plain, greedy("regex"), plain]
    want = [o.outputs[0].token_ids for o in make_llm(tiny_tokenized_dir, max_model_len=160).generate(
        prompts, params, use_tqdm=False)]
    spec = make_llm(tiny_tokenized_dir, max_model_len=160, speculative_config=dict(
        method="ngram", num_speculative_tokens=3, prompt_lookup_min=1, adaptive=False))
    propose = spec.core.proposer.propose

    def checked(plan):
        assert not any(s.output.grammar is not None for s in plan.num_draft), "a constrained row speculates"
        return propose(plan)
    spec.core.proposer.propose = checked
    got = [o.outputs[0].token_ids for o in spec.generate(prompts, params, use_tqdm=False)]
    assert got == want, f"seed {seed}"
    assert spec.stats().spec_decode_num_drafts > 0, f"seed {seed}"


def test_preemption_leaves_the_grammar_in_step(tiny, tiny_smol_dir):
    """Greedy constrained sequences in a KV cache too small for all of them: preempted and recomputed, they write
    what they write with room to spare."""
    prompts = ["Hello there", "The answer is", "{", "Once upon a time there"]
    kinds = ("json", "json", "json", "grammar")
    want = [o.outputs[0].token_ids for o in tiny.generate(prompts, [greedy(k) for k in kinds], use_tqdm=False)]
    small = make_llm(tiny_smol_dir, max_model_len=48, kv_cache_memory_bytes=14 * TINY_PAGE_BYTES)  # 52 tokens
    outs = small.generate(prompts, [greedy(k, max_tokens=40) for k in kinds], use_tqdm=False)
    assert small.stats().num_preemptions > 0
    for o, w in zip(outs, want):
        n = len(o.outputs[0].token_ids)
        assert o.outputs[0].token_ids == w[:n]
    small.core.assert_idle_and_clean()
