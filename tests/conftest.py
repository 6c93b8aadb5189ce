"""Fixtures shared across test files."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def live_server():
    """One live OpenAI-compatible server (tests/test_server.py's LiveServer) for every server test file,
    so its start-up compile is paid once."""
    from test_server import LiveServer

    s = LiveServer()
    yield s
    s.close()
