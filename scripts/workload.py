"""Synthetic serving workloads: seeded requests with a realistic spread of prompt and output lengths.

Lengths are log-normal (most requests short, a long tail), clipped to [lo, hi], as in chat traces such as
ShareGPT. Token ids are random and clear of the control tokens: cost does not depend on content. Arrivals are a
Poisson process at a given rate (or all at once).
"""
from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass
class Request:
    prompt_token_ids: list[int]
    max_tokens: int
    arrival: float = 0.0  # seconds after the start


def lognormal_lengths(rng, n, median, lo, hi, sigma=0.8):
    return np.clip(np.round(rng.lognormal(np.log(median), sigma, n)), lo, hi).astype(int).tolist()


def synth_requests(n=64, seed=0, vocab=49152, prompt=(128, 16, 512), output=(64, 8, 256),
                   request_rate=float("inf")) -> list[Request]:
    """prompt and output: (median, lo, hi) lengths. request_rate: mean arrivals per second (inf: all at t=0)."""
    rng = np.random.default_rng(seed)
    p_lens = lognormal_lengths(rng, n, *prompt)
    o_lens = lognormal_lengths(rng, n, *output)
    gaps = rng.exponential(1 / request_rate, n) if np.isfinite(request_rate) else np.zeros(n)
    arrivals = np.cumsum(gaps) - gaps[0]
    return [Request(rng.integers(100, vocab, p).tolist(), o, float(t)) for p, o, t in zip(p_lens, o_lens, arrivals)]


def describe(reqs: list[Request]) -> dict:
    p = [len(r.prompt_token_ids) for r in reqs]
    o = [r.max_tokens for r in reqs]
    return {"requests": len(reqs), "prompt_tokens": sum(p), "output_tokens": sum(o),
            "prompt_len_p50_max": [int(np.median(p)), max(p)], "output_len_p50_max": [int(np.median(o)), max(o)]}


def percentiles(xs, ps=(50, 95, 99)) -> dict:
    return {f"p{p}": round(float(np.percentile(xs, p)), 4) for p in ps} if len(xs) else {}
