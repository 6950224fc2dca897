"""A runner with no model: the engine loop and the scheduler under test, with tokens worked out by hand.

Every token's successor is `next_token(t) = (t + 1) % vocab_size` (skipping tokens a row bans under min_tokens), so
a greedy sequence from prompt [.., t] generates t + 1, t + 2, ... A verification row accepts its proposals while
each equals the successor of the token before it, as the real verifier accepts proposals equal to its own draw.
Faults are injected by asking for them (`fail`), not by patching a live runner.

LoRA: a fake adapter (`fake_adapter`, from a LoRARequest whose path is "shift/N") adds N to every successor of the
rows that name its slot, so each adapter's tokens differ from the base model's and from each other's.
"""
from __future__ import annotations

import dataclasses
import time

import numpy as np

from jaxserve import LLM
from jaxserve.batch import StepOutput
from jaxserve.batching.engine_core import PLAN_LEAD_FACTOR, PLAN_LEAD_S, EngineCore
from jaxserve.batching.scheduler import Scheduler
from jaxserve.batching.speculation.controller import SpecController
from jaxserve.batching.speculation.draft import DraftProposer
from jaxserve.batching.speculation.ngram import NgramProposer
from jaxserve.buckets import geometric
from jaxserve.cache import HostTier, PageAllocator, PrefixCache, pages_needed
from jaxserve.engine.factory import EngineParts
from jaxserve.lora.adapter import LoRAError
from jaxserve.lora.slot_cache import HostAdapters, LoRASlots
from jaxserve.runner.batch_builder import Row
from jaxserve.runner.protocol import StepHandle
from jaxserve.sampling_params import MAX_LOGPROBS


@dataclasses.dataclass
class FakeHandle(StepHandle):
    rows: list[Row] = dataclasses.field(default_factory=list)  # what a fault's `when` is asked about at fetch
    ends: float = 0.0  # time.perf_counter() when the fake device has run it (step_seconds)


@dataclasses.dataclass
class Fault:
    on: str  # "dispatch" or "fetch"
    when: object  # rows -> bool: which step fails
    error: BaseException
    times: int  # how many more steps it fails (-1: every one)


class FakeRunner:
    splits_sampling = False  # structured output runs on real models: a constrained step is read back first
    def __init__(self, vocab_size: int = 64, num_speculative_tokens: int = 0, successor=None, num_pages: int = 0,
                 page_size: int = 0):
        """successor(token) -> the token after it (default: the next id): a fake draft model guesses with another
        rule, so some of its proposals are rejected. num_pages, page_size: a fake KV cache (see `kv`)."""
        # The KV cache as the token written at each slot [num_pages, page_size] (-1: never written): pages move
        # out and in (export_pages / import_pages), and a row that reads a slot never written fails the step, as
        # a real one would compute garbage from it (a missing import, say).
        self.kv = np.full((num_pages, page_size), -1, np.int64) if num_pages else None
        self.vocab_size = vocab_size
        self._successor = successor
        self.num_speculative_tokens = num_speculative_tokens
        self.last_tokens: dict[int, int] = {}  # slot -> the token a row last emitted into it (the device buffer)
        self.step_times: dict[tuple[int, int], float] = {}
        # A fake transfer moves exactly the pages asked (no padding), so any count is a bucket of its own: these are
        # the ones a warm-up moves.
        self.page_buckets = geometric(1, num_pages) if num_pages else ()
        self.steps: list[list[Row]] = []  # the rows of every dispatched step, in order
        self.events: list[str] = []  # "dispatch" / "wait" / "fetch", in order
        self._faults: list[Fault] = []
        self.gate = None  # a threading.Event: while set to one, each wait and read-back waits for it (an engine held)
        # How long each step takes on a fake device that runs them one after another in the order dispatched
        # (0: at once); when each step was dispatched, started and ended on it (time.perf_counter()).
        self.step_seconds = 0.0
        self.device_times: list[tuple[float, float, float]] = []
        self.lora_shifts: dict[int, int] = {}  # LoRA slot -> the shift of the fake adapter loaded into it

    def next_token(self, token: int) -> int:
        return (token + 1) % self.vocab_size if self._successor is None else self._successor(token) % self.vocab_size

    def fail(self, on: str = "dispatch", when=lambda rows: True, error: BaseException | None = None,
             times: int = 1) -> Fault:
        """The next `times` steps whose rows satisfy `when` fail at `on` with `error` (times=-1: all of them)."""
        fault = Fault(on, when, error or RuntimeError("device lost"), times)
        self._faults.append(fault)
        return fault

    def _check_faults(self, on: str, rows: list[Row], consume: bool = True) -> None:
        """consume=False: a wait for a failed step, which fails as its read-back will (a device array's error
        stays with it)."""
        for f in self._faults:
            if f.on == on and f.times != 0 and f.when(rows):
                f.times -= f.times > 0 and consume
                raise f.error

    def dispatch(self, rows: list[Row]) -> StepHandle:
        self.events.append("dispatch")
        self._check_faults("dispatch", rows)
        self.steps.append(rows)
        if self.kv is not None:
            self._write_kv(rows)
        Q = 1 + self.num_speculative_tokens
        S = len(rows)
        tokens, counts = np.zeros((S, Q), np.int32), np.zeros(S, np.int32)
        for i, row in enumerate(rows):
            ids = list(row.token_ids)
            if row.chained:
                ids[0] = self.last_tokens[row.slot]
            if not row.samples:
                continue
            scored = ids[len(ids) - 1 - row.num_draft:]  # the last token and the proposals after it
            step = row.sampling.step
            emitted = []
            for j, t in enumerate(scored):
                draw = self._draw(t, row, step + j)
                emitted.append(draw)
                if j + 1 == len(scored) or scored[j + 1] != draw:
                    break  # the proposal after it is rejected (or there is none): this draw is the last
            tokens[i, :len(emitted)] = emitted
            counts[i] = len(emitted)
            self.last_tokens[row.slot] = emitted[-1]
        zeros = np.zeros((S, Q), np.float32)
        out = StepOutput(tokens=tokens, num_tokens=counts, logprobs=zeros, ranks=np.ones((S, Q), np.int32),
                         top_ids=np.zeros((S, Q, MAX_LOGPROBS), np.int32),
                         top_logprobs=np.zeros((S, Q, MAX_LOGPROBS), np.float32))
        now = time.perf_counter()
        start = max([now] + [end for _, _, end in self.device_times[-1:]])
        self.device_times.append((now, start, start + self.step_seconds))
        return FakeHandle(S, out, rows=rows, ends=start + self.step_seconds)

    def _write_kv(self, rows: list[Row]) -> None:
        page_size = self.kv.shape[1]
        for i, row in enumerate(rows):
            slots = [(row.pages[p // page_size], p % page_size) for p in range(row.end)]
            if any(self.kv[page, offset] < 0 for page, offset in slots[:row.start_pos]):
                raise RuntimeError(f"row {i} reads K/V never written (pages {row.pages[:row.start_pos]})")
            ids = list(row.token_ids)
            if row.chained:
                ids[0] = self.last_tokens[row.slot]
            for (page, offset), token in zip(slots[row.start_pos:], ids):
                self.kv[page, offset] = token

    def export_pages(self, page_ids: list[int]):
        """Per layer (k, v) [n, page_size]: one layer, K and V both the tokens written."""
        pages = self.kv[page_ids]
        return [(pages, pages.copy())]

    def pages_bytes(self, num_tokens: int) -> int:
        return pages_needed(num_tokens, self.kv.shape[1]) * self.kv[0].nbytes

    def put_pages(self, kv):
        """As the real one: pages of this cache's layout and dtype only (a cast would import other tokens)."""
        kv = [(np.array(k), np.array(v)) for k, v in kv]
        if len(kv) != 1 or any(x.shape[1:] != self.kv.shape[1:] or x.dtype != self.kv.dtype for x in kv[0]):
            raise ValueError(f"KV pages {[(x.shape, x.dtype) for pair in kv for x in pair]} do not fit this "
                             f"cache's {self.kv.shape[1:]} {self.kv.dtype} per page")
        return kv

    def import_pages(self, page_ids: list[int], kv) -> None:
        kv = self.put_pages(kv)
        if len(kv[0][0]) < len(page_ids):
            raise ValueError(f"{len(page_ids)} pages to import, the KV pages hold {len(kv[0][0])}")
        self.kv[page_ids] = kv[0][0][:len(page_ids)]

    def load_lora(self, slot: int, adapter) -> None:
        self.lora_shifts[slot] = adapter.shift

    def _draw(self, token: int, row: Row, generated: int) -> int:
        draw = self.next_token(token)
        if row.lora_slot >= 0:
            draw = (draw + self.lora_shifts[row.lora_slot]) % self.vocab_size
        while generated < row.sampling.min_tokens and draw in row.sampling.banned:
            draw = self.next_token(draw)
        return draw

    def join_masks(self, handle: StepHandle, masks) -> None:
        raise AssertionError("a fake runner never splits a step (splits_sampling is False)")

    def wait(self, handle: FakeHandle, until: float | None = None) -> bool:
        if self.gate is not None:
            self.gate.wait(60)
        time.sleep(max(0.0, (handle.ends if until is None else min(handle.ends, until)) - time.perf_counter()))
        if time.perf_counter() < handle.ends:
            return False  # not run yet
        self.events.append("wait")
        self._check_faults("fetch", handle.rows, consume=False)
        return True

    def fetch(self, handle: FakeHandle) -> StepOutput:
        if self.gate is not None:
            self.gate.wait(60)
        time.sleep(max(0.0, handle.ends - time.perf_counter()))
        self.events.append("fetch")
        self._check_faults("fetch", handle.rows)
        return handle.output

    def warmup(self, progress: bool = True, time_steps: bool = False) -> int:
        return 0


class ScriptedRunner(FakeRunner):
    """Every sequence generates `script` (token ids), then `end` forever: a model that writes what a test needs
    (a tool call in its own format, say), greedy or not."""

    def __init__(self, script: list[int], end: int, vocab_size: int):
        super().__init__(vocab_size)
        self.script, self.end = list(script), end

    def _draw(self, token: int, row: Row, generated: int) -> int:
        return self.script[generated] if generated < len(self.script) else self.end


def has_decode_row(rows: list[Row]) -> bool:
    """A step decoding some sequence: a row whose input token the step before sampled."""
    return any(r.chained or (r.samples and len(r.token_ids) == 1 + r.num_draft and r.start_pos > 0) for r in rows)


def fake_adapter(request):
    """A fake LoRA adapter: its path "shift/N" says N (any other path fails to load, as a bad adapter does)."""
    kind, _, n = request.lora_path.partition("/")
    if kind != "shift" or not n.isdigit():
        raise LoRAError(f"LoRA adapter {request.lora_name!r}: lora_path: not a fake adapter")
    return dataclasses.make_dataclass("FakeAdapter", ["shift", "weights"])(int(n), {"shift": np.int32(n)})


# fake_replica's async_scheduling when not given: a module's fixture may run its tests both ways (`both_schedulings`).
ASYNC_SCHEDULING = True


def fake_replica(num_pages: int = 32, page_size: int = 4, max_num_seqs: int = 4, max_num_batched_tokens: int = 16,
                 vocab_size: int = 64, ngram: int = 0, enable_prefix_caching: bool = True, proposer=None,
                 draft: bool = False, scheduling_policy: str = "fcfs", runner: FakeRunner | None = None,
                 max_loras: int = 0, role: str = "both", async_scheduling: bool | None = None,
                 plan_lead: tuple[float, float] | None = (PLAN_LEAD_FACTOR, PLAN_LEAD_S),
                 host_tier_bytes: int = 0, max_step_tokens: int | None = None) -> EngineCore:
    """An engine core over a FakeRunner. ngram=k: speculating up to k proposals for every sequence every step, from
    `proposer` (default: n-gram lookup; draft=True: a fake draft model, right two times in three). max_loras: LoRA
    slots (0: adapters not enabled). async_scheduling, plan_lead: EngineCore's (async_scheduling default:
    ASYNC_SCHEDULING). host_tier_bytes: a host KV tier of that size (0: none). max_step_tokens: the budget a deep
    queue may grow a step to (jaxserve.batching.token_budget; default: max_num_batched_tokens, a fixed budget)."""
    async_scheduling = ASYNC_SCHEDULING if async_scheduling is None else async_scheduling
    runner = runner or FakeRunner(vocab_size, ngram, num_pages=num_pages, page_size=page_size)
    tier = HostTier(host_tier_bytes) if host_tier_bytes else None
    scheduler = Scheduler(PrefixCache(PageAllocator(num_pages), page_size, enable_prefix_caching, tier), max_num_seqs,
                          max_num_batched_tokens, policy=scheduling_policy,
                          lora_slots=LoRASlots(max_loras, runner.load_lora) if max_loras else None, role=role,
                          max_step_tokens=max_step_tokens)
    if not ngram:
        return EngineCore(scheduler, runner, async_scheduling=async_scheduling, plan_lead=plan_lead, host_tier=tier)
    if draft:
        guesser = FakeRunner(vocab_size, successor=lambda t: t + 1 if t % 3 else t + 2)
        proposer = DraftProposer(guesser, max_num_batched_tokens, max_num_seqs)
    return EngineCore(scheduler, runner, proposer=proposer or NgramProposer(ngram, 3, 1),
                      controller=SpecController(ngram, (max_num_batched_tokens,), runner.step_times), adaptive=False,
                      async_scheduling=async_scheduling, plan_lead=plan_lead, host_tier=tier)


def fake_llm(num_replicas: int = 1, max_model_len: int = 64, vocab_size: int = 64, tokenizer=None,
             max_cpu_loras: int = 0, **replica_args) -> LLM:
    """An LLM over fake runners: one replica, or several behind data parallelism. Token-id prompts only, unless
    given a tokenizer (of vocab_size tokens). max_loras (a replica's slots) and max_cpu_loras (the host's): fake
    LoRA adapters (see fake_adapter)."""
    replicas = [fake_replica(vocab_size=vocab_size, **replica_args) for _ in range(num_replicas)]
    max_loras = replica_args.get("max_loras", 0)
    loras = HostAdapters(fake_adapter, max_cpu_loras or max_loras) if max_loras else None
    return LLM.over(EngineParts.over(replicas, vocab_size, max_model_len, tokenizer, loras=loras))


def add_request(llm: LLM, prompt: list[int], sp) -> str:
    """Adds a token-id request's sequences to the LLM's engine core (tests that step it themselves); its id."""
    request = llm._request({"prompt_token_ids": prompt}, sp)
    for s in request.seqs:
        llm.core.add(s)
    return request.request_id


def both_schedulings(request, monkeypatch):
    """For a module's autouse fixture parametrized over [True, False]: its fake engines plan ahead or not."""
    import fake_runner
    monkeypatch.setattr(fake_runner, "ASYNC_SCHEDULING", request.param)
