"""Passkey-retrieval prompts and their scoring (bench_long_context.py), pure: a tokenizer in, token ids out.

The task is the passkey test of the long-context literature (Mohtashami and Jaggi 2023, "Landmark Attention"; used
by the YaRN paper): a random 5-digit number in one sentence, hidden at a chosen depth of a long filler text, asked
back at the end. Filler "repeat" is their five sentences over and over; "pydoc" is Python's language reference
(`pydoc_data.topics`, its sections in sorted order, line by line), natural text that needs no download.

The user turn (instructions, the haystack with the needle in it, the question) is rendered with the model's chat
template, and the assistant turn is primed with "The pass key is" (as the literature's completion-style prompt ends),
so that a small model answers with the number rather than a preamble. The engines get the token ids, so each sees
exactly the same prompt. Its length counts every token of the rendered prompt; depth is where the needle sentence
starts, as the fraction of the filler's tokens before it.
"""
from __future__ import annotations

import dataclasses
import itertools
import re

TASK = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
        "I will quiz you about the important information there.")
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = "What is the pass key?"
ANSWER_PREFIX = "The pass key is"
REPEAT_FILLER = ("The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.",
                 "There and back again.")
# Gemma 3's turn format (its template, less the system-turn and image handling), for GGUFs that carry no template.
GEMMA_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' "
                  "else m['role'] }}\n{{ m['content'] | trim }}<end_of_turn>\n{% endfor %}"
                  "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
_HAYSTACK = "\x00HAYSTACK\x00"  # a marker the templates pass through untouched


@dataclasses.dataclass
class PasskeyPrompt:
    token_ids: list[int]
    key: int
    depth: float  # asked: the needle's place in the haystack, 0 (start) to 1 (end)
    depth_tokens: float  # measured: filler tokens before the needle / all filler tokens
    length: int  # asked: the most tokens the prompt may have

    def record(self) -> dict:
        return {"key": self.key, "depth": self.depth, "depth_tokens": round(self.depth_tokens, 4),
                "length": self.length, "prompt_tokens": len(self.token_ids)}


def filler_units(kind: str) -> tuple[list[str], str]:
    """(units, joiner): the filler's pieces, taken in order (and cycled) up to the wanted length."""
    if kind == "repeat":
        return list(REPEAT_FILLER), " "
    if kind == "pydoc":
        from pydoc_data.topics import topics
        lines = [line.strip() for name in sorted(topics) for line in topics[name].splitlines()]
        return [line for line in lines if line], "\n"
    raise ValueError(f"unknown filler {kind!r}: want repeat or pydoc")


def chat_frame(tokenizer, answer_prefix: bool = True) -> tuple[str, str]:
    """(text before the haystack, text after it): the chat template rendered around the user turn."""
    user = f"{TASK}\n\n{_HAYSTACK}\n\n{QUESTION}"
    messages = [{"role": "user", "content": user}]
    if tokenizer.chat_template:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    else:
        from jaxserve.tokenizer.chat_template import jinja_env
        bos = tokenizer.id_to_token(tokenizer.bos_token_id) if tokenizer.bos_token_id is not None else ""
        text = jinja_env().from_string(GEMMA_TEMPLATE).render(messages=messages, add_generation_prompt=True,
                                                              bos_token=bos)
    before, after = text.split(_HAYSTACK)
    return before, after + (ANSWER_PREFIX if answer_prefix else "")


def haystack(units: list[str], joiner: str, n: int, depth: float, needle: str) -> tuple[str, str]:
    """(haystack text up to the needle, the rest from the needle on): n filler units, cycled, the needle between
    the two units nearest `depth` of the filler's characters (units differ in length: pydoc's lines)."""
    pieces = [units[i % len(units)] for i in range(n)]
    ends = list(itertools.accumulate(len(p) + len(joiner) for p in pieces))  # characters up to each unit's end
    target = depth * (ends[-1] if ends else 0)
    at = min(range(n + 1), key=lambda i: abs((ends[i - 1] if i else 0) - target))
    head = joiner.join(pieces[:at])
    tail = joiner.join([needle] + pieces[at:])
    return head + (joiner if at else ""), tail


def passkey_prompt(tokenizer, length: int, depth: float, key: int, filler: str = "repeat",
                   answer_prefix: bool = True) -> PasskeyPrompt:
    """The longest prompt of at most `length` tokens whose needle holding `key` sits at `depth` of the haystack
    (to within a filler unit)."""
    if not 0 <= depth <= 1:
        raise ValueError(f"depth {depth} is not in [0, 1]")
    units, joiner = filler_units(filler)
    before, after = chat_frame(tokenizer, answer_prefix)
    needle = NEEDLE.format(key=key)

    def build(n: int) -> tuple[list[int], str, str]:
        head, tail = haystack(units, joiner, n, depth, needle)
        return tokenizer.encode(before + head + tail + after, add_special_tokens=False), head, tail

    if len(build(0)[0]) > length:
        raise ValueError(f"{length} tokens do not hold the instructions, the needle and the question "
                         f"({len(build(0)[0])} tokens)")
    lo, hi = 0, 1  # the most units that fit lies in [lo, hi): grow hi, then bisect
    while len(build(hi)[0]) <= length:
        lo, hi = hi, 2 * hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if len(build(mid)[0]) <= length else (lo, mid)
    ids, head, tail = build(lo)
    n_before = len(tokenizer.encode(before, add_special_tokens=False))
    n_head = len(tokenizer.encode(before + head, add_special_tokens=False)) - n_before
    rest = tail[len(needle):].removeprefix(joiner)  # the filler after the needle
    n_filler = len(tokenizer.encode(before + head + rest, add_special_tokens=False)) - n_before
    return PasskeyPrompt(ids, key, depth, n_head / max(n_filler, 1), length)


def first_number(text: str) -> str | None:
    m = re.search(r"\d+", text)
    return m.group() if m else None


def score(answer: str, key: int) -> bool:
    """Exact match: the first number in the answer is the passkey (a longer or shorter number is wrong)."""
    return first_number(answer) == str(key)
