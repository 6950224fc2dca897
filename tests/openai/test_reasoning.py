"""The reasoning parsers (vLLM's qwen3 and deepseek_r1) on outputs in their documented formats, fed whole and in
pieces split anywhere: the same split whichever way the text arrives, and never a part of a tag shown."""
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxserve.openai.reasoning import REASONING_PARSERS, DeepSeekR1ReasoningParser, Qwen3ReasoningParser, split_whole

from locations import DATA

CASES = json.loads((DATA / "reasoning_outputs.json").read_text())["cases"]


def fed(parser, pieces: list[str]) -> tuple[str, str]:
    """(reasoning, answer) from feeding `pieces`, each delta checked: no text given out is ever a tag's start that
    a later piece completes (it would have to be taken back)."""
    reasoning = answer = ""
    for piece in pieces:
        r, a = parser.feed(piece)
        reasoning, answer = reasoning + r, answer + a
    r, a = parser.finish()
    return reasoning + r, answer + a


def pieces_at(text: str, cuts: list[int]) -> list[str]:
    bounds = [0, *sorted(set(cuts)), len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_whole_outputs_split_as_documented(case):
    parser = REASONING_PARSERS[case["parser"]]()
    assert split_whole(parser, case["output"]) == (case["reasoning"], case["answer"])
    assert parser.ended == (case["answer"] != "" or case["reasoning"] == "" and case["parser"] == "qwen3")


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_every_two_piece_split_gives_the_same(case):
    text = case["output"]
    for cut in range(len(text) + 1):
        parser = REASONING_PARSERS[case["parser"]]()
        assert fed(parser, pieces_at(text, [cut])) == (case["reasoning"], case["answer"]), f"cut at {cut}"


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(case=st.sampled_from(CASES), data=st.data())
def test_any_chunking_gives_the_same(case, data):
    """Random chunkings (hypothesis, derandomized: a failure reproduces, its chunking printed)."""
    text = case["output"]
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=len(text)), label="cuts")
    parser = REASONING_PARSERS[case["parser"]]()
    pieces = pieces_at(text, cuts)
    assert fed(parser, pieces) == (case["reasoning"], case["answer"]), pieces


def test_one_character_at_a_time_never_shows_a_tag_piece():
    """Fed character by character, each delta is final: the answer's text never holds a piece of the end tag that
    turned out to be the tag, and reasoning never shows the start tag."""
    text = "<think>\nabc </thin </think>\n\nanswer"
    parser = Qwen3ReasoningParser()
    shown = [parser.feed(ch) for ch in text] + [parser.finish()]
    assert "".join(r for r, _ in shown) == "\nabc </thin "
    assert "".join(a for _, a in shown) == "\n\nanswer"
    # Held back exactly while it could be the tag: "</thin" held, then released as reasoning at the space.
    assert all("</think>" not in r and "<think>" not in r for r, _ in shown)


def test_ended_is_when_the_answer_starts():
    parser = DeepSeekR1ReasoningParser()
    assert parser.feed("think ") == ("think ", "") and not parser.ended
    assert parser.feed("</thi") == ("", "") and not parser.ended
    assert parser.feed("nk>{") == ("", "{") and parser.ended
    qwen = Qwen3ReasoningParser()
    assert qwen.feed("  ") == ("", "") and not qwen.ended  # whitespace: a block may still open
    assert qwen.feed("{") == ("", "  {") and qwen.ended


@pytest.mark.parametrize("name", sorted(REASONING_PARSERS))
def test_a_prompt_that_closed_the_block_leaves_all_answer(name):
    """Qwen3's template with enable_thinking false ends the prompt with an empty block: the output is answer."""
    cls = REASONING_PARSERS[name]
    prompt = "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert cls.prompt_ends_reasoning(prompt)
    assert not cls.prompt_ends_reasoning("<|im_start|>assistant\n<think>\n")
    assert not cls.prompt_ends_reasoning("<|im_start|>assistant\n")
    parser = cls(prompt_ended=True)
    assert parser.ended and split_whole(parser, "x</think>y") == ("", "x</think>y")
