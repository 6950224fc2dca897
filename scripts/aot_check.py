"""Compile every serving program for real TPU and GPU targets on a machine with neither (deviceless AOT).

For each model shape (no weights: abstract parameters) and target chip it compiles each token bucket's step
(forward + sampling) and cache write, and the Pallas ragged attention kernel alone, then prints whether each
compiled (or the compiler's error), its HBM use (arguments + outputs - donated + temporaries) against the chip's,
and on TPU the compiler's flop and byte counts. For the steps that can be all decode rows (as many tokens as rows)
it adds a roofline rate: rows / max(compiler flops / peak, (weights + the KV of `--context-len` tokens per row) /
HBM bandwidth). That is an estimate, not a measurement. The compiler's own byte count is not used for it: it
counts every operand whole, including the entire KV cache that goes to the attention kernel. Its time estimate is
not used either: it comes back negative for these programs.

    bash scripts/aot_env.sh     # libtpu and the CUDA plugin, in .aot-venv
    .aot-venv/bin/python scripts/aot_check.py --model smollm2-135m --model llama-3-8b --target v5e:2x2 \
        --target h100 --out aot.json

With --tensor-parallel-size N the steps compile over a mesh of N of the target's devices ("v5e:2x2": four TPU
chips, "h100:8": eight GPUs), as a tensor-parallel engine runs them; sizes are then per device, and each program's
collectives (all-reduce, all-gather, reduce-scatter, all-to-all, collective-permute, async forms included) are
listed and checked: an all-reduce per row-parallel layer (o_proj, down_proj) and one for the vocab-split embedding,
and nothing vocab-sized gathered (sampling exchanges per-row values only) and no weight or cache array moved whole.
`--model NAME@N` compiles that model at N instead, so one process (one compiler start) compiles several models at
several sizes: `--model llama-3-8b --model llama-3-8b@8 --model smollm2-135m@3 --target v5e:2x4`.

Every program's HBM audit (jaxserve.aot.hbm_audit) is in the "extra MB" column and the "HBM:" lines under it: each
instruction that writes a weight- or KV-cache-sized buffer the program did not have to (the cache relayouted for
the attention kernel, an int8 weight widened to a bf16 copy before its dot), with its bytes. --quantization int8
or int4 compiles the steps with quantized linear layers, to see the latter.
"""
from __future__ import annotations

import os

# Before jax is imported: compile-only GPUs need the CPU backend as the default and no CUDA install checks.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
# libtpu takes a lock file for its process: a parent that loaded it (any jax process where it is installed, pytest's
# included) would otherwise keep this one from compiling for TPU.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import argparse  # noqa: E402
import collections  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402

import jax.numpy as jnp  # noqa: E402

from jaxserve.aot import deviceless as aot  # noqa: E402
from jaxserve.aot.collectives import collective_problems  # noqa: E402
from jaxserve.aot.head_programs import HEAD_CONFIGS, abstract_head_params, head_for  # noqa: E402
from jaxserve.cache import bytes_per_page, pages_needed  # noqa: E402
from jaxserve.pallas_kernels import page_head_dim_multiple  # noqa: E402
from jaxserve.weights.params import param_bytes  # noqa: E402

SHOWN_TRAFFIC = 6  # a program's HBM audit lines printed (a relayout per layer repeats)


def lanes_of(target: str) -> int:
    """The head_dim multiple the target's Pallas kernel stores pages at."""
    return page_head_dim_multiple("pallas-" + aot.chip_of(target).platform)


def kv_pages(config, chip, weight_bytes, args, lanes: int = 1, tp: int = 1, head=None) -> int:
    """Pages from what the chip holds after the weights (90%, as LLM's default budget), within what the engine's
    sequences can use and never less than one max_model_len sequence (so the program still compiles and the table
    can say it does not fit). Tensor parallel: each chip holds 1/tp of the weights and of every page. head: an
    EAGLE-3 head's page and its tokens' captured features cost each page id too (as the engine's budget counts)."""
    page_size = 16 * args.decode_context_parallel_size  # the host's pages (DCP: 16 tokens a device)
    per_page = bytes_per_page(config, page_size, jnp.bfloat16, args.kv_cache_dtype, lanes) // tp
    if head is not None:  # the features are replicated: each chip holds them whole
        per_page += (bytes_per_page(head.layer_config(), page_size, jnp.bfloat16, args.kv_cache_dtype, lanes) // tp
                     + page_size * head.feature_size * 2)
    per_seq = pages_needed(args.max_model_len, page_size)
    budget = int(chip.hbm_bytes * 0.9) - weight_bytes // tp
    return max(per_seq + 1, min(budget // per_page, args.max_num_seqs * per_seq + 1))


def model_case(spec: str) -> tuple[str, int | None]:
    """"llama-3-8b" or "llama-3-8b@8" -> (name, tensor-parallel size or None: --tensor-parallel-size's)."""
    name, _, tp = spec.partition("@")
    if name not in aot.MODEL_CONFIGS or (tp and (not tp.isdigit() or int(tp) == 0)):
        raise argparse.ArgumentTypeError(f"{spec!r}: a model of {', '.join(aot.MODEL_CONFIGS)}, optionally @TP")
    return name, int(tp) if tp else None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", action="append", type=model_case,
                   help=f"repeatable; one of {', '.join(aot.MODEL_CONFIGS)}, or NAME@TP for that model at tensor "
                        "parallel size TP (instead of --tensor-parallel-size): one process compiles several")
    p.add_argument("--target", action="append", help=f"repeatable; e.g. {', '.join(aot.TARGETS)}")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "int8"))
    p.add_argument("--context-len", type=int, default=1024, help="tokens each decode row attends to, for the roofline")
    p.add_argument("--only-extremes", action="store_true",
                   help="of the token buckets, only the smallest, the largest all-decode one and the largest")
    p.add_argument("--kernel-only", action="store_true",
                   help="only the ragged attention kernel alone, at each token bucket (quick: its SMEM, VMEM or "
                        "shared memory and temporaries at long page tables)")
    p.add_argument("--num-speculative-tokens", type=int, default=0,
                   help="also compile the speculative verification step for k proposals a row")
    p.add_argument("--speculative", default=None, choices=("eagle3",),
                   help="also compile the model's public EAGLE-3 head's step (and cache write) at each bucket, with "
                        f"the target's steps capturing its features (heads of: {', '.join(HEAD_CONFIGS)})")
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="compile the steps over a mesh of this many of the target's devices (e.g. 4 on v5e:2x2, "
                        "8 on h100:8) and check their collectives")
    p.add_argument("--decode-context-parallel-size", type=int, default=1,
                   help="1 or the tensor-parallel size: the KV cache split over the mesh by token (no KV head copies)")
    p.add_argument("--num-layers", type=int, default=None,
                   help="only this many of the model's layers (the same programs per layer, compiled quicker)")
    p.add_argument("--quantization", default=None, choices=("int8", "int4"),
                   help="compile with the linear layers' weights quantized (jaxserve.model.quant), to see whether the "
                        "steps read them as such or widen them to bf16 copies first (the HBM audit says)")
    p.add_argument("--out", default=None, help="write the rows as JSON here")
    args = p.parse_args()
    rows = []
    for name, tp in args.model or [("smollm2-135m", None)]:
        tp = tp or args.tensor_parallel_size
        if args.decode_context_parallel_size not in (1, tp):
            raise SystemExit(f"--decode-context-parallel-size must be 1 or {name}'s tensor-parallel size {tp}")
        config = aot.MODEL_CONFIGS[name]
        if args.num_layers:
            config = aot.with_layers(config, args.num_layers)
        if tp > 1 and args.decode_context_parallel_size == 1:
            config = aot.tensor_parallel_config(config, tp)  # KV heads repeated where tp exceeds them
        params = aot.abstract_params(config, jnp.bfloat16, args.quantization)
        head = head_params = None
        if args.speculative:
            if name not in HEAD_CONFIGS:
                raise SystemExit(f"--speculative eagle3: no public head's shape for {name}; known: "
                                 f"{', '.join(HEAD_CONFIGS)}")
            head = head_for(name, config)
            head_params = abstract_head_params(head, jnp.bfloat16)
        # (the head's embedding is the target's: not counted twice)
        weight_bytes = param_bytes(params) + (param_bytes(head_params) - param_bytes(
            head_params["params"]["embed_tokens"]) if head else 0)
        for target in args.target or list(aot.TARGETS):
            chip = aot.chip_of(target)
            devices = aot.target_devices(target)
            if tp > len(devices):
                raise SystemExit(f"--tensor-parallel-size {tp} needs {tp} devices; {target} has {len(devices)}")
            device = devices[0]
            lanes = lanes_of(target)
            num_pages = kv_pages(config, chip, weight_bytes, args, lanes, tp, head)
            kv_per_token = bytes_per_page(config, 16, jnp.bfloat16, args.kv_cache_dtype, lanes) / 16
            start = time.perf_counter()
            results = aot.compile_serving(config, jnp.bfloat16, devices if tp > 1 else device,
                                          max_num_seqs=args.max_num_seqs,
                                          max_num_batched_tokens=args.max_num_batched_tokens,
                                          max_model_len=args.max_model_len, num_pages=num_pages,
                                          kv_cache_dtype=args.kv_cache_dtype, params=params,
                                          only_extremes=args.only_extremes,
                                          num_speculative_tokens=args.num_speculative_tokens,
                                          tensor_parallel_size=tp, kernel_only=args.kernel_only,
                                          decode_context_parallel_size=args.decode_context_parallel_size,
                                          page_size=16 * args.decode_context_parallel_size, head=head)
            split = (f" over {tp} devices (tensor parallel; sizes per device, weights "
                     f"{weight_bytes / tp / 1e9:.2f} GB each)") if tp > 1 else ""
            print(f"\n{name} ({config.num_layers} layers) on {target} ({device.device_kind}, "
                  f"{chip.hbm_bytes / 2**30:.0f} GiB HBM){split}: weights {weight_bytes / 1e9:.2f} GB, KV cache "
                  f"{num_pages} pages of 16 tokens, compiled in {time.perf_counter() - start:.0f} s")
            print(f"  {'program':<16} {'shape':<24} {'result':<9} {'peak GB':>8} {'temp MB':>8} {'fits':>5} "
                  f"{'GFLOP':>8} {'GB read':>8} {'roofline tok/s':>15} {'extra MB':>9}")
            for r in results:
                row = {"model": name, "tp": tp, "quantization": args.quantization, "target": target,
                       "num_layers": config.num_layers, "num_pages": num_pages, "weight_bytes": weight_bytes,
                       **dataclasses.asdict(r), "peak_bytes": r.peak_bytes, "fits": r.peak_bytes <= chip.hbm_bytes}
                rate = ""
                tokens, _, _, batch, _ = r.shape.split()  # "64 tokens x 64 rows"
                batch = int(batch)
                if r.flops and r.program == "step" and int(tokens) == batch:
                    read = (weight_bytes + batch * args.context_len * kv_per_token) / tp
                    row["roofline_tokens_per_s"] = batch / max(r.flops / chip.peak_flops, read / chip.hbm_bandwidth)
                    rate = f"{row['roofline_tokens_per_s']:.0f}"
                rows.append(row)
                result = "ERROR" if r.error else "compiled"
                counts = (f"{r.flops / 1e9:8.1f} {r.bytes_accessed / 1e9:8.2f}" if r.flops else f"{'':8} {'':8}")
                print(f"  {r.program:<16} {r.shape:<24} {result:<9} {r.peak_bytes / 1e9:8.2f} "
                      f"{r.temp_bytes / 1e6:8.1f} {'yes' if row['fits'] else 'NO':>5} {counts} {rate:>15} "
                      f"{r.traffic_bytes / 1e6:9.1f}")
                if r.error:
                    print(f"    {r.error}")
                for t in r.traffic[:SHOWN_TRAFFIC]:
                    print(f"    HBM: {t}")
                if len(r.traffic) > SHOWN_TRAFFIC:
                    print(f"    HBM: ... {len(r.traffic) - SHOWN_TRAFFIC} more (--out has them all)")
                if tp > 1 and r.program != "ragged attention":  # (DCP's own: tests/aot/test_aot_dcp.py)
                    # A head's program: its one layer's (the target's vocabulary, which its proposals are drawn from).
                    of_head = r.program.startswith("head")
                    row["collective_problems"] = [] if args.decode_context_parallel_size > 1 else collective_problems(
                        r, head.layer_config() if of_head else config, head_params if of_head else params,
                        num_pages, kv_cache_dtype=args.kv_cache_dtype,
                        num_speculative_tokens=args.num_speculative_tokens, head_dim_multiple=lanes,
                        draft_vocab_size=head.draft_vocab_size if of_head else 0,
                        feature_size=head.feature_size if of_head else 0)
                    ops = collections.Counter(r.collective_ops)
                    print("    collectives: " + (", ".join(f"{n} x {op}" for op, n in ops.items()) or "none")
                          + f"; largest all-gather {r.largest_all_gather_bytes / 1e6:.2f} MB")
                    for problem in row["collective_problems"]:
                        print(f"    UNEXPECTED: {problem}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)
    failed = [r for r in rows if r["error"] or r.get("collective_problems")]
    unexpected = sum(bool(r.get("collective_problems")) for r in rows)
    print(f"\n{sum(not r['error'] for r in rows)} of {len(rows)} programs compiled"
          + (f"; {unexpected} with unexpected collectives" if any(r["tensor_parallel_size"] > 1 for r in rows)
             else "")
          + f"; {sum(bool(r['traffic']) for r in rows)} with extra HBM traffic (weight- or cache-sized copies)")
    raise SystemExit(1 if failed else 0)


if __name__ == "__main__":
    main()
