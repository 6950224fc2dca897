"""The cascade evaluation's labelled questions, built here (no downloads): arithmetic of graded difficulty, facts
(capitals, chemical symbols, units, irregular plurals and past tenses) answered by generation, and multiple choice
scored by loglikelihood. Every prompt is few-shot plain text ("Q: ...\\nA:"), the same for every tier: Gemma 3 270M's
GGUF is the pretrained model, which continues text well and chats poorly, so no chat template is used.

`build(per_category, seed)` -> a list of question dicts:
    {"id", "category", "group" ("arithmetic" | "facts" | "choice"), "kind" ("generate" | "choice"), "question",
     "prompt" (the whole few-shot text; for "choice" the context the options continue),
     "answer" (an int, or a list of accepted spellings) for "generate", "options" + "label" (index) for "choice"}
and `is_correct(question, text)` grades a generated answer.
"""
from __future__ import annotations

import random
import re
import unicodedata

# ---- few-shot headers: one per category family, never containing a question of the bank ----

ARITHMETIC_SHOTS = "Q: What is 3 + 5?\nA: 8\n\nQ: What is 15 - 6?\nA: 9\n\nQ: What is 7 * 6?\nA: 42\n\n"
SHOTS = {
    "capital": "Q: What is the capital of Italy?\nA: Rome\n\nQ: What is the capital of Japan?\nA: Tokyo\n\n",
    "element": "Q: What is the chemical symbol for oxygen?\nA: O\n\n"
               "Q: What is the chemical symbol for iron?\nA: Fe\n\n",
    "unit": "Q: How many seconds are in a minute?\nA: 60\n\nQ: How many grams are in a kilogram?\nA: 1000\n\n",
    "plural": "Q: What is the plural of cat?\nA: cats\n\nQ: What is the plural of dish?\nA: dishes\n\n",
    "past": "Q: What is the past tense of walk?\nA: walked\n\nQ: What is the past tense of make?\nA: made\n\n",
    "kind": "Q: Which of these is a color: table, blue or river?\nA: blue\n\n"
            "Q: Which of these is a tree: oak, spoon or cloud?\nA: oak\n\n",
}

# ---- facts ----

CAPITALS = {  # country: accepted spellings (answered by generation)
    "France": ["Paris"], "Germany": ["Berlin"], "Spain": ["Madrid"], "Portugal": ["Lisbon"],
    "the United Kingdom": ["London"], "Ireland": ["Dublin"], "the Netherlands": ["Amsterdam"],
    "Belgium": ["Brussels"], "Austria": ["Vienna"], "Poland": ["Warsaw"], "the Czech Republic": ["Prague"],
    "Hungary": ["Budapest"], "Greece": ["Athens"], "Sweden": ["Stockholm"], "Norway": ["Oslo"],
    "Finland": ["Helsinki"], "Denmark": ["Copenhagen"], "Iceland": ["Reykjavik"], "Ukraine": ["Kyiv", "Kiev"],
    "Romania": ["Bucharest"], "Bulgaria": ["Sofia"], "Serbia": ["Belgrade"], "Croatia": ["Zagreb"],
    "Egypt": ["Cairo"], "Kenya": ["Nairobi"], "Ethiopia": ["Addis Ababa"], "Ghana": ["Accra"], "Senegal": ["Dakar"],
    "Mexico": ["Mexico City"], "Argentina": ["Buenos Aires"], "Chile": ["Santiago"], "Peru": ["Lima"],
    "Colombia": ["Bogota"], "Venezuela": ["Caracas"], "Cuba": ["Havana"], "South Korea": ["Seoul"],
    "Thailand": ["Bangkok"], "Indonesia": ["Jakarta"], "the Philippines": ["Manila"], "Iran": ["Tehran"],
    "Iraq": ["Baghdad"], "Afghanistan": ["Kabul"], "Russia": ["Moscow"], "Mongolia": ["Ulaanbaatar", "Ulan Bator"],
    "Nepal": ["Kathmandu"], "Bangladesh": ["Dhaka"], "Malaysia": ["Kuala Lumpur"], "Lebanon": ["Beirut"],
    "Syria": ["Damascus"], "Jordan": ["Amman"], "Qatar": ["Doha"], "Libya": ["Tripoli"], "Tunisia": ["Tunis"],
    "Algeria": ["Algiers"], "Uganda": ["Kampala"], "Zimbabwe": ["Harare"], "Jamaica": ["Kingston"],
    "Uruguay": ["Montevideo"], "Paraguay": ["Asuncion"], "Laos": ["Vientiane"], "Cambodia": ["Phnom Penh"],
    "North Korea": ["Pyongyang"], "Latvia": ["Riga"], "Lithuania": ["Vilnius"], "Estonia": ["Tallinn"],
    "Slovakia": ["Bratislava"], "Slovenia": ["Ljubljana"],
}
# Multiple choice: (country, capital, a larger city people take for the capital); the third option is another
# country's capital.
CAPITAL_CHOICES = [
    ("Australia", "Canberra", "Sydney"), ("Canada", "Ottawa", "Toronto"), ("Turkey", "Ankara", "Istanbul"),
    ("Brazil", "Brasilia", "Rio de Janeiro"), ("the United States", "Washington", "New York"),
    ("Switzerland", "Bern", "Zurich"), ("India", "New Delhi", "Mumbai"), ("China", "Beijing", "Shanghai"),
    ("Nigeria", "Abuja", "Lagos"), ("Pakistan", "Islamabad", "Karachi"), ("Morocco", "Rabat", "Casablanca"),
    ("Vietnam", "Hanoi", "Ho Chi Minh City"), ("New Zealand", "Wellington", "Auckland"),
    ("South Africa", "Pretoria", "Johannesburg"), ("Tanzania", "Dodoma", "Dar es Salaam"),
    ("Myanmar", "Naypyidaw", "Yangon"), ("Kazakhstan", "Astana", "Almaty"), ("Cameroon", "Yaounde", "Douala"),
    ("Ecuador", "Quito", "Guayaquil"), ("Saudi Arabia", "Riyadh", "Jeddah"),
    ("the United Arab Emirates", "Abu Dhabi", "Dubai"), ("Belize", "Belmopan", "Belize City"),
    ("Scotland", "Edinburgh", "Glasgow"), ("Bolivia", "Sucre", "Santa Cruz"),
]
ELEMENTS = {
    "hydrogen": "H", "helium": "He", "lithium": "Li", "carbon": "C", "nitrogen": "N", "sodium": "Na",
    "magnesium": "Mg", "aluminium": "Al", "silicon": "Si", "phosphorus": "P", "sulfur": "S", "chlorine": "Cl",
    "potassium": "K", "calcium": "Ca", "copper": "Cu", "zinc": "Zn", "silver": "Ag", "tin": "Sn", "gold": "Au",
    "mercury": "Hg", "lead": "Pb", "uranium": "U", "neon": "Ne", "argon": "Ar", "nickel": "Ni", "platinum": "Pt",
    "iodine": "I", "fluorine": "F", "titanium": "Ti", "cobalt": "Co", "chromium": "Cr", "manganese": "Mn",
    "tungsten": "W", "boron": "B",
}
UNITS = [  # (how many X are in a Y, answer)
    ("centimeters", "a meter", 100), ("millimeters", "a meter", 1000), ("meters", "a kilometer", 1000),
    ("minutes", "an hour", 60), ("hours", "a day", 24), ("days", "a week", 7), ("months", "a year", 12),
    ("days", "a year", 365), ("weeks", "a year", 52), ("inches", "a foot", 12), ("feet", "a yard", 3),
    ("ounces", "a pound", 16), ("years", "a century", 100), ("years", "a decade", 10), ("cents", "a dollar", 100),
    ("milliliters", "a liter", 1000), ("seconds", "an hour", 3600), ("minutes", "a day", 1440),
    ("hours", "a week", 168), ("quarts", "a gallon", 4), ("pints", "a quart", 2), ("days", "a leap year", 366),
    ("years", "a millennium", 1000), ("items", "a dozen", 12), ("feet", "a mile", 5280),
    ("kilograms", "a tonne", 1000), ("seconds", "a day", 86400), ("bits", "a byte", 8),
]
PLURALS = {
    "mouse": ["mice"], "child": ["children"], "man": ["men"], "woman": ["women"], "tooth": ["teeth"],
    "foot": ["feet"], "goose": ["geese"], "person": ["people", "persons"], "ox": ["oxen"],
    "cactus": ["cacti", "cactuses"], "leaf": ["leaves"], "knife": ["knives"], "wolf": ["wolves"], "life": ["lives"],
    "sheep": ["sheep"], "deer": ["deer"], "city": ["cities"], "baby": ["babies"], "box": ["boxes"],
    "bus": ["buses", "busses"], "hero": ["heroes"], "potato": ["potatoes"], "half": ["halves"], "wife": ["wives"],
    "shelf": ["shelves"], "thief": ["thieves"], "criterion": ["criteria"], "phenomenon": ["phenomena"],
    "analysis": ["analyses"], "crisis": ["crises"], "louse": ["lice"], "die": ["dice"], "fungus": ["fungi"],
    "nucleus": ["nuclei"], "church": ["churches"], "lady": ["ladies"],
}
PAST_TENSES = {
    "go": ["went"], "see": ["saw"], "eat": ["ate"], "run": ["ran"], "write": ["wrote"], "take": ["took"],
    "give": ["gave"], "buy": ["bought"], "bring": ["brought"], "think": ["thought"], "catch": ["caught"],
    "teach": ["taught"], "fly": ["flew"], "swim": ["swam"], "sing": ["sang"], "drink": ["drank"], "begin": ["began"],
    "break": ["broke"], "choose": ["chose"], "drive": ["drove"], "speak": ["spoke"], "steal": ["stole"],
    "freeze": ["froze"], "forget": ["forgot"], "sleep": ["slept"], "keep": ["kept"], "leave": ["left"],
    "feel": ["felt"], "find": ["found"], "hold": ["held"], "stand": ["stood"], "tell": ["told"], "sell": ["sold"],
    "fall": ["fell"], "wake": ["woke", "waked"], "ride": ["rode"], "rise": ["rose"], "bite": ["bit"],
    "hide": ["hid"], "shake": ["shook"], "seek": ["sought"], "fight": ["fought"], "dig": ["dug"],
    "lend": ["lent"], "spend": ["spent"], "build": ["built"], "send": ["sent"],
}
KINDS = {  # "which of these is a ...": members (the distractors come from the other kinds)
    "animal": ["dog", "horse", "rabbit", "elephant", "tiger", "whale", "frog", "donkey"],
    "fruit": ["apple", "banana", "cherry", "mango", "pear", "grape", "lemon", "peach"],
    "vehicle": ["car", "bus", "bicycle", "truck", "train", "airplane", "boat", "motorcycle"],
    "musical instrument": ["piano", "guitar", "violin", "drum", "flute", "trumpet", "cello", "harp"],
    "body part": ["hand", "knee", "elbow", "shoulder", "ankle", "nose", "ear", "finger"],
    "tool": ["hammer", "saw", "wrench", "screwdriver", "drill", "shovel", "chisel", "pliers"],
    "planet": ["Mars", "Venus", "Jupiter", "Saturn", "Mercury", "Neptune", "Uranus"],
    "piece of furniture": ["chair", "sofa", "bed", "wardrobe", "desk", "bench", "stool", "cupboard"],
}

# ---- arithmetic: (category, operator, operand ranges), easiest first ----

ARITHMETIC = [
    ("add1", "+", (1, 9), (1, 9)), ("add2", "+", (10, 99), (10, 99)), ("add3", "+", (100, 999), (100, 999)),
    ("sub2", "-", (20, 99), (10, 99)), ("mul1", "*", (2, 9), (2, 9)), ("mul2", "*", (11, 99), (2, 9)),
    ("mul22", "*", (11, 99), (11, 99)),
]
OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}

CATEGORIES = [c for c, *_ in ARITHMETIC] + ["capital", "element", "unit", "plural", "past",
                                           "choice_capital", "choice_kind", "choice_sum"]


def _arithmetic(rng: random.Random, category: str, op: str, ra, rb, n: int) -> list[dict]:
    out, seen = [], set()
    while len(out) < n:
        a, b = rng.randint(*ra), rng.randint(*rb)
        if op == "-" and b > a:
            a, b = b, a  # answers stay non-negative
        if (a, b) in seen:
            continue
        seen.add((a, b))
        q = f"What is {a} {op} {b}?"
        out.append({"category": category, "group": "arithmetic", "kind": "generate", "question": q,
                    "prompt": f"{ARITHMETIC_SHOTS}Q: {q}\nA:", "answer": OPS[op](a, b)})
    return out


def _facts(rng: random.Random, category: str, items: list[tuple[str, object]], n: int) -> list[dict]:
    out = []
    for q, answer in rng.sample(items, min(n, len(items))):
        out.append({"category": category, "group": "facts", "kind": "generate", "question": q,
                    "prompt": f"{SHOTS[category]}Q: {q}\nA:", "answer": answer})
    return out


def _choice(category: str, q: str, shots: str, correct: str, distractors: list[str], rng: random.Random) -> dict:
    options = [correct] + distractors
    rng.shuffle(options)
    return {"category": category, "group": "choice", "kind": "choice", "question": q,
            "prompt": f"{shots}Q: {q}\nA:", "options": options, "label": options.index(correct)}


def build(per_category: int, seed: int = 0) -> list[dict]:
    """per_category questions of each category (fewer where a fact list is shorter), the same for a seed."""
    rng = random.Random(seed)
    questions = []
    for category, op, ra, rb in ARITHMETIC:
        questions += _arithmetic(rng, category, op, ra, rb, per_category)
    questions += _facts(rng, "capital", [(f"What is the capital of {c}?", a) for c, a in CAPITALS.items()],
                        per_category)
    questions += _facts(rng, "element", [(f"What is the chemical symbol for {e}?", [s]) for e, s in ELEMENTS.items()],
                        per_category)
    questions += _facts(rng, "unit", [(f"How many {x} are in {y}?", v) for x, y, v in UNITS], per_category)
    questions += _facts(rng, "plural", [(f"What is the plural of {w}?", a) for w, a in PLURALS.items()],
                        per_category)
    questions += _facts(rng, "past", [(f"What is the past tense of {w}?", a) for w, a in PAST_TENSES.items()],
                        per_category)
    capitals = [a[0] for a in CAPITALS.values()]
    for country, capital, city in rng.sample(CAPITAL_CHOICES, min(per_category, len(CAPITAL_CHOICES))):
        questions.append(_choice("choice_capital", f"What is the capital of {country}?", SHOTS["capital"], capital,
                                 [city, rng.choice(capitals)], rng))
    kinds = list(KINDS)
    for i in range(per_category):
        kind = kinds[i % len(kinds)]
        correct = rng.choice(KINDS[kind])
        others = rng.sample([k for k in kinds if k != kind], 2)
        distractors = [rng.choice(KINDS[k]) for k in others]
        listed = [correct] + distractors
        rng.shuffle(listed)
        article = "an" if kind[0] in "aeiou" else "a"
        q = f"Which of these is {article} {kind}: {listed[0]}, {listed[1]} or {listed[2]}?"
        questions.append(_choice("choice_kind", q, SHOTS["kind"], correct, distractors, rng))
    for _ in range(per_category):
        a, b = rng.randint(10, 499), rng.randint(10, 499)
        wrong = [a + b + rng.choice([-10, 10]), a + b + rng.choice([-1, 1, -100, 100])]
        questions.append(_choice("choice_sum", f"What is {a} + {b}?", ARITHMETIC_SHOTS, str(a + b),
                                 [str(w) for w in wrong], rng))
    counts: dict[str, int] = {}
    for q in questions:
        counts[q["category"]] = counts.get(q["category"], 0) + 1
        q["id"] = f"{q['category']}-{counts[q['category']]:03d}"
    return questions


# ---- grading ----

def _normal(text: str) -> str:
    """Lower case, accents off, the first line, no leading 'the' or trailing punctuation."""
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode()
    text = text.strip().split("\n")[0].strip().lower()
    return re.sub(r"^the ", "", text).rstrip(" .!,;")


def is_correct(question: dict, text: str) -> bool:
    """A generated answer is right when its number equals an integer answer (the first number, or the first after
    the last '=': a model that restates the sum, "61 + 48 = 109", answers with what follows it), or when it begins
    with one of the accepted spellings as a whole word ("Paris." and "Paris, France" count; "Parisian" does not)."""
    answer = question["answer"]
    if isinstance(answer, int):
        m = re.search(r"-?\d[\d,]*", text.rpartition("=")[2])
        return m is not None and int(m.group().replace(",", "")) == answer
    said = _normal(text)
    for accepted in answer:
        a = _normal(accepted)
        if said == a or (said.startswith(a) and not said[len(a)].isalnum()):
            return True
    return False


def split(questions: list[dict], seed: int = 0, train_share: float = 0.5) -> None:
    """Sets each question's "split" to "train" or "test": a seeded shuffle within each category, so both halves
    hold every category in the same proportion."""
    rng = random.Random(seed + 1)
    by_category: dict[str, list[dict]] = {}
    for q in questions:
        by_category.setdefault(q["category"], []).append(q)
    for items in by_category.values():
        order = list(range(len(items)))
        rng.shuffle(order)
        cut = round(train_share * len(items))
        for rank, i in enumerate(order):
            items[i]["split"] = "train" if rank < cut else "test"
