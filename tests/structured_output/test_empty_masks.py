"""Constraints that leave nothing to sample (issue 48, item 7): refused up front where the request alone shows it,
otherwise the sequence ends with finish reason "error" and never takes a token its masks forbid; a failed grammar
ends with "error" too, not "stop" like a complete one. On the tiny random model with a byte-level tokenizer (320
ids, EOS 319), through the whole engine: the device's sampler, the host's masks and the output processor."""
import pytest

from jaxserve import SamplingParams
from jaxserve.batching.step_plan import ScheduledBatch
from jaxserve.batching.step_rows import constrain, row_sampling
from jaxserve.runner.batch_builder import Row
from jaxserve.sample.token_mask import allowed_ids
from jaxserve.sampling_params import ParamError
from jaxserve.sampling_params import StructuredOutputsParams as Structured
from jaxserve.structured_output import fill_masks

from fake_runner import ScriptedRunner, fake_llm
from tiny import make_llm

EOS = 319


@pytest.fixture(scope="module")
def llm(tiny_tokenized_dir):
    return make_llm(tiny_tokenized_dir, max_model_len=64)


def token(llm, text: str) -> int:
    (t,) = llm.tokenizer.encode(text, add_special_tokens=False)
    return t


def run(llm, params: SamplingParams):
    """The one completion of a request, the engine checked clean after it (no page or slot kept)."""
    request = llm.add_request("Hello", params)
    while llm.has_unfinished_requests():
        llm.step()
    llm.core.assert_idle_and_clean()
    return request.seqs[0]


@pytest.mark.parametrize("params, message", [
    # EOS the only allowed token, which min_tokens bans (it sampled token 0 four times, then EOS: "stop").
    (dict(allowed_token_ids=[EOS], min_tokens=4), "allowed_token_ids leave no token .* min_tokens"),
    (dict(allowed_token_ids=[7, EOS], stop_token_ids=[7], min_tokens=1), "allowed_token_ids leave no token"),
    # A choice written before min_tokens (it answered "a", "stop").
    (dict(structured_outputs=Structured(choice=["a", "bc"]), min_tokens=5), "min_tokens .* structured_outputs.choice"),
])
def test_a_statically_empty_allowed_set_is_refused(llm, params, message):
    with pytest.raises(ValueError, match=message):
        llm.make_request("Hello", SamplingParams(max_tokens=8, **params))


def test_allowed_tokens_all_bad_words_are_refused(llm):
    with pytest.raises(ValueError, match="bad_words forbid all of them"):
        llm.make_request("Hello", SamplingParams(allowed_token_ids=[token(llm, "x")], bad_words=["x"]))


def test_what_min_tokens_or_ignore_eos_leaves_is_not_refused(llm):
    """EOS alone is fine without min_tokens (the output ends at once), and with ignore_eos (EOS is not banned)."""
    assert run(llm, SamplingParams(max_tokens=8, allowed_token_ids=[EOS])).finish_reason == "stop"
    seq = run(llm, SamplingParams(max_tokens=3, min_tokens=2, ignore_eos=True, allowed_token_ids=[EOS]))
    assert seq.finish_reason == "length" and seq.output_token_ids == [EOS] * 3
    llm.make_request("Hello", SamplingParams(structured_outputs=Structured(choice=["a", "abcde"]), min_tokens=5))


@pytest.mark.parametrize("params, param", [
    (dict(allowed_token_ids=["b"]), "allowed_token_ids"),  # ran, and ended "error" with ""
    (dict(allowed_token_ids=["b", "<eos>"], min_tokens=1, regex="a*"), "allowed_token_ids"),
    (dict(bad_words=["a"]), "bad_words"),
    (dict(min_tokens=2, ignore_eos=True, regex=""), "min_tokens"),  # EOS is the grammar's end: banned all the same
])
def test_a_grammar_with_no_first_token_is_refused(llm, params, param):
    """The grammar's first mask is known once it is compiled: where allowed_token_ids, bad_words and min_tokens'
    ban leave none of it, the request is refused (a ParamError naming the field, a 400 on the server)."""
    ids = {"a": token(llm, "a"), "b": token(llm, "b"), "<eos>": EOS}
    regex = params.pop("regex", "a+")
    if "allowed_token_ids" in params:
        params["allowed_token_ids"] = [ids[t] for t in params["allowed_token_ids"]]
    with pytest.raises(ParamError, match="leave no first token that structured_outputs.regex allows") as e:
        llm.make_request("Hello", SamplingParams(max_tokens=8, structured_outputs=Structured(regex=regex), **params))
    assert e.value.param == param
    llm.make_request("Hello", SamplingParams(max_tokens=8, structured_outputs=Structured(regex="[ab]+"),
                                             allowed_token_ids=[ids["b"]], min_tokens=3))


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_grammar_disjoint_from_allowed_token_ids_later_ends_in_error(llm, temperature):
    """The regex allows "a" then "b", allowed_token_ids only "a": the first token is possible (not refused), the
    second has nothing to sample, so the sequence ends "error" after "a"."""
    seq = run(llm, SamplingParams(temperature=temperature, seed=1, max_tokens=8, allowed_token_ids=[token(llm, "a")],
                                  structured_outputs=Structured(regex="ab")))
    assert seq.finish_reason == "error" and seq.output_token_ids == [token(llm, "a")] and seq.text == "a"


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_ignore_eos_with_a_grammar_still_bans_eos_before_min_tokens(llm, temperature):
    """The grammar's mask allows EOS wherever the grammar may end ("[a-z]+" after one letter), and taking it
    completes the grammar: under ignore_eos min_tokens did not ban it, so a row that liked EOS took it at once and
    ended "error" (grammar complete before min_tokens). EOS is banned until min_tokens, then ends it "stop"."""
    seq = run(llm, SamplingParams(temperature=temperature, seed=4, max_tokens=8, min_tokens=4, ignore_eos=True,
                                  logit_bias={EOS: 100.0}, structured_outputs=Structured(regex="[a-z]+")))
    assert seq.finish_reason == "stop", (seq.finish_reason, seq.output_token_ids)
    assert len(seq.output_token_ids) == 5 and seq.output_token_ids[-1] == EOS and len(seq.text) == 4


def test_a_grammar_complete_before_min_tokens_ends_in_error(llm):
    """After "a" the regex allows only EOS, which min_tokens bans (it ended "stop" after one token)."""
    seq = run(llm, SamplingParams(temperature=1.0, seed=2, max_tokens=8, min_tokens=5,
                                  structured_outputs=Structured(regex="a")))
    assert seq.finish_reason == "error" and seq.text == "a" and seq.output_token_ids == [token(llm, "a")]
    seq = run(llm, SamplingParams(temperature=1.0, seed=2, max_tokens=8, min_tokens=1,
                                  structured_outputs=Structured(regex="a")))
    assert seq.finish_reason == "stop" and seq.text == "a"


def test_a_failed_grammar_ends_in_error(llm):
    """A grammar that fails while the sequence runs (a per-step limit of llguidance's; here a token it refuses) ended
    "stop" like a matched output; now "error", after at most the token already in flight."""
    request = llm.add_request("Hello", SamplingParams(temperature=1.0, seed=3, max_tokens=20,
                                                      structured_outputs=Structured(regex="[a-z]{10}")))
    seq = request.seqs[0]
    while not seq.output_token_ids:
        llm.step()
    taken = list(seq.output_token_ids)
    assert not seq.output.grammar.accept(token(llm, "7")) and seq.output.grammar.failed
    while llm.has_unfinished_requests():
        llm.step()
    # The failed grammar refuses any token: the one in flight, if any, is not taken.
    assert seq.finish_reason == "error" and seq.output_token_ids == taken
    llm.core.assert_idle_and_clean()


def scripted_llm(llm, text: str):
    """An engine over a model that writes `text` (then EOS) whatever it is asked, masks or not: a grammar refuses
    what it writes outside it. The tiny model's byte-level tokenizer."""
    script = llm.tokenizer.encode(text, add_special_tokens=False)
    return fake_llm(vocab_size=llm.vocab_size, tokenizer=llm.tokenizer,
                    runner=ScriptedRunner(script, EOS, llm.vocab_size))


@pytest.mark.parametrize("text, kept", [("ab7cd", "ab"), ("7", "")])
def test_a_token_the_grammar_refuses_is_not_taken(llm, text, kept):
    """The grammar refuses "7": the sequence ends "error" with what came before it; the refused token is in no part
    of the output (it was in the text, the token ids, the logprobs and the count), and a sequence that took no
    token has no first-token time (it had one)."""
    fake = scripted_llm(llm, text)
    ids = [token(llm, ch) for ch in kept]
    params = SamplingParams(max_tokens=8, logprobs=1, structured_outputs=Structured(regex="[a-z]{10}"))
    (out,) = fake.generate(["Hello"], params)
    (c,) = out.outputs
    assert c.finish_reason == "error" and c.text == kept and c.token_ids == ids and len(c.logprobs) == len(kept)
    assert (out.metrics.first_token_time is None) == (not kept), out.metrics
    (seq,) = fake.add_request("Hello", params).seqs
    while fake.has_unfinished_requests():
        fake.step()
    assert seq.output.num_tokens == len(kept) and seq.output_token_ids == ids and seq.finish_reason == "error"
    fake.core.assert_idle_and_clean()


def test_a_failed_grammars_mask_allows_nothing(llm):
    """llguidance's mask of a failed grammar allows EOS, as a complete one's: the row would sample EOS and end
    "stop". The step's mask for it allows nothing instead, so the device ends it (NO_TOKEN); a sound grammar's row
    gets its grammar's mask ANDed with allowed_token_ids."""
    def planned(grammar_text, allowed=None):
        seq = llm.make_request("Hello", SamplingParams(max_tokens=8, allowed_token_ids=allowed,
                                                       structured_outputs=Structured(regex=grammar_text))).seqs[0]
        plan = ScheduledBatch(decode=[seq], prefill=[], rows=[Row([1], 0, [1], row_sampling(seq), slot=0)])
        return seq, plan

    a, b = token(llm, "a"), token(llm, "b")
    seq, plan = planned("[ab]+", [b, EOS])
    constrain(plan)
    assert allowed_ids(plan.rows[0].sampling.token_mask, llm.vocab_size).tolist() == [b] and plan.constrained
    seq, plan = planned("[ab]+")
    assert seq.output.grammar.accept(a) and not seq.output.grammar.accept(token(llm, "7"))
    assert allowed_ids(fill_masks([seq.output.grammar])[0], llm.vocab_size).tolist() == [EOS]  # llguidance's
    constrain(plan)
    assert allowed_ids(plan.rows[0].sampling.token_mask, llm.vocab_size).tolist() == []
