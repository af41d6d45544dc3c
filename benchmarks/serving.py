"""Serving benchmark: streaming HTTP clients against `pagedllm serve`, nano-vllm's workload (random prompts of
100-1024 tokens, 100-1024 output tokens, temperature 0.6, ignore_eos) sent all at once and as Poisson arrivals at
given rates. Prints output throughput, time to first token and inter-token latency (p50/p99) per rate, and with
--offline the same engine driven in-process for reference (whole-workload throughput, decode step time at the
all-at-once batch size).

    python benchmarks/serving.py --rates inf 1 2 --num-seqs 16 --input-len 16 128 --output-len 16 64
    python benchmarks/serving.py --base-url http://127.0.0.1:8000 --rates inf   # against a running server

ITL is the gap between successive streamed chunks (a chunk carries the tokens of one engine step for the request;
when the client falls behind, several), as vLLM's benchmark measures it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import random
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from pagedllm.entrypoints.bench_common import nano_vllm_workload

REPO_ROOT = Path(__file__).resolve().parents[1]


@dataclass
class RequestResult:
    ttft: float = 0.0
    itls: list[float] = field(default_factory=list)
    output_tokens: int = 0
    latency: float = 0.0
    error: str | None = None


async def stream_request(client: httpx.AsyncClient, model: str, prompt: list[int], max_tokens: int) -> RequestResult:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.6,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    result = RequestResult()
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                result.error = (await response.aread()).decode()[:200]
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                now = time.perf_counter()
                if chunk.get("usage"):
                    result.output_tokens = chunk["usage"]["completion_tokens"]
                if not chunk["choices"]:
                    continue  # the usage chunk
                if result.ttft == 0.0:
                    result.ttft = now - start
                else:
                    result.itls.append(now - last)
                last = now
    except httpx.HTTPError as error:
        result.error = repr(error)
    result.latency = time.perf_counter() - start
    return result


async def send_share(
    base_url: str, model: str, share: list[tuple[float, list[int], int]], start_at: float, api_key: str | None
) -> list[RequestResult]:
    """Send this client's requests, each at start_at + its arrival offset (time.perf_counter() clock)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=None, limits=limits) as client:
        tasks = []
        for offset, prompt, max_tokens in share:
            await asyncio.sleep(max(0.0, start_at + offset - time.perf_counter()))
            tasks.append(asyncio.create_task(stream_request(client, model, prompt, max_tokens)))
        return await asyncio.gather(*tasks)


def client_process(base_url, model, share, start_at, api_key) -> tuple[list[RequestResult], float]:
    results = asyncio.run(send_share(base_url, model, share, start_at, api_key))
    return results, time.perf_counter()


def run_rate(
    base_url: str, model: str, prompts, output_lens, rate: float, api_key: str | None, num_clients: int = 1
) -> dict:
    """Send every request (Poisson arrivals at `rate` per second; inf: all at once) from num_clients processes,
    request i from client i % num_clients, and wait for all of them. One Python client parses some thousands of
    SSE lines a second; past that it reads several chunks at once and their gaps (ITL) shrink to nothing."""
    arrivals = random.Random(1)
    offsets, now = [], 0.0
    for _ in prompts:
        offsets.append(now)
        now += 0.0 if rate == float("inf") else arrivals.expovariate(rate)
    requests = list(zip(offsets, prompts, output_lens))
    shares = [requests[client::num_clients] for client in range(num_clients)]
    if num_clients == 1:
        start = time.perf_counter()
        finished = [client_process(base_url, model, shares[0], start, api_key)]
    else:
        with ProcessPoolExecutor(num_clients, mp_context=multiprocessing.get_context("spawn")) as pool:
            for warm_up in [pool.submit(time.sleep, 0.2) for _ in range(num_clients)]:
                warm_up.result()  # every client process is up
            start = time.perf_counter() + 1.0  # CLOCK_MONOTONIC: the same clock in every process
            futures = [pool.submit(client_process, base_url, model, share, start, api_key) for share in shares]
            finished = [future.result() for future in futures]
    duration = max(end for _, end in finished) - start
    results = [result for client_results, _ in finished for result in client_results]
    errors = [result.error for result in results if result.error]
    if errors:
        raise RuntimeError(f"{len(errors)} requests failed, e.g. {errors[0]}")
    ttfts = [result.ttft for result in results]
    itls = [itl for result in results for itl in result.itls]
    # Time per output token after the first, per request: unlike ITL, it does not depend on how chunks are read.
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in results if r.output_tokens > 1]
    output_tokens = sum(result.output_tokens for result in results)
    assert output_tokens == sum(output_lens), "ignore_eos requests must generate exactly max_tokens"
    return {
        "rate": rate,
        "num_requests": len(results),
        "num_clients": num_clients,
        "duration_s": duration,
        "output_tokens": output_tokens,
        "output_tokens_per_s": output_tokens / duration,
        "ttft_p50_ms": 1e3 * percentile(ttfts, 50),
        "ttft_p99_ms": 1e3 * percentile(ttfts, 99),
        "itl_p50_ms": 1e3 * percentile(itls, 50),
        "itl_p99_ms": 1e3 * percentile(itls, 99),
        "tpot_p50_ms": 1e3 * percentile(tpots, 50),
    }


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def start_server(args: argparse.Namespace):
    sys.path.insert(0, str(REPO_ROOT / "tests"))
    from server_process import start_server as start  # the tests' helper: a subprocess on a free port

    flags = ["--max-model-len", str(args.max_model_len), "--threads", str(args.threads), "--device", args.device]
    flags += ["--max-num-seqs", str(args.max_num_seqs)]
    if args.engine_core_in_thread:
        flags.append("--engine-core-in-thread")
    if args.shape:
        flags.append("--skip-tokenizer-init")
    return start(args.model, Path(args.log), *flags)


def offline_reference(args: argparse.Namespace, prompts, output_lens) -> dict:
    """The same engine in-process: the whole workload's output tokens/s, and the median decode step time when
    every request is decoding (the all-at-once batch)."""
    import torch

    from pagedllm import LLM, SamplingParams

    torch.set_num_threads(args.threads)
    llm = LLM(
        args.model,
        max_model_len=args.max_model_len,
        device=args.device,
        max_num_seqs=args.max_num_seqs,
        skip_tokenizer_init=bool(args.shape),
    )
    engine = llm.llm_engine
    llm.generate([{"prompt_token_ids": prompt} for prompt in prompts[:2]], SamplingParams(max_tokens=4), use_tqdm=False)
    llm.reset_prefix_cache()  # the warm-up (as the server's) must not leave prefix hits behind
    for index, (prompt, max_tokens) in enumerate(zip(prompts, output_lens)):
        params = SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=max_tokens)
        engine.add_request(f"offline-{index}", {"prompt_token_ids": prompt}, params, stream=False)
    full_batch = min(len(prompts), args.max_num_seqs)
    records = []
    engine.add_step_listener(records.append)
    output_tokens = 0
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        outputs = engine.step()
        output_tokens += sum(len(output.outputs[0].token_ids) for output in outputs)
    total = time.perf_counter() - start
    engine.remove_step_listener(records.append)
    # A step lasts from the previous step's tokens reaching the host to its own (as `pagedllm bench` counts).
    decode_steps = [
        record.resolved_at - previous.resolved_at
        for previous, record in zip(records, records[1:])
        if not record.num_prefill_tokens and record.num_decode_tokens == full_batch
    ]
    return {
        "output_tokens_per_s": output_tokens / total,
        "duration_s": total,
        "decode_batch": full_batch,
        "decode_step_p50_ms": 1e3 * statistics.median(decode_steps) if decode_steps else float("nan"),
        "num_full_decode_steps": len(decode_steps),
    }


def print_table(results: list[dict], offline: dict | None, num_requests: int) -> None:
    columns = "arrivals | requests | duration (s) | output tok/s | TTFT p50 (ms) | TTFT p99 (ms) | ITL p50 | ITL p99"
    print(f"| {columns} (ms) | TPOT p50 (ms) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for row in results:
        arrivals = "all at once" if row["rate"] == float("inf") else f"Poisson {row['rate']:g}/s"
        print(
            f"| {arrivals} | {row['num_requests']} | {row['duration_s']:.1f} | {row['output_tokens_per_s']:,.1f} "
            f"| {row['ttft_p50_ms']:,.0f} | {row['ttft_p99_ms']:,.0f} | {row['itl_p50_ms']:,.1f} "
            f"| {row['itl_p99_ms']:,.1f} | {row['tpot_p50_ms']:,.1f} |"
        )
    if offline:
        print(
            f"| offline (in-process engine) | {num_requests} "
            f"| {offline['duration_s']:.1f} | {offline['output_tokens_per_s']:,.1f} | | "
            f"| decode step at batch {offline['decode_batch']}: {offline['decode_step_p50_ms']:.1f} | | |"
        )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", help="a running server; without it the benchmark starts `pagedllm serve`")
    parser.add_argument("--api-key", help="the running server's API key")
    parser.add_argument("--model", help="model for the started server (default: the embedded SmolLM2-135M)")
    parser.add_argument("--shape", help="serve random weights of this shape instead (as `pagedllm bench`; GPU)")
    parser.add_argument("--served-model-name", help="model name to send (default: ask /v1/models)")
    parser.add_argument("--rates", type=float, nargs="+", default=[float("inf")], help="requests/s; inf = all at once")
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--clients", type=int, default=8, help="client processes sharing the requests (8)")
    parser.add_argument("--input-len", type=int, nargs=2, default=[100, 1024], metavar=("MIN", "MAX"))
    parser.add_argument("--output-len", type=int, nargs=2, default=[100, 1024], metavar=("MIN", "MAX"))
    parser.add_argument("--max-token-id", type=int, default=10000, help="prompt ids are drawn from 0..this")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads of the engine (1)")
    parser.add_argument("--engine-core-in-thread", action="store_true", help="step the engine in the server process")
    parser.add_argument("--offline", action="store_true", help="then run the workload offline, for reference")
    parser.add_argument("--log", default="/tmp/pagedllm-bench-serve.log", help="the started server's log")
    parser.add_argument("--output", help="write the results as JSON here")
    return parser


def main() -> None:
    args = build_parser().parse_args()
    if args.shape:  # random bf16 weights of a real model's shape, no tokenizer, as the offline GPU benchmark
        import torch

        from pagedllm.entrypoints.bench_common import write_random_checkpoint

        checkpoint = Path("/tmp/pagedllm-bench") / args.shape
        if not (checkpoint / "model.safetensors").exists():
            write_random_checkpoint(args.shape, checkpoint, torch.device("cuda"))
        args.model = str(checkpoint)
    prompts, output_lens = nano_vllm_workload(
        args.num_seqs, tuple(args.input_len), tuple(args.output_len), args.max_token_id
    )
    server = None if args.base_url else start_server(args)
    base_url = args.base_url or server.base_url
    try:
        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        model = args.served_model_name or httpx.get(f"{base_url}/v1/models", headers=headers).json()["data"][0]["id"]
        run_rate(base_url, model, prompts[:2], [4, 4], float("inf"), args.api_key)  # warm-up
        results = []
        for run_index, rate in enumerate(args.rates):
            # Shift every token id per run: same lengths, no prefix-cache hits on an earlier run's prompts.
            shift = 1009 * (run_index + 1)
            run_prompts = [[(token + shift) % (args.max_token_id + 1) for token in prompt] for prompt in prompts]
            results.append(run_rate(base_url, model, run_prompts, output_lens, rate, args.api_key, args.clients))
    finally:
        if server is not None:
            from server_process import stop_server

            stop_server(server)
    if args.output:  # the served results are kept even if the offline reference fails
        Path(args.output).write_text(json.dumps({"args": vars(args), "results": results}, indent=2))
    offline = offline_reference(args, prompts, output_lens) if args.offline else None
    print(f"\nmodel {model}, {args.num_seqs} requests, prompts {args.input_len[0]}-{args.input_len[1]} tokens, "
          f"outputs {args.output_len[0]}-{args.output_len[1]} tokens, {args.threads} engine thread(s)")  # fmt: skip
    print_table(results, offline, len(prompts))
    if args.output:
        Path(args.output).write_text(json.dumps({"args": vars(args), "results": results, "offline": offline}, indent=2))


if __name__ == "__main__":
    main()
