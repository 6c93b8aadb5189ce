"""Fixtures shared across test files."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile

import pytest

# One XLA compilation cache for the whole run, shared by the xdist workers and the processes
# tests start (they inherit the environment): many files build the same tiny engines and so
# compile the same step programs (a cold cache took 9 engine-heavy files from 312 s to 244 s).
# Made by the controlling process, removed when it ends; a cache set by the caller is kept.
MIN_COMPILE_S = "0.1"  # programs that took less to compile are not written


def pytest_configure(config):
    if hasattr(config, "workerinput") or os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        return  # a worker (the controller's environment already has it), or the caller's cache
    path = tempfile.mkdtemp(prefix="jaxllm-tests-xla-")
    config._jaxllm_xla_cache = path
    os.environ["JAX_COMPILATION_CACHE_DIR"] = path
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", MIN_COMPILE_S)
    if "jax" in sys.modules:  # imported before this hook: its config read the environment already
        import jax
        jax.config.update("jax_compilation_cache_dir", path)
        jax.config.update("jax_persistent_cache_min_compile_time_secs",
                          float(os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"]))


def pytest_unconfigure(config):
    path = getattr(config, "_jaxllm_xla_cache", None)
    if path:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def live_server():
    """One live OpenAI-compatible server (tests/test_server.py's LiveServer) for every server test file,
    so its start-up compile is paid once."""
    from test_server import LiveServer

    s = LiveServer()
    yield s
    s.close()
