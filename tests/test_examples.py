"""The examples that talk to a server say how to start one when none is running."""

from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _closed_port() -> int:
    with socket.socket() as sock:                 # free now, and nobody listens after close
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.parametrize("example, flag, scheme", [
    ("websocket_client.py", "--url", "ws://127.0.0.1:{port}"),
    ("openai_client.py", "--base-url", "http://127.0.0.1:{port}/v1"),
])
def test_client_example_without_a_server_prints_one_line(example, flag, scheme):
    if example == "openai_client.py" and importlib.util.find_spec("openai") is None:
        pytest.skip("the openai client is not installed (the test extra installs it)")
    url = scheme.format(port=_closed_port())
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run([sys.executable, str(ROOT / "examples" / example), flag, url],
                            capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 1
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("no astream server at ") and "start one with `astream serve`" in lines[0]
