"""scripts/cascade_questions.py: the cascade evaluation's questions are the same for a seed, split evenly per
category, and graded as documented (no model)."""
import sys
from collections import Counter

from locations import SCRIPTS

sys.path.insert(0, str(SCRIPTS))
import cascade_questions as cq  # noqa: E402


def test_build_is_deterministic_and_split_per_category():
    a, b = cq.build(6, seed=3), cq.build(6, seed=3)
    cq.split(a, seed=3)
    cq.split(b, seed=3)
    assert a == b, "seed 3: two builds differ"
    assert len({q["id"] for q in a}) == len(a) == 6 * len(cq.CATEGORIES)
    assert Counter(q["category"] for q in a if q["split"] == "train") == Counter({c: 3 for c in cq.CATEGORIES})
    for q in a:
        if q["kind"] == "choice":
            assert len(set(q["options"])) == len(q["options"]) and 0 <= q["label"] < len(q["options"]), q
        elif q["group"] == "arithmetic":  # the arithmetic is right
            x, op, y = q["question"].removeprefix("What is ").rstrip("?").split()
            assert cq.OPS[op](int(x), int(y)) == q["answer"], q
        assert q["prompt"].endswith(f"Q: {q['question']}\nA:"), q
    assert cq.build(6, seed=4) != a


def test_grading():
    number = {"answer": 109}
    assert cq.is_correct(number, " 109")
    assert cq.is_correct(number, " 109.") and cq.is_correct(number, " 61 + 48 = 109")
    assert not cq.is_correct(number, " 61 + 48 = 100") and not cq.is_correct(number, " 1090") \
        and not cq.is_correct(number, "")
    words = {"answer": ["Ulaanbaatar", "Ulan Bator"]}
    assert cq.is_correct(words, " Ulan Bator, Mongolia") and cq.is_correct(words, " The Ulaanbaatar.")
    assert not cq.is_correct(words, " Ulaanbaatarian") and not cq.is_correct(words, " Beijing")
    assert cq.is_correct({"answer": ["Bogota"]}, " Bogotá")  # accents off
    assert not cq.is_correct({"answer": ["C"]}, " Ca")  # a symbol is a whole word
