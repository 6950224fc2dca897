"""Whether to speculate, for whom, and how far: decided every step from measured acceptance and measured costs.

Speculation pays when verifying k + 1 tokens of a row costs little more than decoding one (a memory-bound step
reads the weights once either way) and enough proposals are accepted. Both halves are measured here rather than
assumed: each sequence's acceptance rate (a decaying count of accepted over tested proposals), the device time of
a step of T tokens, plain or verifying, and of a draft step (timed at warm-up, then rescaled by what steps really
take), and the host's time per step and row. With async scheduling a plain step's host work overlaps the device's
and a speculative step, which waits for the step before it, adds its host work to its time; without it (the
default on CPU) every step pays its host work, which the measured step times then hold. A step speculates only
if its expected tokens per second beat plain decoding's by a margin; so at large batches, where a step is
compute-bound and every proposal costs a full token, it turns itself off.
"""
from __future__ import annotations

import weakref

from jaxserve.buckets import round_up

MARGIN = 0.1  # the expected speedup must beat plain decoding by this much: estimates are noisy
MIN_GAIN = 0.01  # a sequence joins only if it raises the step's expected rate by this much (not by noise)
PRIOR_ACCEPTANCE = 0.5  # a new (or re-probed) sequence's acceptance, worth PRIOR_WEIGHT tested proposals
PRIOR_WEIGHT = 2.0
DECAY = 0.7  # per verification: older evidence fades, so a sequence that turns repetitive is noticed
PROBE_EVERY = 32  # steps a sequence sits out before its acceptance is reset to the prior for another try
SCALE_EMA = 0.2  # how fast the cost model follows observed step times


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens a verification of k proposals emits, if each is accepted with probability alpha independently."""
    return k + 1.0 if alpha >= 1.0 else (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


class _Acceptance:
    def __init__(self):
        self.accepted, self.tested, self.idle = PRIOR_ACCEPTANCE * PRIOR_WEIGHT, PRIOR_WEIGHT, 0

    @property
    def rate(self) -> float:
        return self.accepted / self.tested


class SpecController:
    def __init__(self, k: int, token_buckets: tuple[int, ...], target_times: dict, draft_times: dict | None = None):
        """target_times: seconds per step by (tokens, scored per row); draft_times: by (tokens, 1), or None for a
        proposer that costs no device time (n-gram)."""
        self.k = k
        self.buckets = token_buckets
        self.target_times, self.draft_times = target_times, draft_times
        self.scale = {False: 1.0, True: 1.0}  # observed / predicted step time, plain steps and speculative rounds
        self.host_per_row = 0.0  # seconds of the host's own work per step and row (not waiting for the device)
        self._acceptance: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        # vLLM's spec-decode counters.
        self.num_drafts = self.num_draft_tokens = self.num_accepted_tokens = 0
        self.num_accepted_tokens_per_pos = [0] * k
        self.num_speculating = 0  # sequences that speculated in the last step

    # ---- the decision ----

    def choose(self, seqs, available) -> dict:
        """Proposals to ask for, per decoding sequence (none if speculation does not pay now).

        seqs: the sequences that will decode; available(seq): proposals its proposer has (None: any number).
        Greedy over sequences, most accepting first: each takes the k that most raises the step's expected tokens
        per second; one that no k raises by MIN_GAIN sits out.
        """
        B = len(seqs)
        if B == 0 or B + 1 > self.buckets[-1]:
            return {}
        plain = B / self._time(B, False)
        rates = []
        for s in seqs:
            acc = self._acceptance.setdefault(s, _Acceptance())
            acc.idle += 1
            if acc.idle > PROBE_EVERY:
                self._acceptance[s] = acc = _Acceptance()
            rates.append((acc.rate, s))
        if not self._could_pay(B, max(r for r, _ in rates), plain):
            return {}  # before asking the proposer anything: a lookup per sequence is host time every step
        chosen: dict = {}
        tokens, extra, longest = float(B), 0, 0
        best = plain
        for alpha, s in sorted(rates, key=lambda c: -c[0]):
            limit = self.k if (a := available(s)) is None else min(self.k, len(a))
            pick = None
            for k in range(1, limit + 1):
                if B + extra + k > self.buckets[-1]:
                    break
                rate = (tokens + expected_tokens(alpha, k) - 1) / self._round_time(
                    B + extra + k, B, len(chosen) + 1, max(longest, k))
                if rate > best * (1 + MIN_GAIN):
                    best, pick = rate, k
            if pick is None:
                continue
            chosen[s] = pick
            tokens += expected_tokens(alpha, pick) - 1
            extra += pick
            longest = max(longest, pick)
        return chosen if best > plain * (1 + MARGIN) else {}

    def _could_pay(self, B: int, alpha: float, plain: float) -> bool:
        """Would one sequence, or all of them, speculating at the best acceptance seen beat plain decoding?"""
        for k in range(1, self.k + 1):
            for n in (1, B):
                if B + n * k <= self.buckets[-1] and (B + n * (expected_tokens(alpha, k) - 1)) / \
                        self._round_time(B + n * k, B, n, k) > plain * (1 + MARGIN):
                    return True
        return False

    def _time(self, tokens: int, verifying: bool) -> float:
        bucket = round_up(tokens, self.buckets)
        # A one-token step has no verification program (a round whose proposals all came back empty).
        key = (bucket, self.k + 1 if verifying and bucket > 1 else 1)
        return self.target_times[key] * self.scale[verifying]

    def _round_time(self, tokens: int, rows: int, drafting: int, longest: int, host: bool = True) -> float:
        """A speculative round of `rows` decoding rows, `drafting` of which propose (at most `longest` each): the
        draft's steps (its catch-up of about two tokens a row, then one step per further proposal), the
        verification step, and the host's work, which nothing overlaps."""
        t = self._time(tokens, True)
        if self.draft_times is not None:
            d = lambda n: self.draft_times[round_up(n, self.buckets), 1]  # noqa: E731
            t += (d(min(2 * drafting, self.buckets[-1])) + (longest - 1) * d(drafting)) * self.scale[True]
        return t + (self.host_per_row * rows if host else 0.0)

    # ---- what happened ----

    def observe_step(self, tokens: int, seconds: float, speculative: bool, rows: int = 0, drafting: int = 0,
                     longest: int = 0) -> None:
        """A plain step's time (between read-backs) or a speculative round's (host work included), which rescales
        the warm-up timings of the device's part."""
        if speculative:
            seconds -= self.host_per_row * rows
            predicted = self._round_time(tokens, rows, drafting, longest, host=False)
        else:
            predicted = self._time(tokens, False)
        predicted /= self.scale[speculative]
        ratio = min(max(seconds / predicted, 0.25), 4.0)  # one stall (GC, a new page fault) must not flip it
        self.scale[speculative] += SCALE_EMA * (ratio - self.scale[speculative])

    def observe_host(self, rows: int, seconds: float) -> None:
        """The host's own work in a step of `rows` rows (planning, building the batch, reading tokens back)."""
        if rows:
            self.host_per_row += SCALE_EMA * (seconds / rows - self.host_per_row)

    def observe(self, seq, proposed: int, accepted: int) -> None:
        """A verification of `proposed` proposals of which the first `accepted` were."""
        acc = self._acceptance.setdefault(seq, _Acceptance())
        # Tested: the accepted ones and the first rejected one (later ones were never looked at).
        acc.accepted = DECAY * acc.accepted + accepted
        acc.tested = DECAY * acc.tested + accepted + (accepted < proposed)
        acc.idle = 0
        self.num_drafts += 1
        self.num_draft_tokens += proposed
        self.num_accepted_tokens += accepted
        for j in range(accepted):
            self.num_accepted_tokens_per_pos[j] += 1

    def acceptance(self, seq) -> float:
        acc = self._acceptance.get(seq)
        return PRIOR_ACCEPTANCE if acc is None else acc.rate

    @property
    def acceptance_rate(self) -> float:
        """Accepted over proposed tokens, over the engine's life (vLLM's definition)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0
