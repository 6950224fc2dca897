"""The HBM audit's reading of HLO text (jaxserve.aot.hbm_audit), on small hand-written programs shaped like what the TPU
and GPU compilers print: what it lists (relayouts, copies, transposes, converts, weight-sized fusions, slices of the
cache) and what it must not (the attention kernel, in-place updates, views, TPU VMEM prefetches, fused insides).
The real compilers' programs are audited in tests/aot/test_aot.py."""
import jax
import jax.numpy as jnp
import pytest

from jaxserve.aot.hbm_audit import Buffer, audit, buffers, parse

# A weight [64, 32] (2048 elements) and a page array [16, 4, 2, 8] (1024 elements, 2 KB in bf16).
BUFFERS = [Buffer("layers_0/q_proj/kernel", (64, 32), 64 * 32 * 2),
           Buffer("KV cache pages", (16, 4, 2, 8), 2048, True)]
Q_PROJ = "params[\\'params\\'][\\'layers_0\\'][\\'q_proj\\'][\\'kernel\\']"  # as the compilers print it
PARAMS = f"""
  %w = bf16[64,32]{{1,0}} parameter(0), metadata={{op_name="{Q_PROJ}"}}
  %q8 = s8[64,32]{{1,0}} parameter(3), metadata={{op_name="{Q_PROJ}.values"}}
  %k = bf16[16,4,2,8]{{0,3,2,1:T(8,128)(2,1)}} parameter(1), metadata={{op_name="kv_cache[0][0]"}}
  %x = bf16[4,64]{{1,0}} parameter(2)
"""


def program(body: str, extra: str = "") -> str:
    """An HLO module: `extra` computations, then an entry with the parameters above and `body`."""
    return (f"HloModule test, is_scheduled=true\n\n{extra}\n"
            f"ENTRY %main (w: bf16[64,32]) -> bf16[4,32] {{{PARAMS}{body}}}\n")


FUSED_DOT = """
%fused_dot (param_0: bf16[4,64], param_1: s8[64,32]) -> bf16[4,32] {
  %param_0 = bf16[4,64]{1,0} parameter(0)
  %param_1 = s8[64,32]{1,0} parameter(1)
  %convert.1 = bf16[64,32]{1,0} convert(%param_1)
  %copy.9 = bf16[64,32]{0,1} copy(%convert.1)
  ROOT %dot.1 = bf16[4,32]{1,0} dot(%param_0, %copy.9), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}
%fused_convert (param_0.1: s8[64,32]) -> bf16[64,32] {
  %param_0.1 = s8[64,32]{1,0} parameter(0)
  ROOT %convert.2 = bf16[64,32]{1,0} convert(%param_0.1)
}
%fused_scatter (p0: bf16[16,4,2,8], p1: s32[4], p2: bf16[4,2,8]) -> bf16[16,4,2,8] {
  %p0 = bf16[16,4,2,8]{3,2,1,0} parameter(0)
  %p1 = s32[4]{0} parameter(1)
  %p2 = bf16[4,2,8]{2,1,0} parameter(2)
  ROOT %scatter.1 = bf16[16,4,2,8]{3,2,1,0} scatter(%p0, %p1, %p2), update_window_dims={1,2}, to_apply=%add
}
%body (t: (s32[], bf16[64,32])) -> (s32[], bf16[64,32]) {
  %t = (s32[], bf16[64,32]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %v = bf16[64,32]{1,0} get-tuple-element(%t), index=1
  %copy.7 = bf16[64,32]{1,0} copy(%v)
  ROOT %tuple.7 = (s32[], bf16[64,32]{1,0}) tuple(%i, %copy.7)
}
"""


def test_a_relayout_of_the_cache_is_listed_with_both_layouts():
    hlo = program("""  %copy.16 = bf16[16,4,2,8]{3,2,1,0:T(4,128)(2,1)} copy(%k), sharding={replicated}
  ROOT %r = bf16[4,32]{1,0} custom-call(%x, %copy.16), custom_call_target="tpu_custom_call"
""")
    [t] = audit(hlo, BUFFERS)
    assert (t.kind, t.of, t.instruction, t.bytes) == ("relayout", "KV cache pages", "copy.16", 2048)
    assert t.array.placement == "3,2,1,0:T(4,128)(2,1)" and t.source == "bf16[16,4,2,8]{0,3,2,1:T(8,128)(2,1)}"
    assert "relayout of KV cache pages: copy.16" in str(t)


def test_copies_transposes_converts_and_weight_sized_fusions_are_listed():
    hlo = program("""  %copy.1 = bf16[64,32]{1,0} copy(%w)
  %transpose.1 = bf16[32,64]{1,0} transpose(%w), dimensions={1,0}
  %convert.3 = bf16[64,32]{1,0} convert(%q8)
  %fusion.2 = bf16[64,32]{1,0} fusion(%q8), kind=kLoop, calls=%fused_convert
  %bitcast-convert.1 = s16[64,32]{1,0} bitcast-convert(%w)
  %while.1 = (s32[], bf16[64,32]{1,0}) while(%tuple.0), condition=%cond, body=%body
  ROOT %r = bf16[4,32]{1,0} fusion(%x, %q8), kind=kOutput, calls=%fused_dot
""", FUSED_DOT)
    found = {t.instruction: (t.kind, t.of) for t in audit(hlo, BUFFERS)}
    q = "layers_0/q_proj/kernel"
    assert found == {"copy.1": ("copy", q), "transpose.1": ("transpose", q), "convert.3": ("convert", q),
                     "fusion.2": ("fusion (convert)", q), "bitcast-convert.1": ("bitcast-convert", q),
                     "copy.7": ("copy", q)}  # in a loop body too
    # (the int8 weight widened inside the dot's fusion, %fused_dot, is what should happen: not listed)


def test_an_activation_of_a_weights_size_but_not_its_shape_is_not_listed():
    """A GEMM's output with as many elements as a weight ([8, 256] beside the [64, 32] one), made from smaller
    arrays: no weight was copied (the audit matches reshaped copies by size, so it must also read that size)."""
    hlo = program("""  %dot.5 = bf16[8,256]{1,0} dot(%x, %x), lhs_contracting_dims={0}, rhs_contracting_dims={0}
  %copy.5 = bf16[32,64]{1,0} copy(%w)
  ROOT %r = bf16[4,32]{1,0} fusion(%x, %q8), kind=kOutput, calls=%fused_dot
""", FUSED_DOT)
    assert [(t.instruction, t.of) for t in audit(hlo, BUFFERS)] == [("copy.5", "layers_0/q_proj/kernel")]


def test_the_kernel_in_place_updates_views_and_vmem_prefetches_are_not_listed():
    hlo = program("""  %bitcast.1 = bf16[128,8]{1,0} bitcast(%k)
  %wt = bf16[64,32]{1,0:T(8,128)(2,1)} parameter(4)
  %copy-start = (bf16[64,32]{1,0:T(8,128)(2,1)S(1)}, bf16[64,32]{1,0:T(8,128)(2,1)}, u32[]{:S(2)}) copy-start(%wt)
  %copy-done = bf16[64,32]{1,0:T(8,128)(2,1)S(1)} copy-done(%copy-start)
  %input_scatter_fusion = bf16[16,4,2,8]{3,2,1,0} fusion(%k, %i, %u), kind=kInput, calls=%fused_scatter
  %dynamic-update-slice.1 = bf16[16,4,2,8]{3,2,1,0} dynamic-update-slice(%k, %u, %i, %i, %i, %i)
  %attention = bf16[4,32]{1,0} custom-call(%x, %k), custom_call_target="__gpu$xla.gpu.triton"
  %all-gather.1 = bf16[64,32]{1,0} all-gather(%w), dimensions={0}
  ROOT %r = bf16[4,32]{1,0} fusion(%x, %q8), kind=kOutput, calls=%fused_dot
""", FUSED_DOT)
    assert audit(hlo, BUFFERS) == []


def test_the_cache_moved_into_vmem_is_listed():
    """Unlike a weight's prefetch, the whole cache moved on chip is read whole (the kernel reads only its rows'
    pages); a relayout out of HBM is one wherever it writes; one from VMEM to VMEM (copy.19) moves no HBM bytes."""
    pages = "bf16[16,4,2,8]{0,3,2,1:T(8,128)(2,1)"
    hlo = program(f"  %copy-start.3 = ({pages}S(1)}}, {pages}}}, u32[]{{:S(2)}}) copy-start(%k)\n" + """\
  %copy.17 = bf16[16,4,2,8]{3,2,1,0:T(4,128)(2,1)S(1)} copy(%k)
  %copy.18 = bf16[64,32]{0,1:T(8,128)(2,1)S(1)} copy(%w)
  %copy.19 = bf16[64,32]{1,0:T(8,128)(2,1)S(1)} copy(%copy.18)
  ROOT %r = bf16[4,32]{1,0} fusion(%x, %q8), kind=kOutput, calls=%fused_dot
""", FUSED_DOT)
    found = [(t.kind, t.instruction, t.of) for t in audit(hlo, BUFFERS)]
    assert found == [("copy", "copy-start.3", "KV cache pages"), ("relayout", "copy.17", "KV cache pages"),
                     ("relayout", "copy.18", "layers_0/q_proj/kernel")]


def test_the_embedding_table_moved_into_vmem_is_listed():
    """A lookup reads its tokens' rows: the table moved whole into VMEM (XLA:TPU's cross-program prefetch, at the
    program's start and again at its end for the next run) is read whole, where a dot's weight moved so is that
    dot's own read."""
    table = Buffer("embed_tokens", (128, 32), 128 * 32 * 2, is_table=True)
    rows, weight = "bf16[128,32]{1,0:T(8,128)(2,1)", "bf16[64,32]{1,0:T(8,128)(2,1)"
    hlo = program(f"""  %t = {rows}}} parameter(4), metadata={{op_name="params[\\'params\\'][\\'embed_tokens\\']"}}
  %copy-start.5 = ({rows}S(1)}}, {rows}}}, u32[]{{:S(2)}}) copy-start(%t), cross_program_prefetch_index=0
  %copy-done.5 = {rows}S(1)}} copy-done(%copy-start.5)
  %wt = {weight}}} parameter(5)
  %copy-start.6 = ({weight}S(1)}}, {weight}}}, u32[]{{:S(2)}}) copy-start(%wt)
  ROOT %r = bf16[4,32]{{1,0}} fusion(%x, %q8), kind=kOutput, calls=%fused_dot
""", FUSED_DOT)
    assert [(t.kind, t.instruction, t.of) for t in audit(hlo, BUFFERS + [table])] == [
        ("copy", "copy-start.5", "params/embed_tokens")]


def test_a_slice_of_the_cache_counts_from_the_threshold():
    """Part of a page array written elsewhere in HBM (half of it here) is listed when it is at least the threshold
    (by default the smallest buffer: the pages' 2 KB), and named after what it reads."""
    hlo = program("""  %slice-start.1 = ((bf16[16,4,2,8]{3,2,1,0}), bf16[8,4,2,8]{3,2,1,0}, s32[]) slice-start(%k)
  %slice.2 = bf16[8,4,2,8]{3,2,1,0} slice(%k), slice={[8:16]}
  ROOT %r = bf16[4,32]{1,0} fusion(%x, %q8), kind=kOutput, calls=%fused_dot
""", FUSED_DOT)
    assert audit(hlo, BUFFERS) == []
    found = audit(hlo, BUFFERS, threshold=1024)
    assert [(t.kind, t.of, t.bytes) for t in found] == [("slice", "KV cache pages", 1024)] * 2


def test_each_output_of_a_multi_output_fusion_is_named_after_its_argument():
    weights = [Buffer("layers_0/k_proj/kernel", (64, 32), 4096), Buffer("layers_0/v_proj/kernel", (64, 32), 4096)]
    hlo = program("""  %kk = bf16[64,32]{1,0} parameter(4), metadata={op_name="K"}
  %vv = bf16[64,32]{1,0} parameter(5), metadata={op_name="V"}
  %loop_multiply_fusion = (bf16[64,32]{1,0}, bf16[64,32]{1,0}) fusion(%kk, %x, %vv), kind=kLoop, calls=%fused_m
  ROOT %r = bf16[4,32]{1,0} fusion(%x, %q8), kind=kOutput, calls=%fused_dot
""", FUSED_DOT + """
%fused_m (a: bf16[64,32], b: bf16[4,64], c: bf16[64,32]) -> (bf16[64,32], bf16[64,32]) {
  %a = bf16[64,32]{1,0} parameter(0)
  %c = bf16[64,32]{1,0} parameter(2)
  ROOT %tuple.3 = (bf16[64,32]{1,0}, bf16[64,32]{1,0}) tuple(%a, %c)
}
""").replace('"K"', f'"{Q_PROJ.replace("q_proj", "k_proj")}"').replace('"V"', f'"{Q_PROJ.replace("q_proj", "v_proj")}"')
    assert [(t.kind, t.of) for t in audit(hlo, weights)] == [("fusion", "layers_0/k_proj/kernel"),
                                                            ("fusion", "layers_0/v_proj/kernel")]


def test_the_parser_finds_computations_operands_and_roots():
    computations, entry = parse(program("  ROOT %r = bf16[4,32]{1,0} fusion(%x, %q8), kind=kOutput, calls=%fused_dot\n",
                                        FUSED_DOT))
    assert entry == "main" and {"fused_dot", "fused_convert", "fused_scatter", "body", "main"} <= set(computations)
    root = next(i for i in computations["main"] if i.is_root)
    assert (root.op, root.operands, root.calls) == ("fusion", ("x", "q8"), ("fused_dot",))
    k = next(i for i in computations["main"] if i.name == "k")
    assert k.outputs[0].memory_space == "0" and k.outputs[0].bytes == 2048 and k.op_name == "kv_cache[0][0]"


@pytest.mark.parametrize("quantization", [None, "int8", "int4"])
def test_buffers_are_the_weight_matrices_and_pages_per_device(quantization):
    """Norms and quantization scales are not weights; a packed int4 weight also counts unpacked (what a widened
    copy of it would be); over a mesh, each device's shard."""
    from jaxserve.aot import deviceless as aot
    from jaxserve.config import ModelConfig
    config = ModelConfig("LlamaForCausalLM", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1,
                         num_heads=4, num_kv_heads=2, head_dim=8, rope_theta=10000.0, max_position_embeddings=64)
    params = aot.abstract_params(config, jnp.bfloat16, quantization)
    found = {b.name: b for b in buffers(params)}
    kernel = {None: "layers_0/q_proj/kernel", "int8": "layers_0/q_proj/kernel/values",
              "int4": "layers_0/q_proj/kernel/packed"}[quantization]
    assert found[kernel].dims == {"int4": (16, 32)}.get(quantization, (32, 32))
    assert not any("norm" in n or n.endswith(("scale", "offset")) for n in found)
    if quantization == "int4":
        assert found["layers_0/q_proj/kernel (unpacked)"].dims == (32, 32)
    mesh = jax.sharding.Mesh(jax.devices()[:1], ("model",))
    pages = jax.ShapeDtypeStruct((16, 4, 2, 8), jnp.bfloat16,
                                 sharding=jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
    assert buffers([pages], cache=True) == [Buffer("KV cache pages", (16, 4, 2, 8), 2048, True)]
    assert [b.name for b in buffers(params) if b.is_table] == ["embed_tokens"]
