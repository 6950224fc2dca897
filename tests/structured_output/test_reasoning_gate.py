"""A grammar that starts after a reasoning model's end tag (`StructuredOutputsParams.starts_after`, vLLM's
`reasoning_ended`): the output is free, unmasked and not matched, up to the tag's last token; the grammar holds
from the next token. On the tiny random model with its byte-level tokenizer (320 ids, EOS 319), through the whole
engine, and on a scripted model that writes what it is told whatever the masks allow."""
import json
import re

import pytest

from jaxserve import SamplingParams
from jaxserve.sampling_params import ParamError
from jaxserve.sampling_params import StructuredOutputsParams as Structured

from fake_runner import ScriptedRunner, fake_llm
from tiny import make_llm

EOS = 319
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
          "additionalProperties": False}


@pytest.fixture(scope="module")
def llm(tiny_tokenized_dir):
    return make_llm(tiny_tokenized_dir, max_model_len=96)


def ids(llm, text: str) -> list[int]:
    return llm.tokenizer.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("seed", [11, 12, 13])
def test_the_mask_applies_from_the_token_after_the_tag(llm, seed):
    """Sampling over {a, b, c}: free until the first "cc" (a two-token tag), then exactly the grammar's four of
    [ab] and the grammar's end ("stop"). Without the gate the grammar would allow no "c" at all."""
    (a,), (b,), (c,) = ids(llm, "a"), ids(llm, "b"), ids(llm, "c")
    params = SamplingParams(temperature=1.0, seed=seed, max_tokens=80, allowed_token_ids=[a, b, c],
                            structured_outputs=Structured(regex="[ab]{4}", starts_after=[c, c]))
    (out,) = llm.generate(["Hello"], params)
    text = out.outputs[0].text
    assert re.fullmatch(r"(?:[ab]|c(?=[ab]))*cc[ab]{4}", text), f"seed {seed}: {text!r}"
    assert out.outputs[0].finish_reason == "stop", f"seed {seed}: {out.outputs[0]}"
    llm.core.assert_idle_and_clean()


def scripted(llm, text: str):
    return fake_llm(vocab_size=llm.vocab_size, tokenizer=llm.tokenizer, max_model_len=96, num_pages=64,
                    runner=ScriptedRunner(ids(llm, text), EOS, llm.vocab_size))


def test_free_text_inside_think_and_json_after(llm):
    """A model that reasons in text no JSON grammar takes, then answers: the reasoning passes, the answer is held to
    the schema (the grammar ends the sequence once the object is complete)."""
    think = '<think>\nThe schema wants {"a": int}. Not this: {oops</think>'
    fake = scripted(llm, think + '{"a": 42} and more')
    gated = Structured(json=SCHEMA, starts_after=ids(llm, "</think>"))
    (out,) = fake.generate(["Hello"], SamplingParams(max_tokens=90, structured_outputs=gated))
    c = out.outputs[0]
    assert c.finish_reason == "stop" and c.text == think + '{"a": 42}'
    assert json.loads(c.text.split("</think>")[1]) == {"a": 42}
    # Without the gate the grammar refuses the first token ("<"): nothing is taken.
    (out,) = fake.generate(["Hello"], SamplingParams(max_tokens=90, structured_outputs=Structured(json=SCHEMA)))
    assert out.outputs[0].finish_reason == "error" and out.outputs[0].text == ""
    fake.core.assert_idle_and_clean()


def test_an_answer_outside_the_grammar_after_the_tag_fails(llm):
    fake = scripted(llm, "<think>ok</think>not json")
    gated = Structured(json=SCHEMA, starts_after=ids(llm, "</think>"))
    (out,) = fake.generate(["Hello"], SamplingParams(max_tokens=60, structured_outputs=gated))
    assert out.outputs[0].finish_reason == "error" and out.outputs[0].text == "<think>ok</think>"
    fake.core.assert_idle_and_clean()


@pytest.mark.parametrize("bad", [[], [-1], ["a"], [2 ** 31], 7])
def test_starts_after_is_token_ids(bad):
    with pytest.raises(ParamError, match="starts_after"):
        Structured(json_object=True, starts_after=bad)
