"""Start and stop `pagedllm serve` in a subprocess for the server tests, and read its /metrics; write the tiny chat
model they serve."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

REPO_ROOT = Path(__file__).resolve().parents[1]
API_KEY = "test-key"

# A minimal chat template, so the tiny model can serve /v1/chat/completions.
CHAT_TEMPLATE = (
    "{% for message in messages %}<s>{{ message['role'] }}{% if message['name'] %} {{ message['name'] }}{% endif %}: "
    "{{ message['content'] }}\n{% endfor %}{% if add_generation_prompt %}<s>assistant:{% endif %}"
)


def write_chat_model(llama_dir: str, tmp_path_factory) -> str:
    """A copy of the tiny Llama checkpoint with a chat template added to its tokenizer."""
    directory = tmp_path_factory.mktemp("tiny_chat_llama")
    shutil.copytree(llama_dir, directory, dirs_exist_ok=True)
    config_path = directory / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = CHAT_TEMPLATE
    config_path.write_text(json.dumps(config))
    return str(directory)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@dataclass
class RunningServer:
    process: subprocess.Popen
    base_url: str  # http://127.0.0.1:PORT
    model: str  # the served model name
    model_dir: str
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def metric(self, name: str, **labels: str) -> float:
        """One sample of /metrics; 0.0 when the series does not exist yet."""
        text = httpx.get(f"{self.base_url}/metrics").text
        for line in text.splitlines():
            if line.startswith(f"{name}{{") and all(f'{key}="{value}"' in line for key, value in labels.items()):
                return float(line.rsplit(" ", 1)[1])
        return 0.0


def start_server(model_dir: str | None, log_path: Path, *extra: str, env: dict | None = None) -> RunningServer:
    """`pagedllm serve` on a free port (model_dir None: the default model), once /health answers 200."""
    port = free_port()
    command = [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", "--port", str(port)]
    command += ["--model", model_dir] if model_dir else []
    process_env = {**os.environ, "PYTHONPATH": f"{REPO_ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    process_env.update(env or {})
    with open(log_path, "w") as log:
        process = subprocess.Popen([*command, *extra], stdout=log, stderr=subprocess.STDOUT, env=process_env)
    server = RunningServer(process, f"http://127.0.0.1:{port}", model_dir or "", model_dir or "", log_path)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode}:\n{server.log()}")
        try:
            if httpx.get(f"{server.base_url}/health", timeout=1).status_code == 200:
                return server
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    process.kill()
    raise RuntimeError(f"the server did not start in time:\n{server.log()}")


def stop_server(server: RunningServer, sig: int = signal.SIGTERM) -> int:
    """Send the signal and return the exit status (the server must exit by itself within 20 s)."""
    server.process.send_signal(sig)
    try:
        return server.process.wait(timeout=20)
    except subprocess.TimeoutExpired:
        server.process.kill()
        server.process.wait()
        raise AssertionError(f"the server did not exit within 20 s of signal {sig}:\n{server.log()}") from None
