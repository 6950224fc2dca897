"""Reasoning output: a model's `<think>...</think>` block split from its answer as the text streams (vLLM's
`--reasoning-parser`, names as vLLM's).

A parser per choice is fed the text as it is generated, `feed(text) -> (reasoning, answer)` the new text of each,
and `finish()` flushes at the end. The tags may arrive split across deltas (a tokenizer without them as single
tokens spells them in pieces): a tail that could still be the start of a tag is held back until it is known, so no
part of a tag is ever shown, nor text shown as one kind and then taken back as the other.

The formats differ in where the block opens:
- `qwen3`: the model writes `<think>` itself, first (Qwen3's templates; with `enable_thinking: false` the template
  puts an empty `<think>\\n\\n</think>\\n\\n` in the prompt and the model answers directly). Only a block at the
  start of the output (after any whitespace) is reasoning: an output without one is all answer.
- `deepseek_r1`: the template ends the prompt with `<think>\\n`, so the output starts inside the block (a `<think>`
  the model writes first anyway, as older templates let it, is dropped); without `</think>` all of it is reasoning,
  as vLLM's parser has it (an output cut short by max_tokens).

`ended` says the reasoning is over: structured output and tool calls apply to what follows. The engine knows the
end by its tokens (`StructuredOutputsParams.starts_after`: the tokenizer's ids of END_TAG), not by this parser.
"""
from __future__ import annotations

START_TAG, END_TAG = "<think>", "</think>"

# Where a parser stands: before the block may open (whitespace so far), inside it, or in the answer.
OPENING, REASONING, ANSWER = "opening", "reasoning", "answer"


def _partial_tail(text: str, tag: str) -> int:
    """The length of the longest tail of `text` that is a proper prefix of `tag` (what to hold back)."""
    for k in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0


class ThinkParser:
    """Splits `<think>...</think>` off an output's start. Subclasses say where the output starts: `opens` (a block
    the model must open itself, else the output is all answer) or not (the prompt opened it)."""

    opens: bool = True
    start_tag, end_tag = START_TAG, END_TAG

    def __init__(self, prompt_ended: bool = False):
        """prompt_ended: the prompt already closed the block (`prompt_ends_reasoning`): the output is all answer."""
        self.state = ANSWER if prompt_ended else OPENING
        self.held = ""  # text not yet given out: whitespace before a possible block, or a tag's possible start

    @property
    def ended(self) -> bool:
        return self.state == ANSWER

    @classmethod
    def prompt_ends_reasoning(cls, prompt: str) -> bool:
        """Whether a rendered prompt leaves the output past the reasoning: it closes a block after its last opening
        (Qwen3's template with enable_thinking false), so the answer (and its grammar) starts with the output."""
        return prompt.rfind(cls.end_tag) > prompt.rfind(cls.start_tag)

    def feed(self, text: str) -> tuple[str, str]:
        """The new (reasoning, answer) text that `text`, the output's next piece, makes certain."""
        buf, self.held = self.held + text, ""
        reasoning = answer = ""
        while buf:
            if self.state == ANSWER:
                answer, buf = answer + buf, ""
            elif self.state == OPENING:
                rest = buf.lstrip()
                if rest.startswith(self.start_tag):
                    self.state, buf = REASONING, rest[len(self.start_tag):]  # the whitespace before it is dropped
                elif self.start_tag.startswith(rest):  # whitespace, or the start tag's start: not known yet
                    self.held, buf = buf, ""
                else:
                    self.state = REASONING if not self.opens else ANSWER
            else:
                end = buf.find(self.end_tag)
                if end >= 0:
                    reasoning, buf, self.state = reasoning + buf[:end], buf[end + len(self.end_tag):], ANSWER
                else:
                    keep = _partial_tail(buf, self.end_tag)
                    reasoning, self.held, buf = reasoning + buf[:len(buf) - keep], buf[len(buf) - keep:], ""
        return reasoning, answer

    def finish(self) -> tuple[str, str]:
        """At the output's end: what was held back, as what it turned out to be (never a tag)."""
        held, self.held = self.held, ""
        if self.state == REASONING or (self.state == OPENING and not self.opens):
            return held, ""
        return "", held


class Qwen3ReasoningParser(ThinkParser):
    """Qwen3: reasoning only in a `<think>` block the model opens at the start of its output."""
    opens = True


class DeepSeekR1ReasoningParser(ThinkParser):
    """DeepSeek-R1 (and its distills): the template opens the block; the output is reasoning until `</think>`."""
    opens = False


# vLLM's --reasoning-parser names.
REASONING_PARSERS: dict[str, type[ThinkParser]] = {"qwen3": Qwen3ReasoningParser,
                                                   "deepseek_r1": DeepSeekR1ReasoningParser}


def split_whole(parser: ThinkParser, text: str) -> tuple[str, str]:
    """A whole output's (reasoning, answer) through a fresh parser."""
    r1, a1 = parser.feed(text)
    r2, a2 = parser.finish()
    return r1 + r2, a1 + a2


def reasoning_fields(text: str | None) -> dict:
    """Reasoning text as a chat message or delta carries it: `reasoning_content` (DeepSeek's name, which most
    clients read) and `reasoning` (vLLM's since it renamed the field), both, as vLLM sent during the change."""
    return {"reasoning_content": text, "reasoning": text}
