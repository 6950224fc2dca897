"""scripts/long_context_prompts.py (the passkey prompts of bench_long_context.py) and the script's pure parts: a
prompt is as long as asked, holds its key once at the asked depth inside the chat frame, and answers are scored by
exact match. A byte-level tokenizer (a token a byte) makes lengths and depths countable by hand."""
import sys

import numpy as np
import pytest
import tokenizers
from tokenizers import AddedToken, decoders, models, pre_tokenizers

from locations import SCRIPTS

sys.path.insert(0, str(SCRIPTS))
import bench_long_context  # noqa: E402
import long_context_prompts as lcp  # noqa: E402

from jaxserve.tokenizer import Tokenizer  # noqa: E402

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def byte_tokenizer(chat_template=CHATML, bos=None) -> Tokenizer:
    """Every byte one token; the chat markers and a BOS single control tokens."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = tokenizers.Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|im_start|>", "<|im_end|>", "<bos>", "<start_of_turn>", "<end_of_turn>"]
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    return Tokenizer(tok, bos_token_id=258 if bos else None, eos_token_ids=[257], add_bos=False,
                     chat_template=chat_template)


@pytest.mark.parametrize("filler", ["repeat", "pydoc"])
@pytest.mark.parametrize("length", [600, 3000])
def test_the_key_sits_at_the_asked_depth_of_a_prompt_as_long_as_asked(filler, length):
    tok = byte_tokenizer()
    seed = int(np.random.default_rng().integers(1 << 31))
    rng = np.random.default_rng(seed)
    key, depth = int(rng.integers(10000, 100000)), float(rng.uniform(0, 1))
    p = lcp.passkey_prompt(tok, length, depth, key, filler)
    text = tok.decode(p.token_ids, skip_special_tokens=False)
    units, joiner = lcp.filler_units(filler)
    longest_unit = max(len(tok.encode(u + joiner, add_special_tokens=False)) for u in units)
    assert length - longest_unit < len(p.token_ids) <= length, (seed, len(p.token_ids))
    assert text.count(str(key)) == 2 and text.count("The pass key is") == 2, seed  # the needle's, the answer primer
    before, after = lcp.chat_frame(tok)
    assert text.startswith(before) and text.endswith(after), seed
    assert text.endswith(f"{lcp.QUESTION}<|im_end|>\n<|im_start|>assistant\n{lcp.ANSWER_PREFIX}"), seed
    hay = text[len(before):len(text) - len(after)]
    needle = lcp.NEEDLE.format(key=key)
    filler = len(hay) - len(needle) - len(joiner)
    at = hay.index(needle) / filler  # a byte a token: characters are tokens
    assert abs(at - depth) <= longest_unit / filler, (seed, at, depth)
    assert abs(p.depth_tokens - at) <= 1.01 / filler, seed  # the joiner at the needle counted or not


def test_depth_zero_and_one_put_the_key_first_and_last():
    tok = byte_tokenizer()
    first = tok.decode(lcp.passkey_prompt(tok, 1000, 0.0, 12345).token_ids, skip_special_tokens=False)
    last = tok.decode(lcp.passkey_prompt(tok, 1000, 1.0, 12345).token_ids, skip_special_tokens=False)
    assert "\n\n" + lcp.NEEDLE.format(key=12345) in first
    assert lcp.NEEDLE.format(key=12345) + "\n\n" + lcp.QUESTION in last


def test_a_model_without_a_template_gets_gemmas_turns_with_its_bos():
    tok = byte_tokenizer(chat_template=None, bos=True)
    text = tok.decode(lcp.passkey_prompt(tok, 800, 0.5, 12345).token_ids, skip_special_tokens=False)
    assert text.startswith("<bos><start_of_turn>user\n" + lcp.TASK)
    assert text.endswith(f"{lcp.QUESTION}<end_of_turn>\n<start_of_turn>model\n{lcp.ANSWER_PREFIX}")


def test_too_short_a_length_or_a_depth_out_of_range_is_refused():
    tok = byte_tokenizer()
    with pytest.raises(ValueError, match="do not hold"):
        lcp.passkey_prompt(tok, 100, 0.5, 12345)
    with pytest.raises(ValueError, match="depth"):
        lcp.passkey_prompt(tok, 1000, 1.5, 12345)
    with pytest.raises(ValueError, match="filler"):
        lcp.filler_units("lorem")


@pytest.mark.parametrize("answer, correct", [(" 12345. Remember it.", True), ("12345", True),
                                             (" is 12345 and 67890", True), (" 123456", False), (" 1234", False),
                                             (" 67890, not 12345", False), (" the pass key", False), ("", False),
                                             (" 12 345", False)])
def test_scoring_is_an_exact_match_of_the_first_number(answer, correct):
    assert lcp.score(answer, 12345) is correct


def test_every_engine_and_model_gets_the_same_keys_and_each_trial_its_own():
    keys = {bench_long_context.passkey_key(0, n, d, t) for n in (2048, 4096) for d in (0.1, 0.5) for t in range(3)}
    assert len(keys) == 12 and all(10000 <= k < 100000 for k in keys)
    assert bench_long_context.passkey_key(0, 2048, 0.5, 1) == bench_long_context.passkey_key(0, 2048, 0.5, 1)


def test_accuracy_is_the_fraction_correct_per_context_and_depth():
    trials = [{"context": 2048, "depth": 0.5, "correct": c} for c in (True, False)] + \
             [{"context": 2048, "depth": 0.9, "correct": True}, {"context": 4096, "depth": 0.5, "correct": False}]
    assert bench_long_context.accuracy_table(trials) == {"2048": {"0.5": 0.5, "0.9": 1.0, "all": 0.667},
                                                         "4096": {"0.5": 0.0, "all": 0.0}}


def test_the_servers_get_the_same_rope_settings_and_one_slot():
    args = bench_long_context.parser().parse_args(["--llama-server", "/x/llama-server"])
    spec = bench_long_context.MODELS["smollm2-yarn4"]
    llama = bench_long_context.server_command("llama", spec, args, 9000)
    ours = bench_long_context.server_command("jaxserve", spec, args, 9000)
    assert "--rope-scaling yarn --rope-scale 4 --yarn-orig-ctx 8192" in llama and "-np 1" in llama
    assert "-c 32768" in llama and "--max-model-len 32768" in ours and "--max-num-seqs 1" in ours
    assert '"factor": 4.0, "original_max_position_embeddings": 8192' in ours
    long = bench_long_context.MODELS["smollm2-yarn16"]
    assert long.max_model_len == 131072 and long.hf_overrides["rope_scaling"]["factor"] == 16.0


def test_the_estimate_counts_every_selected_part():
    args = bench_long_context.parser().parse_args(["--parts", "passkey,ttft", "--lengths", "2048"])
    est = bench_long_context.estimate(args)
    assert set(est) == {"passkey", "ttft"} and all(s > 0 for s in est.values())
    longer = bench_long_context.estimate(bench_long_context.parser().parse_args(["--parts", "passkey",
                                                                                 "--lengths", "4096"]))
    assert longer["passkey"] > est["passkey"]
