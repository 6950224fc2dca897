"""A sequence's stop rules on the host, with a fake detokenizer: stop strings never leak into what is streamed,
and the ending-token sets are bounded."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxserve.batch import StepOutput
from jaxserve.batching.output_processor import process
from jaxserve.batching.sequence import Sequence
from jaxserve.batching.step_rows import row_sampling
from jaxserve.sample.sampling import NO_TOKEN
from jaxserve.sampling_params import MAX_STOP, MAX_STOP_LENGTH, MAX_STOP_TOKEN_IDS, SamplingParams


class PieceDetokenizer:
    """Token i decodes to pieces[i]."""

    def __init__(self, pieces):
        self.pieces = pieces

    def add(self, token_id):
        return self.pieces[token_id]


def take_token(seq, token):
    """One step's result of one row that emitted `token`, through the output processor: the text it streams."""
    one = np.zeros((1, 1), np.float32)
    result = StepOutput(tokens=np.array([[token]], np.int32), num_tokens=np.ones(1, np.int32), logprobs=one,
                        ranks=np.ones((1, 1), np.int32), top_ids=np.zeros((1, 1, 1), np.int32),
                        top_logprobs=np.zeros((1, 1, 1), np.float32))
    (delta,) = process([seq], result)
    return delta.completion.text


def run(pieces, **params):
    """Feeds every piece in order; returns (the streamed deltas, the sequence)."""
    seq = Sequence("r", 0, [0], SamplingParams(**{"max_tokens": len(pieces), **params}), 0, 10_000, [],
                   PieceDetokenizer(pieces))
    deltas = []
    for i in range(len(pieces)):
        deltas.append(take_token(seq, i))
        if seq.finish_reason:
            break
    return deltas, seq


def test_a_stop_string_split_over_tokens_is_never_streamed():
    deltas, seq = run([" Get", " enough", " sleep", "\n", "\n", "These", " tips"], stop=["\n\nThese"])
    assert "".join(deltas) == seq.text == " Get enough sleep"
    assert seq.finish_reason == "stop" and seq.stop_reason == "\n\nThese"
    assert deltas[3:] == ["", "", ""]  # the newlines were held back, then dropped with the stop string


def test_held_back_text_is_released_when_it_cannot_become_a_stop_string():
    deltas, seq = run(["a", "\n", "\n", "Th", "ose", "!"], stop=["\n\nThese"])
    assert deltas == ["a", "", "", "", "\n\nThose", "!"]
    assert seq.text == "a\n\nThose!" and seq.finish_reason == "length"


def test_held_back_text_is_released_when_the_sequence_ends_otherwise():
    deltas, seq = run(["x", "\n\nThe"], stop=["\n\nThese"])  # ends at max_tokens mid-prefix
    assert "".join(deltas) == seq.text == "x\n\nThe" and seq.finish_reason == "length"
    seq = Sequence("r", 0, [0], SamplingParams(max_tokens=8, stop=["\n\nThese"]), 0, 10_000, [7],
                   PieceDetokenizer({1: "x", 2: "\n\nThe", 7: "<eos>"}))
    assert [take_token(seq, t) for t in (1, 2, 7)] == ["x", "", "\n\nThe"]
    assert seq.text == "x\n\nThe" and seq.finish_reason == "stop" and seq.stop_reason is None


def test_include_stop_str_in_output_streams_the_stop_string():
    deltas, seq = run(["a", "b", "STO", "P", "c"], stop=["STOP"], include_stop_str_in_output=True)
    assert "".join(deltas) == seq.text == "abSTOP"


@settings(max_examples=400, deadline=None)
@given(pieces=st.lists(st.text("ab\n", max_size=4), min_size=1, max_size=12),
       stops=st.lists(st.text("ab\n", min_size=1, max_size=4), min_size=1, max_size=3),
       include=st.booleans(), min_tokens=st.integers(0, 4))
def test_streamed_text_is_always_a_prefix_of_the_final_text(pieces, stops, include, min_tokens):
    min_tokens = min(min_tokens, len(pieces))
    deltas, seq = run(pieces, stop=stops, include_stop_str_in_output=include, min_tokens=min_tokens)
    final = "".join(deltas)
    assert final == seq.text
    # The reference: from min_tokens on, the first stop string that a piece completes (earliest start) ends the
    # text; one written wholly before min_tokens stays.
    text = ""
    for n, piece in enumerate(pieces, 1):
        old, text = len(text), text + piece
        found = [(text.find(s, max(0, old - len(s) + 1)), s) for s in stops]
        found = [(at, s) for at, s in found if at >= 0]
        if piece and n >= min_tokens and found:
            at, stop = min(found)
            text = text[:at + (len(stop) if include else 0)]
            assert seq.stop_reason == stop
            break
    assert final == text


def test_stop_limits_are_enforced():
    SamplingParams(stop=["x" * MAX_STOP_LENGTH] * MAX_STOP, stop_token_ids=list(range(MAX_STOP_TOKEN_IDS)))
    for bad in [dict(stop=["x"] * (MAX_STOP + 1)), dict(stop=["x" * (MAX_STOP_LENGTH + 1)]),
                dict(stop_token_ids=list(range(MAX_STOP_TOKEN_IDS + 1))), dict(stop_token_ids=[True])]:
        with pytest.raises(ValueError):
            SamplingParams(**bad)


def test_ending_tokens_are_banned_once_each():
    seq = Sequence("r", 0, [0], SamplingParams(min_tokens=2, stop_token_ids=[5, 2, 5]), 0, 100, [2, 3])
    assert row_sampling(seq).banned == (2, 3, 5)


def test_a_ban_list_past_the_device_width_is_a_clear_error():
    from jaxserve.runner.batch_builder import Row, RowSampling, build_batch
    from jaxserve.sampling_params import MAX_BANNED_TOKENS
    row = Row([1], 0, [1], RowSampling(banned=tuple(range(MAX_BANNED_TOKENS + 1))))
    with pytest.raises(ValueError, match="bans"):
        build_batch([row], 4, 320, 1, 1, 1)
    build_batch([Row([1], 0, [1], RowSampling(banned=tuple(range(MAX_BANNED_TOKENS))))], 4, 320, 1, 1, 1)


def emitted(seq, tokens):
    """One verification row's result that emitted `tokens`, through the output processor: the delta."""
    q = len(tokens)
    result = StepOutput(tokens=np.array([tokens], np.int32), num_tokens=np.array([q], np.int32),
                        logprobs=np.zeros((1, q), np.float32), ranks=np.ones((1, q), np.int32),
                        top_ids=np.zeros((1, q, 1), np.int32), top_logprobs=np.zeros((1, q, 1), np.float32))
    (delta,) = process([seq], result)
    return delta


def test_a_row_left_no_token_ends_in_error_taking_nothing():
    """NO_TOKEN (the device found the row's masks and bans left nothing) ends the sequence with "error": no token
    is taken for it, nor any after it; the tokens before it (accepted proposals) are taken as usual."""
    seq = Sequence("r", 0, [0], SamplingParams(max_tokens=10), 0, 100, [9], PieceDetokenizer("abcdefgh"))
    delta = emitted(seq, [1, 2, NO_TOKEN, 3])
    assert delta.finished and seq.finish_reason == "error" and seq.stop_reason is None
    assert delta.token_ids == [1, 2] and delta.completion.text == seq.text == "bc"
    assert seq.output.num_tokens == 2
    alone = Sequence("r", 0, [0], SamplingParams(max_tokens=10), 0, 100, [9], PieceDetokenizer("abcdefgh"))
    delta = emitted(alone, [NO_TOKEN])
    assert delta.finished and alone.finish_reason == "error" and delta.token_ids == [] and alone.text == ""
