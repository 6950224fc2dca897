"""scripts/simulate_pd.py's simulation (against hand computations and invariants) and bench_pd's figures (its
percentiles and goodput on fixed timings)."""
import sys

import pytest

from locations import SCRIPTS

sys.path.insert(0, str(SCRIPTS))
import bench_serving  # noqa: E402
import simulate_pd as sim  # noqa: E402


class LinearCosts:
    """1 s a step plus 10 ms a token, no buckets: steps easy to add up by hand."""
    token_buckets = None

    def seconds(self, decode, chunks):
        return 1.0 + 0.01 * (len(decode) + sum(n for _, n in chunks))


def measured_like():
    """A StepCosts shaped like this machine's: decode rows cost their context, long chunks their prefix."""
    return sim.StepCosts({1: 0.03, 4: 0.04, 8: 0.05, 16: 0.07, 32: 0.1, 64: 0.15, 128: 0.25, 256: 0.45, 512: 0.8},
                         1e-6, 2e-7, 64)


def test_a_single_replica_colocated_matches_a_hand_computation():
    # A (t=0, prompt 10, 3 tokens): step 1 = its prompt (1.1 s): first token at 1.1. B arrives at 0.5 and waits.
    # Step 2 (A decodes, B's 20-token prompt): 1.21 s, ends 2.31: A's 2nd token, B's first. Step 3 (both decode):
    # 1.02 s, ends 3.33: A's 3rd token (done), B's 2nd (done).
    a, b = sim.simulate(sim.Setup("c", LinearCosts()), [(0.0, 10, 3), (0.5, 20, 2)])
    assert a.ttft == pytest.approx(1.1) and a.tpot == pytest.approx((3.33 - 1.1) / 2)
    assert b.ttft == pytest.approx(2.31 - 0.5) and b.tpot == pytest.approx(3.33 - 2.31)


def test_at_zero_load_ttft_is_one_prefill_step_and_tpot_one_decode_step():
    costs = measured_like()
    setup = sim.Setup("c", costs)
    (seq,) = sim.simulate(setup, [(0.0, 200, 5)])
    assert seq.ttft == pytest.approx(costs.seconds([], [(0, 200)]))
    # decode steps at contexts 200..203: the same bucket and key blocks, so equal
    assert seq.tpot == pytest.approx(costs.seconds([200], []))
    # disaggregated: TTFT gains the router's hop only; the KV transfer delays the second token
    d = sim.Setup("d", costs, prefill=1, decode=1, kv_bytes_per_token=1000, kv_bytes_per_s=1e6, kv_fixed_s=0.01,
                  hop_s=0.002)
    (seq_d,) = sim.simulate(d, [(0.0, 200, 5)])
    assert seq_d.ttft == pytest.approx(seq.ttft + 0.002)
    assert seq_d.tpot == pytest.approx(seq.tpot + (0.01 + 0.2) / 4)
    # each side's own copy of the pages (200 tokens of 1000 bytes at 1 MB/s: 0.2 s) delays the second token too
    copy = sim.Setup("d", costs, prefill=1, decode=1, kv_bytes_per_token=1000, kv_bytes_per_s=1e6, kv_fixed_s=0.01,
                     hop_s=0.002, kv_copy_bytes_per_s=1e6)
    (seq_c,) = sim.simulate(copy, [(0.0, 200, 5)])
    assert seq_c.ttft == pytest.approx(seq_d.ttft) and seq_c.tpot == pytest.approx(seq_d.tpot + 0.4 / 4)


def test_a_prompt_over_the_budget_takes_several_chunk_steps():
    costs = measured_like()
    (seq,) = sim.simulate(sim.Setup("c", costs), [(0.0, 1088, 2)])
    assert seq.ttft == pytest.approx(costs.seconds([], [(0, 512)]) + costs.seconds([], [(512, 512)])
                                     + costs.seconds([], [(1024, 64)]))


def trace():
    return sim.trace(40, 0, 3.0, (300, 100, 500), (30, 10, 60))


def test_more_decode_replicas_never_lower_goodput_at_a_fixed_load():
    costs = measured_like()
    goodput = [sim.summarize(sim.simulate(sim.Setup("d", costs, prefill=1, decode=d, max_num_seqs=8), trace()),
                             5.0, 0.1)["goodput"]["requests_per_s"] for d in (1, 2, 3, 4)]
    assert goodput == sorted(goodput) and goodput[-1] > goodput[0]


def test_short_of_pages_a_replica_preempts_and_recomputes_and_returns_every_page():
    setup = sim.Setup("c", measured_like(), num_pages=60)  # 960 tokens: a few sequences at a time
    front, back = setup.replicas()
    seqs = sim.simulate(setup, trace(), (front, back))
    assert all(s.finish is not None and s.generated == s.output for s in seqs)
    assert front[0].preemptions > 0
    assert front[0].free_pages == 60 and not front[0].running and not front[0].waiting
    d = sim.Setup("d", measured_like(), prefill=2, decode=1, num_pages=60)
    front, back = d.replicas()
    sim.simulate(d, trace(), (front, back))
    assert [r.free_pages for r in front + back] == [60, 60, 60]


def test_attention_work_follows_the_cpu_kernels_layout():
    buckets = (1, 4, 8, 16, 32, 64, 128, 256, 512)
    # 3 decode rows (<= 64 tokens: one group of the bucket's 4 tokens, walking the longest row's 2 key blocks)
    assert sim.attention_work([100, 200, 50], [], buckets, 64) == {"bucket": 4, "group_reads": 4 * 256,
                                                                   "long_reads": 0}
    # 16 decodes + a 496-token chunk after 512 cached: the chunk is the long row (its cache read against all 512
    # tokens); the 64 longest-cached tokens (the decodes first) walk 1024 keys, the rest none
    w = sim.attention_work([1000] * 16, [(512, 496)], buckets, 64)
    assert w == {"bucket": 512, "group_reads": 64 * 1024, "long_reads": 512 * 512}
    costs = measured_like()
    assert costs.seconds([1000] * 16, [(512, 496)]) == pytest.approx(0.8 + 1e-6 * 64 * 1024 + 2e-7 * 512 * 512)


def test_roofline_decode_is_bandwidth_bound_and_prefill_compute_bound():
    c = sim.RooflineCosts(sim.ACCELERATORS["h100"], sim.LLAMA3_8B, overhead_s=0.0)
    m = sim.LLAMA3_8B
    assert c.seconds([0], []) == pytest.approx((m.weight_bytes + m.kv_bytes_per_token) / (3.35e12 * 0.8))
    flops = 2 * m.matmul_params * 1024 + 4 * 32 * 32 * 128 * (1024 * 1025 / 2)
    assert c.seconds([], [(0, 1024)]) == pytest.approx(flops / (989e12 * 0.5))
    assert sim.RooflineCosts(sim.ACCELERATORS["h100"], m, devices=2, overhead_s=0.0).seconds([], [(0, 1024)]) == \
        pytest.approx(c.seconds([], [(0, 1024)]) / 2)


def test_compare_flags_figures_outside_the_tolerance():
    rows = [{"setup": "colocated", "request_rate": 0.1, "ttft_s": {"p50": 1.1, "p95": 2.0}, "tpot_s": {"p50": 0.1},
             "goodput": {"requests_per_s": 0.05}}]
    measured = {"runs": [{"setup": "colocated", "request_rate": 0.1, "ttft_s": {"p50": 1.0, "p95": 3.0},
                          "tpot_s": {"p50": 0.1}, "goodput": {"requests_per_s": 0.05}}]}
    got = {c["figure"]: c["within"] for c in sim.compare(rows, measured, 0.2)}
    assert got == {"ttft_s p50": True, "ttft_s p95": False, "tpot_s p50": True, "goodput requests_per_s": True}


def test_bench_percentiles_and_goodput_on_fixed_timings():
    results = []
    for i, (ttft, e2e, out) in enumerate([(1.0, 11.0, 101), (2.0, 22.0, 101), (3.0, 13.0, 11), (4.0, 44.0, 101),
                                          (5.0, 10.0, 51)]):
        results.append(bench_serving.Result(ok=True, sent=float(i), ttft=ttft, e2e=e2e, output_tokens=out,
                                            max_tokens=out, usage_tokens=True))
    results.append(bench_serving.Result(ok=False, error="HTTP 500", max_tokens=5))
    # TPOTs: 0.1, 0.2, 1.0, 0.4, 0.1
    row = bench_serving.summarize({"request_rate": 1.0}, results, 50.0, 4.0, 0.25, [10] * 6)
    assert row["ttft_s"] == {"p50": 3.0, "p95": 4.8, "p99": 4.96}
    assert row["tpot_s"] == {"p50": 0.2, "p95": 0.88, "p99": 0.976}
    assert row["completed"] == 5 and row["failed"] == 1 and row["requests_per_s"] == 0.1
    # met both: #0 (1 s, 0.1) and #1 (2 s, 0.2); #2 misses TPOT, #3 both, #4 TTFT
    assert row["goodput"] == {"requests_per_s": 0.04, "fraction": round(2 / 6, 3), "ttft_slo_s": 4.0,
                              "tpot_slo_s": 0.25}
