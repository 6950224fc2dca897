"""Random ragged batches over a random paged cache, and a dense numpy oracle: shared by the attention tests."""
import dataclasses

import numpy as np

from jaxserve.runner.batch_builder import Row, build_batch

KINDS = ("decode", "prefill", "mixed")


@dataclasses.dataclass
class RaggedCase:
    q: np.ndarray  # [T, H, D]
    k: np.ndarray  # [T, KVH, D] this step's keys
    v: np.ndarray
    k_pages: np.ndarray  # [num_pages, KVH, page_size, D]
    v_pages: np.ndarray
    batch: object  # StepInput (numpy)
    keys: list  # per row: (k_all, v_all) [start + n, KVH, D], every key of the row in position order
    spans: list  # per row: (first flat token, start position, new tokens)

    @property
    def rows(self):
        return self.batch.rows


def row_lengths(rng, kind: str, max_start: int = 300):
    """(cached tokens, new tokens) per row: decode rows, prompt chunks (fresh or after a cached prefix), or both."""
    decode = [(int(rng.integers(1, max_start)), 1) for _ in range(rng.integers(1, 6))]
    chunks = [(int(rng.integers(0, max_start)) * int(rng.integers(0, 2)), int(rng.integers(2, 40)))
              for _ in range(rng.integers(1, 4))]
    return {"decode": decode, "prefill": chunks, "mixed": decode + chunks}[kind]


def random_ragged_case(rng, lengths, *, page_size=4, heads=6, kv_heads=2, head_dim=16, num_pages=None,
                       pad_tokens=5, pad_rows=2, dtype=np.float32) -> RaggedCase:
    """Rows with `lengths` [(cached, new)] in a shuffled order, with stale data in every page."""
    D = head_dim
    need = sum(-(-(s + n) // page_size) for s, n in lengths)
    num_pages = num_pages or need + 8
    k_pages = rng.normal(size=(num_pages, kv_heads, page_size, D)).astype(dtype)
    v_pages = rng.normal(size=(num_pages, kv_heads, page_size, D)).astype(dtype)
    free = list(rng.permutation(np.arange(1, num_pages)))
    rows, keys = [], []
    for start, n in lengths:
        pages = [int(free.pop()) for _ in range(-(-(start + n) // page_size))]
        k_all = rng.normal(size=(start + n, kv_heads, D)).astype(dtype)
        v_all = rng.normal(size=(start + n, kv_heads, D)).astype(dtype)
        for t in range(start):  # the cached prefix, scattered over the row's pages
            k_pages[pages[t // page_size], :, t % page_size] = k_all[t]
            v_pages[pages[t // page_size], :, t % page_size] = v_all[t]
        rows.append(Row([0] * n, start, pages))
        keys.append((k_all, v_all))
    total = sum(n for _, n in lengths)
    P = max(len(r.pages) for r in rows) + 1
    batch = build_batch(rows, page_size, 100, total + pad_tokens, len(rows) + pad_rows, P)
    T = total + pad_tokens
    q = rng.normal(size=(T, heads, D)).astype(dtype)
    k = rng.normal(size=(T, kv_heads, D)).astype(dtype)
    v = rng.normal(size=(T, kv_heads, D)).astype(dtype)
    spans, t = [], 0
    for (start, n), (k_all, v_all) in zip(lengths, keys):
        k_all[start:], v_all[start:] = k[t:t + n], v[t:t + n]
        spans.append((t, start, n))
        t += n
    return RaggedCase(q, k, v, k_pages, v_pages, batch, keys, spans)


def dense_attention(q, k, v, positions, window=None):
    """q: [Q, H, D] at `positions`; k, v: [L, KVH, D] for positions 0..L-1. Plain numpy, float64."""
    Q, H, D = q.shape
    group = H // k.shape[1]
    out = np.zeros((Q, H, D))
    for i, pos in enumerate(positions):
        keys = np.arange(pos + 1)
        if window is not None:
            keys = keys[keys > pos - window]
        for h in range(H):
            s = k[keys, h // group].astype(np.float64) @ q[i, h] / np.sqrt(D)
            p = np.exp(s - s.max())
            out[i, h] = (p / p.sum()) @ v[keys, h // group]
    return out


def expected(case: RaggedCase, window=None) -> np.ndarray:
    """The oracle: [T, H, D], zeros for padding tokens."""
    out = np.zeros(case.q.shape)
    for (t, start, n), (k_all, v_all) in zip(case.spans, case.keys):
        out[t:t + n] = dense_attention(case.q[t:t + n], k_all, v_all, np.arange(start, start + n), window)
    return out
