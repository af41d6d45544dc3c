"""The engine imports without the gguf package (a machine with torch and transformers alone, as the GPU machines
here are, runs safetensors checkpoints); only loading a GGUF file needs it."""

from __future__ import annotations

import subprocess
import sys
import textwrap

BLOCK_GGUF = textwrap.dedent(
    """
    import importlib.abc, sys

    class NoGGUF(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name == "gguf" or name.startswith("gguf."):
                raise ImportError("no gguf here")

    sys.meta_path.insert(0, NoGGUF())
    """
)


def test_the_engine_and_its_commands_import_without_gguf():
    code = BLOCK_GGUF + "import pagedllm.llm, pagedllm.entrypoints.cli, pagedllm.entrypoints.bench\nprint('ok')"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


def test_the_blocker_works():  # else the test above could pass on a machine that simply has gguf
    code = BLOCK_GGUF + "import pagedllm.loader.gguf_loader"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "no gguf here" in done.stderr
