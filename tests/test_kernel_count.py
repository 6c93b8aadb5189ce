"""Kernel counts read from compiled modules (`jaxllm/benchmarks/kernel_count.py`)."""

import jax
import jax.numpy as jnp

from jaxllm.benchmarks.kernel_count import count, parse, thunks


def test_loops_count_their_body_per_trip():
    def f(x):
        y = jnp.sin(x) @ x
        return jax.lax.fori_loop(0, 7, lambda i, c: jnp.tanh(c @ x) + i, y)
    x = jnp.ones((16, 16), jnp.float32)
    hlo = jax.jit(f).lower(x).compile().as_text()
    entry = next(k for k in parse(hlo) if k.startswith("ENTRY "))
    assert any(op == "while" for _, op, _ in parse(hlo)[entry])
    c = count(hlo)
    once = count(jax.jit(lambda x: jnp.tanh((jnp.sin(x) @ x) @ x) + 1).lower(x).compile().as_text())
    # the loop's body runs 7 times: its kernels count 7 times, besides the loop's own bookkeeping
    assert sum(c.values()) >= 7 * max(1, sum(once.values()) - 2)
    assert not any(k.split()[0] in ("parameter", "constant", "tuple", "get-tuple-element") for k in c)


def test_custom_calls_are_named_by_jaxllm_kernel():
    text = ('ENTRY %main (p: f32[8]) -> f32[8] {\n'
            '  %p = f32[8]{0} parameter(0)\n'
            '  %mpmd_map.3 = f32[8]{0} custom-call(%p), custom_call_target="mosaic_gpu_v2", '
            'metadata={op_name="jit(step)/jaxllm_fp8_matmul/mpmd_map"}\n'
            '  ROOT %loop_add_fusion.2 = f32[8]{0} fusion(%mpmd_map.3), kind=kLoop, calls=%fused_add\n'
            '}\n')
    assert count(text) == {"custom-call mosaic_gpu_v2 jaxllm_fp8_matmul": 1, "fusion kLoop loop_add_fusion": 1}


def test_thunks_count_a_command_buffer_as_one_launch():
    text = """000: kCommandBuffer [source | next=003 (1)]
    001: kCustomKernel [source | next=002 (1)] loop_add_fusion grid: [1, 1, 1]
    002: kCustomKernel [prev=001 (1) | sink] loop_mul_fusion grid: [1, 1, 1]
003: kCustomCall    [prev=000 (1) | next=004 (1)] kCustomCall
004: kCustomKernel  [prev=003 (1) | sink] input_reduce_fusion grid: [1, 1, 1]
"""
    assert thunks(text) == {"launches": 3, "top": {"kCommandBuffer": 1, "kCustomCall": 1, "kCustomKernel": 1},
                            "in_graphs": {"kCustomKernel": 2}}


def test_bytes_written_by_family():
    text = ('ENTRY %main (p: bf16[2048,64]) -> f32[64] {\n'
            '  %p = bf16[2048,64]{1,0} parameter(0)\n'
            '  %loop_multiply_fusion.3 = bf16[2048,64]{1,0} fusion(%p), kind=kLoop, calls=%fm\n'
            '  %mpmd_map.1 = (f32[16,8]{1,0}, s32[4]{0}) custom-call(%p), custom_call_target="mosaic_gpu_v2"\n'
            '  ROOT %input_reduce_fusion = f32[64]{0} fusion(%loop_multiply_fusion.3), kind=kInput, calls=%fr\n'
            '}\n')
    assert count(text, weight="bytes") == {"fusion kLoop loop_multiply_fusion": 2048 * 64 * 2,
                                           "custom-call mosaic_gpu_v2": 16 * 8 * 4 + 4 * 4,
                                           "fusion kInput input_reduce_fusion": 64 * 4}
