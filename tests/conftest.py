"""Shared fixtures.  Every test fails if it leaves an asyncfeed thread running."""

from __future__ import annotations

import gc
import os
import sys
import threading
import time

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # the support package (images, servers, oracle)


def _our_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("asyncfeed-") and t.is_alive()]


@pytest.fixture(autouse=True)
def no_leaked_threads():
    """Fail a test that leaves an ``asyncfeed-*`` thread alive 3 s after it ends."""
    yield
    deadline = time.monotonic() + 3.0
    while True:
        left = _our_threads()
        if not left:
            break
        gc.collect()  # only when needed: it costs ~0.1 s with torch loaded
        left = _our_threads()
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    assert not left, f"threads leaked by this test: {[t.name for t in left]}"
