"""Without the serve extra, AsyncLLM and `pagedllm serve` fail with one line naming it: a subprocess in which
importing the extra's modules fails, as it does where they are not installed."""

from __future__ import annotations

import subprocess
import sys

import pytest

MESSAGE = "needs the serve extra, and {!r} is not installed: pip install 'pagedllm[serve]'"


def run_without(blocked: str, code: str) -> subprocess.CompletedProcess:
    """Run `code` with every import of the `blocked` top-level packages failing as an absent package does."""
    blocker = (
        "import sys\n"
        "class NotInstalled:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        f"        if name.split('.')[0] in {blocked.split()!r}:\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
        "sys.meta_path.insert(0, NotInstalled())\n"
    )
    return subprocess.run([sys.executable, "-c", blocker + code], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("blocked", ["msgspec", "zmq"])
def test_async_llm_without_the_extra(blocked):
    result = run_without(blocked, "from pagedllm.entrypoints.openai.async_engine import AsyncLLM")
    assert result.returncode == 1
    last_line = result.stderr.strip().splitlines()[-1]
    assert last_line == "ImportError: AsyncLLM " + MESSAGE.format(blocked)
    assert "During handling" not in result.stderr  # the ModuleNotFoundError behind it is not chained


@pytest.mark.parametrize(("blocked", "needer"), [("fastapi", "pagedllm serve"), ("msgspec", "AsyncLLM")])
def test_serve_without_the_extra(blocked, needer):
    """The server imports fastapi first, then AsyncLLM: the line names what found the module missing."""
    result = run_without(blocked, "from pagedllm.entrypoints.cli import main; sys.exit(main(['serve']))")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [f"pagedllm: error: {needer} " + MESSAGE.format(blocked)]
