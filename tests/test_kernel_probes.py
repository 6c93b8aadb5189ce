"""Start-up probes of the router and rope_write kernels (engine/kernel_probes.py): pass where the
kernel agrees with the model's XLA path (here in Pallas' interpreter), fail with a warning where
it raises or returns something else, so the runner keeps XLA's path."""

from __future__ import annotations

import dataclasses
import logging

import jax.numpy as jnp

from jaxllm.engine import kernel_probes
from jaxllm.kernels import moe_router, rope_write


def _cfg(moe: bool):
    from hf_tiny import make

    from jaxllm.models import registry

    _, hf, _ = make("qwen3_moe" if moe else "qwen3")
    return registry.config_from_hf(hf)


def test_probes_pass_on_the_kernels(monkeypatch):
    assert kernel_probes.rope_write_ok(_cfg(False), jnp.float32, page_size=16)
    assert kernel_probes.router_ok(_cfg(True), jnp.bfloat16)
    calls = []
    real = moe_router.route_tokens
    monkeypatch.setattr(moe_router, "route_tokens", lambda *a, **kw: calls.append(kw["splits"]) or real(*a, **kw))
    monkeypatch.setenv("JAXLLM_MOE_ROUTER", "split")  # the split form is what the probe runs
    monkeypatch.setattr(moe_router, "default_splits", lambda H, E: 2)  # hidden 64: two shares of 32
    assert kernel_probes.router_ok(_cfg(True), jnp.bfloat16)
    assert calls == [2]


def test_probes_fail_on_wrong_or_raising_kernels(monkeypatch, caplog):
    caplog.set_level(logging.WARNING, "jaxllm")
    real = moe_router.route_tokens

    def reversed_ids(*a, **k):  # the ids in the wrong order
        w, i, h = real(*a, **k)
        return w, i[:, ::-1], h
    monkeypatch.setattr(moe_router, "route_tokens", reversed_ids)
    assert not kernel_probes.router_ok(_cfg(True), jnp.float32)
    assert "router kernel disagrees" in caplog.text

    def boom(*a, **k):
        raise RuntimeError("Triton compile error")
    monkeypatch.setattr(rope_write, "rope_write", boom)
    assert not kernel_probes.rope_write_ok(_cfg(False), jnp.float32, page_size=16)
    assert "Triton compile error" in caplog.text


def test_models_the_kernels_never_take_pass_unprobed(monkeypatch):
    """No head norms (rope_write is not used) or a router the kernel does not fit: nothing runs."""
    def boom(*a, **k):
        raise AssertionError("probed")
    monkeypatch.setattr(rope_write, "rope_write", boom)
    monkeypatch.setattr(moe_router, "route_tokens", boom)
    assert kernel_probes.rope_write_ok(dataclasses.replace(_cfg(False), qk_norm=False), jnp.float32, 16)
    cfg = _cfg(True)
    wide = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, top_k=3))  # no power of two
    assert kernel_probes.router_ok(wide, jnp.float32)


def test_without_head_norms_the_probe_runs_under_mode_all(monkeypatch):
    """JAXLLM_ROPE_WRITE=all: a model without head norms takes the kernel, so the probe checks it
    (RoPE and the K/V write against XLA's) and a wrong kernel is refused."""
    monkeypatch.setenv("JAXLLM_ROPE_WRITE", "all")
    plain = dataclasses.replace(_cfg(False), qk_norm=False)
    assert kernel_probes.rope_write_ok(plain, jnp.float32, 16)
    real = rope_write.rope_write
    monkeypatch.setattr(rope_write, "rope_write", lambda *a, **k: (lambda q, p: (q * 2, p))(*real(*a, **k)))
    assert not kernel_probes.rope_write_ok(plain, jnp.float32, 16)
