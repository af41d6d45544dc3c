"""Does one large prompt stall the other streams? A small completion stream runs (one request after another) while a
completion with a prompt of N MB is sent to `pagedllm serve --max-model-len 512` (started here on a free port, or
--base-url); prints, per size, the large request's status and time and the small stream's largest gap between chunks
meanwhile. The large prompt is far over max_model_len: it is tokenized, then refused.

    python benchmarks/large_prompt_stall.py --sizes 1 5                      # the default model
    python benchmarks/large_prompt_stall.py --model ~/models/tiny --sizes 1 5
    python benchmarks/large_prompt_stall.py --base-url http://127.0.0.1:8000  # a running server
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from pathlib import Path

import openai

REPO_ROOT = Path(__file__).resolve().parents[1]

SENTENCE = "Paged attention keeps the KV cache in fixed-size blocks. "


def small_streams(client: openai.OpenAI, model: str, gaps: list[tuple[float, float]], done: threading.Event) -> None:
    last = time.monotonic()
    while not done.is_set():
        stream = client.completions.create(model=model, prompt="The quick", stream=True, max_tokens=64, temperature=0)
        for _chunk in stream:
            now = time.monotonic()
            gaps.append((last, now))
            last = now


def measure(client: openai.OpenAI, model: str, megabytes: float) -> tuple[str, float, float, int]:
    gaps: list[tuple[float, float]] = []
    done = threading.Event()
    streaming = threading.Thread(target=small_streams, args=(client, model, gaps, done))
    streaming.start()
    while len(gaps) < 5:
        time.sleep(0.05)
    prompt = (SENTENCE * (int(megabytes * 1e6) // len(SENTENCE) + 1))[: int(megabytes * 1e6)]
    start = time.monotonic()
    try:
        client.completions.create(model=model, prompt=prompt, max_tokens=1)
        status = "200"
    except openai.APIStatusError as error:
        status = str(error.status_code)
    end = time.monotonic()
    done.set()
    streaming.join()
    during = [now - previous for previous, now in gaps if now > start and previous < end]
    return status, end - start, max(during), len(during)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", help="a running server (default: start one)")
    parser.add_argument("--model", help="the checkpoint the started server serves (default: the default model)")
    parser.add_argument("--sizes", type=float, nargs="+", default=[1.0, 5.0], help="prompt sizes in MB")
    args = parser.parse_args()
    sys.path.insert(0, str(REPO_ROOT / "tests"))
    from server_process import start_server, stop_server  # the tests' helper: a subprocess on a free port

    server = None
    if args.base_url is None:
        server = start_server(args.model, Path(tempfile.mkdtemp()) / "server.log", "--max-model-len", "512")
    try:
        base_url = args.base_url or server.base_url
        client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0, timeout=600)
        model = client.models.list().data[0].id
        print("| prompt | status | its time | small stream's largest gap | its chunks meanwhile |")
        print("|---|---|---|---|---|")
        for megabytes in args.sizes:
            status, seconds, gap, chunks = measure(client, model, megabytes)
            print(f"| {megabytes:g} MB | {status} | {seconds:.2f} s | {gap:.3f} s | {chunks} |", flush=True)
    finally:
        if server is not None:
            stop_server(server)


if __name__ == "__main__":
    main()
