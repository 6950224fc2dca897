"""What the penalties count, kept on device per slot (the runner's slots of `last_tokens`) and carried from step to
step, so that a step sends no row's history: each step counts its own new tokens into its rows' slots.

The history [rows, context] a step sent (and scattered into [rows, V] counts) cost each step in proportion to the
longest context in it: fine at 8K tokens, heavy at 128K. With the counts kept here a step's penalty work is its
new tokens' scatter and the [rows, V] gather of its rows' counts, whatever their context. A row's slot is filled
from its tokens once (`SamplingInput.penalty_init`, its history in `past_tokens`: the runner sends it when the slot
does not hold that sequence's tokens up to the row's start: a new or preempted sequence, a prefix-cache hit, a
forked one), and then only counted into.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PenaltyCounts:
    generated: jax.Array  # int32 [slots, V]: the times each token was generated (presence and frequency)
    in_prompt: jax.Array  # bool [slots, V]: the token is in the prompt (repetition, with generated > 0)


def empty_counts(num_slots: int, vocab_size: int) -> PenaltyCounts:
    return PenaltyCounts(jnp.zeros((num_slots, vocab_size), jnp.int32), jnp.zeros((num_slots, vocab_size), bool))


def counted(state: PenaltyCounts, p, tokens, rows, uses) -> PenaltyCounts:
    """state with the step counted in: the slots of the rows that start over (p.penalty_init) reset and filled from
    p.past_tokens [S, H] (vocab_size past their tokens), then every penalty row's new tokens counted, each as a
    prompt token below its row's p.prompt_len, else as a generated one. tokens [T]: the step's (as the device has
    them: a chained row's is the token the step before sampled); rows: its `jaxserve.batch.RaggedRows`; uses [S]:
    the rows with a penalty (the others' slots are left alone). Free where no row has one."""
    slots, V = state.generated.shape
    slot = jnp.where(uses & (p.penalty_slot >= 0), p.penalty_slot, slots)  # [S]; slots: no slot, dropped

    def count(st, slot_of, token, generated):
        """st with token [...] counted at slot_of [...] (slots: not counted)."""
        token = jnp.where((token >= 0) & (token < V), token, V)  # a token id or dropped
        g = st.generated.at[jnp.where(generated, slot_of, slots), token].add(1, mode="drop")
        return PenaltyCounts(g, st.in_prompt.at[jnp.where(generated, slots, slot_of), token].set(True, mode="drop"))

    def reset(st):
        start = jnp.where(p.penalty_init, slot, slots)  # [S]
        st = PenaltyCounts(st.generated.at[start].set(0, mode="drop"), st.in_prompt.at[start].set(False, mode="drop"))
        H = p.past_tokens.shape[1]
        generated = jnp.arange(H)[None, :] >= p.prompt_len[:, None]  # [S, H]
        return count(st, jnp.broadcast_to(start[:, None], (start.shape[0], H)), p.past_tokens, generated)

    def step(st):
        row = rows.token_row  # [T]
        slot_of = jnp.where(rows.positions >= 0, slot[row], slots)  # [T]; padding: dropped
        return count(st, slot_of, tokens, rows.positions >= p.prompt_len[row])

    state = jax.lax.cond(jnp.any(uses & p.penalty_init), reset, lambda st: st, state)
    return jax.lax.cond(jnp.any(uses), step, lambda st: st, state)


def row_counts(state: PenaltyCounts, slot, offset, V: int):
    """Rows' (generated counts float32 [S, V], seen bool [S, V]: in the prompt or generated) of the vocabulary's
    slice [offset, offset + V) (all of it on one device), from their slots [S] (-1: none, zeros)."""
    slots = state.generated.shape[0]
    safe = jnp.clip(slot, 0, slots - 1)
    generated = jax.lax.dynamic_slice_in_dim(state.generated[safe], offset, V, axis=1)  # [S, V]
    in_prompt = jax.lax.dynamic_slice_in_dim(state.in_prompt[safe], offset, V, axis=1)
    held = (slot >= 0)[:, None]
    generated = jnp.where(held, generated, 0)
    return generated.astype(jnp.float32), held & (in_prompt | (generated > 0))
