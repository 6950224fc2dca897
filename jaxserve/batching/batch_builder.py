"""Host-side construction of a step's batch: numpy arrays padded to a bucket, copied to the device in one go."""
from __future__ import annotations

import dataclasses

import numpy as np

from jaxserve.cache import SCRATCH_PAGE, pages_needed
from jaxserve.sampling_params import MAX_BANNED_TOKENS


@dataclasses.dataclass
class RowSampling:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int = 0
    step: int = 0
    banned: tuple[int, ...] = ()
    want_top_logprobs: bool = False


@dataclasses.dataclass
class Row:
    """One sequence's part of a step."""
    token_ids: list[int]  # new tokens this step
    start_pos: int  # tokens of this sequence already in the cache
    pages: list[int]  # its pages, covering at least start_pos + len(token_ids) tokens
    sampling: RowSampling = dataclasses.field(default_factory=RowSampling)
    slot: int = -1  # where the device keeps the token this row samples (-1: the padding slot)
    chained: bool = False  # token_ids[0] is a placeholder for the token last sampled into `slot`, still on device

    @property
    def end(self) -> int:
        return self.start_pos + len(self.token_ids)


def build_batch(rows: list[Row], page_size: int, vocab_size: int, num_rows: int, tokens_per_row: int,
                pages_per_row: int) -> dict:
    """Pads `rows` to [num_rows, tokens_per_row] tokens and a [num_rows, pages_per_row] page table."""
    S, Q, P = num_rows, tokens_per_row, pages_per_row
    if len(rows) > S:
        raise ValueError(f"{len(rows)} rows do not fit a batch of {S}")
    token_ids = np.zeros((S, Q), np.int32)
    positions = np.full((S, Q), -1, np.int32)
    # Padding writes land in the scratch page, spread over its slots.
    slot_mapping = np.tile(SCRATCH_PAGE * page_size + np.arange(Q, dtype=np.int32) % page_size, (S, 1))
    page_table = np.full((S, P), SCRATCH_PAGE, np.int32)
    context_lens = np.zeros(S, np.int32)
    logits_index = np.zeros(S, np.int32)
    token_slot = np.full(S, -1, np.int32)
    out_slot = np.full(S, -1, np.int32)
    sampling = {
        "temperature": np.zeros(S, np.float32), "top_k": np.zeros(S, np.int32), "top_p": np.ones(S, np.float32),
        "min_p": np.zeros(S, np.float32), "seed": np.zeros(S, np.uint32), "step": np.zeros(S, np.int32),
        "banned": np.full((S, MAX_BANNED_TOKENS), vocab_size, np.int32), "want_top_logprobs": np.zeros(S, bool),
    }
    for i, row in enumerate(rows):
        n, end = len(row.token_ids), row.end
        if not 1 <= n <= Q:
            raise ValueError(f"row {i} has {n} new tokens; a row holds 1..{Q}")
        if len(row.pages) * page_size < end:
            raise ValueError(f"row {i}: {len(row.pages)} pages cannot hold {end} tokens")
        # The table lists only the pages of tokens cached before this step: the new tokens' keys reach attention
        # directly, so a fresh prompt attends through an empty table.
        cached = row.pages[:pages_needed(row.start_pos, page_size)]
        if len(cached) > P:
            raise ValueError(f"row {i}: {row.start_pos} cached tokens need {len(cached)} pages, the table holds {P}")
        pos = np.arange(row.start_pos, end, dtype=np.int32)
        pages = np.asarray(row.pages, np.int32)
        token_ids[i, :n] = row.token_ids
        positions[i, :n] = pos
        slot_mapping[i, :n] = pages[pos // page_size] * page_size + pos % page_size
        page_table[i, :len(cached)] = cached
        context_lens[i] = end
        logits_index[i] = n - 1
        out_slot[i] = row.slot
        if row.chained:
            token_slot[i] = row.slot
        s = row.sampling
        if len(s.banned) > MAX_BANNED_TOKENS:  # refused at admission (see LLM._sequences): a bug if it gets here
            raise ValueError(f"row {i} bans {len(s.banned)} tokens; a row holds at most {MAX_BANNED_TOKENS}")
        for key in ("temperature", "top_k", "top_p", "min_p", "seed", "step", "want_top_logprobs"):
            sampling[key][i] = getattr(s, key)
        sampling["banned"][i, :len(s.banned)] = s.banned
    return {"token_ids": token_ids, "positions": positions, "slot_mapping": slot_mapping, "page_table": page_table,
            "context_lens": context_lens, "logits_index": logits_index, "token_slot": token_slot, "out_slot": out_slot,
            "sampling": sampling}
