"""scripts/trace_stats.py: the per-step GPU figures read from a profiler trace (synthetic events)."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "scripts"))

from trace_stats import family_of, kind_of, summarize  # noqa: E402


def _meta(pid, name, tid=None):
    e = {"ph": "M", "pid": pid, "name": "thread_name" if tid is not None else "process_name",
         "args": {"name": name}}
    if tid is not None:
        e["tid"] = tid
    return e


def _x(pid, tid, ts, dur, name):
    return {"ph": "X", "pid": pid, "tid": tid, "ts": ts, "dur": dur, "name": name}


def events():
    gpu, host = 1, 2
    return [
        _meta(gpu, "/device:GPU:0"), _meta(host, "/host:CPU"),
        _meta(gpu, "Stream #13(Compute)", tid=13), _meta(gpu, "Stream #14(Compute)", tid=14),
        _meta(gpu, "XLA Ops", tid=99), _meta(host, "python", tid=5),
        # two steps: kernels on two streams, partly overlapping (busy counts the overlap once)
        _x(gpu, 13, 0, 100, "gemm_fusion_dot_1"), _x(gpu, 14, 50, 100, "ncclDevKernel_AllReduce_Sum"),
        _x(gpu, 13, 300, 200, "anonymous_mosaic_gpu_kernel"), _x(gpu, 13, 600, 50, "loop_add_fusion"),
        _x(gpu, 99, 0, 650, "XLA Ops restate the kernels"),  # must not be counted
        _x(host, 5, 0, 400, "PjitFunction(_step_flat)"), _x(host, 5, 0, 900, "$llm_engine.py:1 step"),
        _x(host, 5, 0, 10, "some C++ span"),
    ]


def test_summary_per_step():
    s = summarize(events(), steps=2, wall_s=0.002)
    assert s["wall_s"] == pytest.approx(0.001)
    (dev,) = s["per_device"]
    assert dev["kernels_per_step"] == 2
    assert dev["busy_s"] == pytest.approx((150 + 200 + 50) * 1e-6 / 2)  # 0-150 union, 300-500, 600-650
    assert dev["span_s"] == pytest.approx(650e-6 / 2)
    assert dev["by_kind_s"] == pytest.approx({"attention": 100e-6, "collective": 50e-6,
                                              "matmul": 50e-6, "other": 25e-6})
    assert set(s["host_top_s"]) == {"PjitFunction(_step_flat)", "$llm_engine.py:1 step"}
    assert dev["families"]["gemm_fusion_dot"] == pytest.approx((0.5, 50e-6))


def test_families_drop_numbering():
    assert family_of("loop_add_fusion_12") == "loop_add_fusion"
    assert family_of("fusion.3") == "fusion" and family_of("input_transpose_fusion_31") == "input_transpose_fusion"
    assert family_of("nvjet_sm90_qqsss_128x16_128x11_2x1_v_bz_TNT") == "nvjet_sm90_qqsss_128x16_128x11_2x1_v_bz_TNT"
    assert family_of("jaxllm_act_quant__1") == "jaxllm_act_quant_"


def test_kinds():
    assert kind_of("ncclDevKernel_AllGather_RING_LL") == "collective"
    assert kind_of("all-reduce-start.3") == "collective"
    assert kind_of("gemm_fusion_dot_546") == "matmul"
    assert kind_of("anonymous_mosaic_gpu_kernel") == "attention"
    # jaxllm's own Mosaic / Pallas matmuls (session 25's profiles counted them as attention)
    for name in ("jaxllm_fp8_matmul_mosaic_gpu_kernel", "jaxllm_fp8_gemm_mosaic_gpu_kernel",
                 "jaxllm_int_matmul_mosaic_gpu_kernel",
                 "jaxllm_moe_gmm_mosaic_gpu_kernel", "jaxllm_moe_decode_gmm", "jaxllm_qmatmul"):
        assert kind_of(name) == "matmul", name
    assert kind_of("jaxllm_ragged_paged_attention") == "attention"
    assert kind_of("input_reduce_fusion_82") == "other"
    assert kind_of("sort_3") == "routing"
    assert kind_of("input_scatter_fusion_2") == "routing"
    assert kind_of("loop_gather_fusion_7") == "routing"
    assert kind_of("all-gather-start") == "collective"  # collectives first


def test_no_trace_is_reported_not_raised(tmp_path):
    from trace_stats import load_events

    with pytest.raises(FileNotFoundError):
        load_events(str(tmp_path))


def test_print_summary_lists_top_kernels(capsys):
    from trace_stats import print_summary

    s = summarize(events(), steps=2, wall_s=0.002)
    print_summary(s, top=2)
    lines = capsys.readouterr().out.splitlines()
    assert "4 kernels" not in lines[0] and "2 kernels" in lines[0]
    assert len(lines) == 4
    assert lines[1].split()[-1] == "anonymous_mosaic_gpu_kernel" and "0.100 ms" in lines[1]
    assert lines[3].startswith("    kernels a step by family: ") and lines[3].count("(") == 2
