"""Run a kernel test module again as a child process under the Triton interpreter, and read what it found.

Triton decides interpret-or-compile when a kernel is decorated, so a module that tests kernels on CPU runs itself as
a script with TRITON_INTERPRET=1 set from its start; the script prints one JSON record as its last line, and the
module's tests assert on it. The parent process decorates the kernels too, on import, but never launches them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def interpreter_results(test_file: str, timeout: float = 600) -> dict:
    """The JSON record that test_file, run as a script under the interpreter, prints last."""
    path = Path(test_file).resolve()
    python_path = os.pathsep.join([str(path.parents[2]), str(path.parent), os.environ.get("PYTHONPATH", "")])
    # One thread for torch and numpy's BLAS: every array is tiny, and on a shared machine a second thread mostly waits
    # for a busy core (torch ops on these shapes took ~4 ms with 2 threads against ~0.2 ms with one, under load).
    threads = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    env = {**os.environ, **threads, "TRITON_INTERPRET": "1", "PYTHONPATH": python_path}
    proc = subprocess.run([sys.executable, str(path)], env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
