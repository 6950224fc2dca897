"""The step's token budget, sized by queue depth (DESIGN.md's rule: few waiting, TTFT first; many, throughput first).

A step's prompt chunks share one token budget with its decode rows. A small budget keeps a step short, so running
decodes keep their TPOT while a prompt or two arrives; but when many prompts arrive together (64 closed-loop clients
finish and return in waves: ~64 prompts, ~2,900 tokens at once) a 512-token budget passes them through ~6 steps,
and the last one's first token waits for all of them. So the budget grows with the prompts waiting to be computed,
up to a ceiling whose step sizes are bucketed and compiled at warm-up (nothing compiles while serving):

  prompts to compute   < SMALL_QUEUE      the base budget (512 by default)
                       <= LARGE_QUEUE     twice the base (at most the ceiling)
                       > LARGE_QUEUE      the ceiling (2048 by default, llama-server's batch)

An explicit `max_num_batched_tokens` keeps vLLM's meaning: the budget of every step, never exceeded (base = ceiling).
"""
from __future__ import annotations

# The default budget of a step (max_num_batched_tokens not given), and how far a deep queue may grow it.
DEFAULT_STEP_TOKENS = 512
MAX_STEP_TOKENS = 2048
# Queue depths (prompts waiting to be computed) where the budget doubles and where it reaches the ceiling: DESIGN.md's
# "< 10 waiting: TTFT first; 10-50: balanced; > 50: throughput first".
SMALL_QUEUE = 10
LARGE_QUEUE = 50


def step_budgets(max_num_batched_tokens: int | None, max_num_seqs: int) -> tuple[int, int]:
    """(base, ceiling) of the step's token budget: an explicit max_num_batched_tokens is both; None (the default)
    is DEFAULT_STEP_TOKENS growing to MAX_STEP_TOKENS, each at least max_num_seqs (every running sequence decodes
    a token per step)."""
    if max_num_batched_tokens is not None:
        return max_num_batched_tokens, max_num_batched_tokens
    base = max(DEFAULT_STEP_TOKENS, max_num_seqs)
    return base, max(MAX_STEP_TOKENS, base)


def budget_for_queue(queue_depth: int, base: int, ceiling: int) -> int:
    """The step's token budget with `queue_depth` prompts waiting to be computed (see the module's table)."""
    if queue_depth < SMALL_QUEUE:
        return base
    return max(base, min(2 * base if queue_depth <= LARGE_QUEUE else ceiling, ceiling))
