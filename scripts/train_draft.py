"""Distil a small draft model for speculative decoding from a target model, with optax.

The default model (SmolLM2-135M-Instruct) has no smaller sibling sharing its tokenizer, so its draft is made here:
the target's architecture and vocabulary with fewer decoder layers, initialised from the target's embedding,
final norm, lm_head and an evenly spaced subset of its layers (first and last included), then trained to match
the target's next-token distributions.

Steps:
  1. generate_data: the target writes continuations of a varied prompt set (chat prompts through the chat
     template: questions, code, rewriting; raw text from Python's own docs, `pydoc_data.topics`) at a moderate
     temperature, with `jaxserve.LLM`. Training sequences are prompt + generated tokens; some prompts are held
     out for evaluation.
  2. init_draft: pick the layers and copy them.
  3. train_step: KL(target || draft) at every position of each sequence, the target's full distribution
     (teacher_logits, computed on the same tokens inside the same jitted step) as soft labels; optax adamw with
     linear warm-up, cosine decay and global-norm clipping.
  4. evaluate (before and after training): on held-out sequences, teacher-forced, the rate a at which the draft's
     argmax equals the target's, the tokens per verification step greedy speculative decoding would give if
     acceptances were independent ((1 - a^(k+1)) / (1 - a), k = 1..5), the same measured by walking the actual
     runs of agreement along the sequences with k = 4, and the acceptance rate of speculative *sampling* at
     temperature 1 (the mean of sum_v min(p_target, p_draft)).
  5. save_checkpoint: a jaxserve orbax checkpoint that `jaxserve.LLM(out)` and `load_model(out)` load.

Run (defaults took ~25 minutes on 2 shared CPU cores: ~5 generating 160 x 128 tokens, ~13-16 s a step of 4 x 256
tokens; measured 29 min with --steps 100):

    nice -n 10 python scripts/train_draft.py --out /tmp/draft-smollm2-4l --json /tmp/draft-smollm2-4l.json
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import random
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxserve.batch import RaggedRows
from jaxserve.cache import init_kv_cache
from jaxserve.model.decoder import DecoderModel

# ---------------------------------------------------------------------------------------------------------------
# Prompts

QUESTION_SUBJECTS = [
    "photosynthesis", "the French Revolution", "black holes", "compound interest", "the water cycle", "vaccines",
    "plate tectonics", "inflation", "the Roman Empire", "machine learning", "climate change", "the immune system",
    "supply and demand", "the theory of relativity", "DNA replication", "the printing press", "volcanoes",
    "electric cars", "the stock market", "sleep", "honeybees", "the internet", "democracy", "rainbows",
    "the moon's phases", "antibiotics", "recycling", "earthquakes", "the Renaissance", "coffee", "jazz music",
    "the Silk Road", "solar panels", "tides", "the human heart", "glaciers", "cryptography", "the Olympic Games",
]
QUESTION_FORMS = [
    "What is {}?", "Explain {} in simple terms.", "Give me three interesting facts about {}.",
    "Why is {} important?", "How would you explain {} to a ten-year-old?", "Write a short paragraph about {}.",
    "What are the main pros and cons of {}?", "Summarize the history of {} in a few sentences.",
]
CODE_TASKS = [
    "reverses a string", "checks whether a number is prime", "returns the n-th Fibonacci number",
    "counts the words in a text", "merges two sorted lists", "removes duplicates from a list while keeping order",
    "computes the factorial of n", "finds the largest element of a list", "checks whether a string is a palindrome",
    "converts Celsius to Fahrenheit", "flattens a nested list", "computes the greatest common divisor of two numbers",
    "reads a CSV file and returns its rows", "sorts a list of dictionaries by a key", "implements binary search",
    "returns the most common character in a string", "transposes a matrix", "validates an email address",
]
CODE_FORMS = [
    "Write a Python function that {}.", "Write a JavaScript function that {}.",
    "How do I write a function that {} in Python? Show the code.", "Write a short C function that {}.",
    "Explain how to write a program that {}, then give the code.",
]
REWRITE_FORMS = [
    "Rewrite the following text in simpler words:\n\n{}", "Summarize this in one sentence:\n\n{}",
    "Rewrite this more formally:\n\n{}", "Turn the following into a bulleted list:\n\n{}",
    "Fix any grammar mistakes and make this clearer:\n\n{}",
]
REWRITE_TEXTS = [
    "me and my friend goes to the park every day because we likes the trees and the birds there is very nice",
    "The meeting got moved to thursday, bring your laptops and the reports we talked about last week ok",
    "Our product is fast, cheap and easy to use, customers love it and sales went up a lot this year.",
    "The cat sat on the windowsill all afternoon watching the rain, and then it fell asleep in the sun.",
    "To make tea you boil water, put the tea bag in a cup, pour the water and wait three minutes.",
    "The city council voted to build a new library downtown, which will open in two years and cost ten million.",
    "i think we should of left earlier, the traffic was terrible and we missed the start of the movie",
    "Exercise improves mood, helps you sleep better, strengthens the heart and lowers the risk of disease.",
]


def pydoc_snippets(rng: random.Random, n: int, max_chars: int = 400) -> list[str]:
    """n raw-text prompts: the opening (up to max_chars, cut at a word) of a paragraph of Python's own docs."""
    from pydoc_data.topics import topics
    paragraphs = [p.strip() for text in topics.values() for p in text.split("\n\n")
                  if len(p.strip()) > 120 and not p.strip().startswith(("*", ">>>", "|"))]
    out = []
    for p in rng.sample(paragraphs, n):
        p = " ".join(p.split())
        out.append(p[:max_chars].rsplit(" ", 1)[0] if len(p) > max_chars else p)
    return out


def make_prompts(n: int, seed: int) -> list[dict]:
    """n varied prompts, each {"kind", "messages"} (a chat) or {"kind": "raw", "text"}: question, code, rewrite,
    raw, in turn, so every kind is in both the training and the held-out split."""
    rng = random.Random(seed)
    raw = pydoc_snippets(rng, (n + 3) // 4 + (n + 3) // 4)  # raw prompts and the texts the rewrite prompts use
    prompts = []
    for i in range(n):
        kind = ("question", "code", "rewrite", "raw")[i % 4]
        if kind == "question":
            content = rng.choice(QUESTION_FORMS).format(rng.choice(QUESTION_SUBJECTS))
        elif kind == "code":
            content = rng.choice(CODE_FORMS).format(rng.choice(CODE_TASKS))
        elif kind == "rewrite":
            text = rng.choice(REWRITE_TEXTS) if rng.random() < 0.5 else raw.pop()[:300]
            content = rng.choice(REWRITE_FORMS).format(text)
        else:
            prompts.append({"kind": "raw", "text": raw.pop()})
            continue
        prompts.append({"kind": kind, "messages": [{"role": "user", "content": content}]})
    return prompts


# ---------------------------------------------------------------------------------------------------------------
# Data


def generate_data(llm, prompts: list[dict], max_tokens: int, temperature: float, seed: int) -> list[dict]:
    """The target continues every prompt (a make_prompts entry, or {"kind", "prompt_token_ids"}). Returns per
    prompt {"kind", "tokens": prompt + generated ids, "prompt_len"}."""
    from jaxserve import SamplingParams
    tok = llm.get_tokenizer()  # None for a model without one: then prompts must be token ids
    requests = []
    for p in prompts:
        if "prompt_token_ids" in p:  # already tokens (a model without a tokenizer)
            requests.append({"prompt_token_ids": list(p["prompt_token_ids"])})
        elif "messages" in p:
            # The template writes any BOS itself (as LLM.chat does), so no special tokens are added.
            text = tok.apply_chat_template(p["messages"], True)
            requests.append({"prompt_token_ids": tok.encode(text, add_special_tokens=False)})
        else:
            requests.append({"prompt_token_ids": tok.encode(p["text"])})
    # A seed per prompt: reproducible, and independent of how the engine batches them.
    params = [SamplingParams(temperature=temperature, top_p=0.95, max_tokens=max_tokens, seed=seed * 100003 + i)
              for i in range(len(prompts))]
    outs = llm.generate(requests, params, use_tqdm=False)
    return [{"kind": p["kind"], "tokens": list(o.prompt_token_ids) + list(o.outputs[0].token_ids),
             "prompt_len": len(o.prompt_token_ids)} for p, o in zip(prompts, outs)]


def pad_batch(seqs: list[dict], seq_len: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """tokens [B, seq_len] int32 (0 past the end), positions [B, seq_len] int32 (-1 past the end: padding attends to
    nothing), prompt_lens [B]. Sequences longer than seq_len are cut."""
    B = len(seqs)
    tokens = np.zeros((B, seq_len), np.int32)
    positions = np.full((B, seq_len), -1, np.int32)
    for b, s in enumerate(seqs):
        t = s["tokens"][:seq_len]
        tokens[b, :len(t)] = t
        positions[b, :len(t)] = np.arange(len(t))
    return tokens, positions, np.array([min(s["prompt_len"], seq_len) for s in seqs], np.int32)


# ---------------------------------------------------------------------------------------------------------------
# Models


def choose_layers(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """Evenly spaced, first and last included: the first layer turns token embeddings into the residual stream the
    rest expect, the last one writes what the final norm and lm_head read, and even spacing keeps a sample of
    each stage between. (For SmolLM2's 30 layers and 4 draft layers: 0, 10, 19, 29.)"""
    if not 1 <= num_draft_layers <= num_target_layers:
        raise ValueError(f"a draft needs 1..{num_target_layers} layers, got {num_draft_layers}")
    if num_draft_layers == 1:
        return [num_target_layers - 1]
    return [int(round(x)) for x in np.linspace(0, num_target_layers - 1, num_draft_layers)]


def init_draft(config, params: dict, num_layers: int):
    """The target's config with num_layers layers and its own lm_head (trained apart from the embedding, so not
    tied); params: copies of the target's embedding, final norm, lm_head and chosen layers.

    params: the target's {"params": ...}. Returns (draft config, draft params {"params": ...}, chosen indices)."""
    chosen = choose_layers(config.num_layers, num_layers)
    p = params["params"]
    draft = {"embed_tokens": p["embed_tokens"], "norm": p["norm"], "lm_head": p["lm_head"]}
    for i, j in enumerate(chosen):
        draft[f"layers_{i}"] = p[f"layers_{j}"]
    draft = jax.tree.map(jnp.array, draft)  # copies: the target's arrays stay untouched
    draft_config = dataclasses.replace(config, num_layers=num_layers, tie_word_embeddings=False)
    return draft_config, {"params": draft}, chosen


def sequence_logits(model: DecoderModel, params: dict, tokens, positions):
    """Logits [T, V] float32 at every position of one sequence: one row whose new tokens are the whole sequence,
    over an empty one-slot cache (cached_lens 0, so attention only sees the sequence's own keys).

    tokens, positions: [T] int32 (positions -1 for padding)."""
    T = tokens.shape[0]
    config = model.config
    rows = RaggedRows(positions=positions, token_row=jnp.zeros(T, jnp.int32),
                      query_start=jnp.array([0, T], jnp.int32), cached_lens=jnp.zeros(1, jnp.int32),
                      page_table=jnp.zeros((1, 1), jnp.int32))
    kv_cache = init_kv_cache(config, num_pages=1, page_size=1, dtype=model.dtype)  # per layer [1, 1, KVH, D]
    logits, _ = model.apply(params, tokens, kv_cache, rows)
    return logits


def batch_logits(model: DecoderModel, params: dict, tokens, positions):
    """Logits [B, T, V]: sequence_logits over a batch of sequences (a row each, vmapped), so each sequence's
    attention is [T, T] rather than the whole batch's [B*T, B*T] of one ragged row per sequence."""
    return jax.vmap(lambda t, p: sequence_logits(model, params, t, p))(tokens, positions)


def teacher_logits(target: DecoderModel, target_params: dict, tokens, positions):
    """The target's logits [B, T, V], the soft labels: constants to the draft's gradient."""
    return jax.lax.stop_gradient(batch_logits(target, target_params, tokens, positions))


def kl_loss(draft_logits, target_logits, mask):
    """Mean over masked positions of KL(target || draft) = sum_v p_t (log p_t - log p_d).

    draft_logits, target_logits: [B, T, V] float32; mask: [B, T] bool (the sequence's tokens, not padding)."""
    log_pt = jax.nn.log_softmax(target_logits, axis=-1)
    log_pd = jax.nn.log_softmax(draft_logits, axis=-1)
    kl = jnp.sum(jnp.exp(log_pt) * (log_pt - log_pd), axis=-1)  # [B, T]
    return jnp.sum(jnp.where(mask, kl, 0.0)) / jnp.maximum(jnp.sum(mask), 1)


# The input embedding is not trained: a small data set touches few of its 49k rows, and it is shared with the
# target's (so a checkpoint could one day share it). Everything else is.
FROZEN = ("embed_tokens",)


def split_params(params: dict) -> tuple[dict, dict]:
    """{"params": ...} -> (trainable, frozen) dicts of top-level entries."""
    p = params["params"]
    return ({k: v for k, v in p.items() if k not in FROZEN}, {k: v for k, v in p.items() if k in FROZEN})


def make_optimizer(lr: float, steps: int, warmup: int, clip: float = 1.0, weight_decay: float = 0.01):
    """adamw with linear warm-up then cosine decay to 10% of lr, after global-norm clipping. Weight decay only on
    the decoder layers' matrices: norms are scales near 1, and the lm_head should stay the target's unless the
    loss moves it."""
    schedule = optax.warmup_cosine_decay_schedule(0.0, lr, max(warmup, 1), max(steps, warmup + 1), lr * 0.1)
    decay_mask = lambda tree: {k: jax.tree.map(lambda x: x.ndim == 2 and k.startswith("layers_"), v)  # noqa: E731
                               for k, v in tree.items()}
    return optax.chain(optax.clip_by_global_norm(clip),
                       optax.adamw(schedule, b1=0.9, b2=0.98, weight_decay=weight_decay, mask=decay_mask)), schedule


def make_train_step(draft: DecoderModel, target: DecoderModel, optimizer):
    """A jitted step (the models' attention must be "dense": differentiable):
    (trainable, frozen, opt_state, target_params, tokens [B, T], positions [B, T]) ->
    (trainable, opt_state, loss, grad_norm). The target's forward runs inside it, so its [B, T, V] logits never
    leave the device."""
    def loss_fn(trainable, frozen, target_params, tokens, positions):
        teacher = teacher_logits(target, target_params, tokens, positions)  # [B, T, V]
        student = batch_logits(draft, {"params": {**trainable, **frozen}}, tokens, positions)  # [B, T, V]
        return kl_loss(student, teacher, positions >= 0)

    @jax.jit
    def train_step(trainable, frozen, opt_state, target_params, tokens, positions):
        loss, grads = jax.value_and_grad(loss_fn)(trainable, frozen, target_params, tokens, positions)
        updates, opt_state = optimizer.update(grads, opt_state, trainable)
        return optax.apply_updates(trainable, updates), opt_state, loss, optax.tree.norm(grads)

    return train_step


# ---------------------------------------------------------------------------------------------------------------
# Evaluation


def make_eval_step(draft: DecoderModel, target: DecoderModel):
    """Jitted: per position the target's and the draft's argmax [B, T], KL(target || draft) [B, T] and
    sum_v min(p_t, p_d) [B, T] (the chance speculative sampling at temperature 1 accepts the draft's token)."""
    @jax.jit
    def eval_step(draft_params, target_params, tokens, positions):
        t = batch_logits(target, target_params, tokens, positions)
        d = batch_logits(draft, draft_params, tokens, positions)
        log_pt, log_pd = jax.nn.log_softmax(t, -1), jax.nn.log_softmax(d, -1)
        kl = jnp.sum(jnp.exp(log_pt) * (log_pt - log_pd), -1)
        overlap = jnp.sum(jnp.minimum(jnp.exp(log_pt), jnp.exp(log_pd)), -1)
        return jnp.argmax(t, -1), jnp.argmax(d, -1), kl, overlap
    return eval_step


def accepted_runs(agree: np.ndarray, k: int) -> list[int]:
    """Greedy speculative decoding walked along one sequence, teacher-forced: from each verification's first
    position the draft's k proposals are accepted while they agree with the target; the target then adds one token,
    so the next verification starts j + 1 positions on. agree: [n] bool over the generated positions. Returns each
    full verification's accepted count j (0..k); a last one with fewer than k positions left is dropped."""
    runs, i = [], 0
    while i + k <= len(agree):
        j = 0
        while j < k and agree[i + j]:
            j += 1
        runs.append(j)
        i += j + 1
    return runs


def evaluate(eval_step, draft_params, target_params, seqs: list[dict], seq_len: int, batch_size: int,
             k_max: int = 5, k_walk: int = 4) -> dict:
    """Teacher-forced agreement on held-out sequences, over the positions whose next token was generated (where a
    draft proposes: position i predicts token i + 1, so prompt_len - 1 .. len - 2)."""
    agree_all, kls, overlaps, runs = [], [], [], []
    for start in range(0, len(seqs), batch_size):
        chunk = seqs[start:start + batch_size]
        chunk = chunk + [chunk[-1]] * (batch_size - len(chunk))  # a fixed batch shape: one compile
        tokens, positions, prompt_lens = pad_batch(chunk, seq_len)
        t_arg, d_arg, kl, overlap = map(np.asarray, eval_step(draft_params, target_params, tokens, positions))
        for b in range(min(batch_size, len(seqs) - start)):
            n = int((positions[b] >= 0).sum())
            sl = slice(int(prompt_lens[b]) - 1, n - 1)  # predicts the generated tokens
            agree = t_arg[b, sl] == d_arg[b, sl]
            agree_all.append(agree)
            kls.append(kl[b, sl])
            overlaps.append(overlap[b, sl])
            runs += accepted_runs(agree, k_walk)
    agree = np.concatenate(agree_all)
    a = float(agree.mean())
    independent = {k: (k + 1.0) if a >= 1 else (1 - a ** (k + 1)) / (1 - a) for k in range(1, k_max + 1)}
    return {"positions": int(agree.size), "agreement": a, "kl": float(np.concatenate(kls).mean()),
            "sampling_acceptance": float(np.concatenate(overlaps).mean()),
            "tokens_per_step_independent": independent,
            f"measured_k{k_walk}_mean_accepted": float(np.mean(runs)) if runs else 0.0,
            f"measured_k{k_walk}_tokens_per_step": float(np.mean(runs)) + 1.0 if runs else 1.0,
            f"measured_k{k_walk}_steps": len(runs)}


def print_table(before: dict, after: dict | None, k_walk: int = 4) -> None:
    cols = [("untrained", before)] + ([("trained", after)] if after else [])
    print(f"{'':38}" + "".join(f"{name:>12}" for name, _ in cols))
    rows = [("positions evaluated", lambda r: f"{r['positions']}"),
            ("agreement a (argmax)", lambda r: f"{r['agreement']:.3f}"),
            ("KL(target || draft), nats", lambda r: f"{r['kl']:.3f}"),
            ("sampling acceptance (T=1)", lambda r: f"{r['sampling_acceptance']:.3f}")]
    rows += [(f"tokens/step, k={k}, independent", lambda r, k=k: f"{r['tokens_per_step_independent'][k]:.2f}")
             for k in range(1, 6)]
    rows += [(f"measured k={k_walk}: mean accepted", lambda r: f"{r[f'measured_k{k_walk}_mean_accepted']:.2f}"),
             (f"measured k={k_walk}: tokens/step", lambda r: f"{r[f'measured_k{k_walk}_tokens_per_step']:.2f}")]
    for label, fmt in rows:
        print(f"{label:38}" + "".join(f"{fmt(r):>12}" for _, r in cols))


# ---------------------------------------------------------------------------------------------------------------
# Training


def train(train_step, optimizer, draft_params, target_params, seqs: list[dict], seq_len: int, batch_size: int,
          steps: int, seed: int, log_every: int = 10, schedule=None) -> tuple[dict, list[float]]:
    """steps of train_step over shuffled batches of seqs (reshuffled each epoch). Returns the trained params
    {"params": ...} and the loss of every step."""
    trainable, frozen = split_params(draft_params)
    opt_state = optimizer.init(trainable)
    rng = np.random.default_rng(seed)
    order, losses = [], []
    start = last = time.perf_counter()
    tokens_since = 0
    for step in range(1, steps + 1):
        if len(order) < batch_size:
            order += list(rng.permutation(len(seqs)))
        batch, order = [seqs[i] for i in order[:batch_size]], order[batch_size:]
        tokens, positions, _ = pad_batch(batch, seq_len)
        trainable, opt_state, loss, gnorm = train_step(trainable, frozen, opt_state, target_params, tokens,
                                                       positions)
        losses.append(float(loss))  # a sync per step: the loss is also the progress line's
        tokens_since += int((positions >= 0).sum())
        if step % log_every == 0 or step in (1, steps):
            now = time.perf_counter()
            lr = f" lr {float(schedule(step - 1)):.2e}" if schedule else ""
            print(f"step {step:5d}/{steps}  loss {np.mean(losses[-log_every:]):.4f}  grad-norm {float(gnorm):.3f}"
                  f"{lr}  {tokens_since / (now - last):.0f} tok/s  ({now - start:.0f} s)", flush=True)
            last, tokens_since = now, 0
    return {"params": {**trainable, **frozen}}, losses


def save_draft(path: Path, config, params: dict, tokenizer) -> None:
    from jaxserve.weights.orbax_ckpt import save_checkpoint
    save_checkpoint(Path(path), config, params, tokenizer)


def check_checkpoint(path: Path, config, params: dict, run_llm: bool = True) -> str | None:
    """Loads the saved draft with load_model (the params must come back equal) and, run_llm, generates with it."""
    from jaxserve.weights import load_model
    loaded = load_model(str(path), jnp.float32)
    assert loaded.config == config, (loaded.config, config)
    same = jax.tree.map(lambda a, b: bool(np.array_equal(np.asarray(a), np.asarray(b))), loaded.params, params)
    assert all(jax.tree.leaves(same)), "the checkpoint's params differ from the trained ones"
    if not run_llm:
        return None
    from jaxserve import LLM, SamplingParams
    llm = LLM(str(path), max_model_len=256, max_num_seqs=2, max_num_batched_tokens=64, warmup=False)
    out = llm.generate("The capital of France is", SamplingParams(temperature=0.0, max_tokens=16), use_tqdm=False)
    return out[0].outputs[0].text


# ---------------------------------------------------------------------------------------------------------------


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="directory for the draft's jaxserve checkpoint (new or empty)")
    ap.add_argument("--target", default=None, help="the target model (default: the default model)")
    ap.add_argument("--layers", type=int, default=4, help="decoder layers in the draft")
    ap.add_argument("--steps", type=int, default=80, help="optimizer steps")
    ap.add_argument("--batch-size", type=int, default=4, help="sequences per step")
    ap.add_argument("--num-prompts", type=int, default=160, help="prompts to generate from (1/8 held out)")
    ap.add_argument("--max-tokens", type=int, default=128, help="tokens the target generates per prompt")
    ap.add_argument("--seq-len", type=int, default=256, help="training sequences are cut/padded to this")
    ap.add_argument("--temperature", type=float, default=0.7, help="the target's sampling temperature")
    ap.add_argument("--lr", type=float, default=5e-4, help="peak learning rate")
    ap.add_argument("--warmup", type=int, default=None, help="warm-up steps (default: 10%% of --steps)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="write the figures here")
    ap.add_argument("--log-every", type=int, default=5)
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    from jaxserve import LLM
    from jaxserve.weights import load_model
    if Path(args.out).exists() and any(Path(args.out).iterdir()):
        print(f"{args.out} exists and is not empty; choose a new directory", file=sys.stderr)
        return 1
    t0 = time.perf_counter()
    timings = {}

    # 1. Data: the target's own continuations.
    prompts = make_prompts(args.num_prompts, args.seed)
    llm = LLM(args.target, max_model_len=max(args.seq_len, 64) + args.max_tokens, max_num_seqs=32,
              max_num_batched_tokens=512, warmup=False)
    seqs = generate_data(llm, prompts, args.max_tokens, args.temperature, args.seed)
    tokenizer = llm.get_tokenizer()
    del llm
    held_out = max(1, len(seqs) // 8)
    # Held out: every 8th prompt, so each kind (which cycle with period 4) is in both splits.
    eval_seqs = [s for i, s in enumerate(seqs) if i % 8 == 7][:held_out] if len(seqs) >= 8 else seqs[-held_out:]
    train_seqs = [s for s in seqs if not any(s is e for e in eval_seqs)]
    gen = sum(len(s["tokens"]) - s["prompt_len"] for s in seqs)
    timings["generate_s"] = time.perf_counter() - t0
    print(f"generated {gen} tokens for {len(seqs)} prompts in {timings['generate_s']:.0f} s; "
          f"{len(train_seqs)} train / {len(eval_seqs)} held-out sequences, "
          f"{sum(min(len(s['tokens']), args.seq_len) for s in train_seqs)} training tokens", flush=True)

    # 2. Draft from the target.
    target = load_model(args.target, jnp.float32)
    draft_config, draft_params, chosen = init_draft(target.config, target.params, args.layers)
    print(f"draft: {args.layers} of {target.config.num_layers} layers ({', '.join(map(str, chosen))}), "
          f"{sum(x.size for x in jax.tree.leaves(draft_params)) / 1e6:.1f}M params", flush=True)
    # The "dense" attention backend: the blocked one's dynamic loops cannot be differentiated.
    target_model = DecoderModel(target.config, jnp.float32, "dense")
    draft_model = DecoderModel(draft_config, jnp.float32, "dense")

    # 3. Baseline, train, evaluate again.
    eval_step = make_eval_step(draft_model, target_model)
    t = time.perf_counter()
    before = evaluate(eval_step, draft_params, target.params, eval_seqs, args.seq_len, args.batch_size)
    timings["eval_s"] = time.perf_counter() - t
    print_table(before, None)
    warmup = args.warmup if args.warmup is not None else max(1, args.steps // 10)
    optimizer, schedule = make_optimizer(args.lr, args.steps, warmup)
    train_step = make_train_step(draft_model, target_model, optimizer)
    t = time.perf_counter()
    draft_params, losses = train(train_step, optimizer, draft_params, target.params, train_seqs, args.seq_len,
                                 args.batch_size, args.steps, args.seed, args.log_every, schedule)
    timings["train_s"] = time.perf_counter() - t
    after = evaluate(eval_step, draft_params, target.params, eval_seqs, args.seq_len, args.batch_size)
    print()
    print_table(before, after)

    # 4. Save and check it loads and generates.
    save_draft(Path(args.out), draft_config, draft_params, tokenizer)
    text = check_checkpoint(Path(args.out), draft_config, draft_params)
    print(f"saved {args.out}; LLM({args.out!r}).generate('The capital of France is') -> {text!r}")
    timings["total_s"] = time.perf_counter() - t0
    print(f"wall time {timings['total_s']:.0f} s (generate {timings['generate_s']:.0f}, "
          f"train {timings['train_s']:.0f})")
    if args.json:
        report = {"args": vars(args), "draft_layers": chosen, "target_layers": target.config.num_layers,
                  "train_sequences": len(train_seqs), "eval_sequences": len(eval_seqs), "generated_tokens": gen,
                  "before": before, "after": after, "loss_first": losses[0], "loss_last": float(np.mean(losses[-10:])),
                  "losses": losses, "timings": timings, "checkpoint": str(Path(args.out).absolute()),
                  "sample_text": text}
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
