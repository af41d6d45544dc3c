"""Prometheus metrics under vLLM's own names (`vllm:...`, labelled `model_name`), so vLLM's Grafana dashboard works
unchanged: request and KV cache gauges, prefix-cache, preemption, speculative-decoding and token counters, and
latency histograms (TTFT, inter-token, end-to-end, queue, prefill, decode)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest

from pagedllm.entrypoints.openai.async_engine import FinishedRequestStats, TokenStats
from pagedllm.entrypoints.openai.core_loop import EngineStats

TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0]
ITL_BUCKETS = [0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0]
REQUEST_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0, 240.0, 480.0, 960.0]


def token_buckets(max_model_len: int) -> list[int]:
    """1, 2, 5, 10, 20, 50 ... up to max_model_len."""
    buckets, scale = [], 1
    while True:
        for step in (1, 2, 5):
            if step * scale > max_model_len:
                return buckets
            buckets.append(step * scale)
        scale *= 10


class ServerMetrics:
    """AsyncLLM's StatsListener: turns engine statistics and request timings into Prometheus series."""

    def __init__(self, model_name: str, max_model_len: int):
        disable_created_metrics()  # no `_created` series (vLLM leaves them out too)
        self.registry = CollectorRegistry()
        labels = ["model_name"]

        def gauge(name: str, documentation: str) -> Gauge:
            return Gauge(f"vllm:{name}", documentation, labels, registry=self.registry).labels(model_name)

        def counter(name: str, documentation: str) -> Counter:
            return Counter(f"vllm:{name}", documentation, labels, registry=self.registry).labels(model_name)

        def histogram(name: str, documentation: str, buckets: list) -> Histogram:
            return Histogram(f"vllm:{name}", documentation, labels, buckets=buckets, registry=self.registry).labels(
                model_name
            )

        self.num_requests_running = gauge("num_requests_running", "Requests in the running batch.")
        self.num_requests_waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_cache_usage = gauge("kv_cache_usage_perc", "Fraction of KV-cache blocks held (1 = full).")
        # vLLM's older name for the same gauge, kept by vLLM and read by its Grafana dashboard.
        self.gpu_cache_usage = gauge("gpu_cache_usage_perc", "Fraction of KV-cache blocks held (kv_cache_usage_perc).")
        self.prefix_cache_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_cache_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.num_preemptions = counter("num_preemptions", "Requests preempted (blocks freed, recomputed later).")
        self.spec_decode_counters = {  # EngineStats field -> its counter, vLLM's names
            "spec_decode_num_drafts": counter("spec_decode_num_drafts", "Speculative decoding: verify attempts."),
            "spec_decode_num_draft_tokens": counter("spec_decode_num_draft_tokens", "Draft tokens proposed."),
            "spec_decode_num_accepted_tokens": counter("spec_decode_num_accepted_tokens", "Draft tokens accepted."),
        }
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of requests that started generating.")
        self.prompt_tokens_cached = counter("prompt_tokens_cached", "Of those, tokens found in the prefix cache.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens.")
        self.request_success = Counter(
            "vllm:request_success",
            "Finished requests, by finish reason.",
            ["model_name", "finished_reason"],
            registry=self.registry,
        )
        self.model_name = model_name
        self.time_to_first_token = histogram("time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS)
        self.inter_token_latency = histogram("inter_token_latency_seconds", "Time between tokens.", ITL_BUCKETS)
        # vLLM's older name for the inter-token latency, which vLLM still sends and its Grafana dashboard reads.
        self.time_per_output_token = histogram(
            "time_per_output_token_seconds", "Time between tokens (inter_token_latency_seconds).", ITL_BUCKETS
        )
        self.e2e_latency = histogram("e2e_request_latency_seconds", "Arrival to last token.", REQUEST_BUCKETS)
        self.queue_time = histogram("request_queue_time_seconds", "Arrival to first scheduled.", REQUEST_BUCKETS)
        self.prefill_time = histogram(
            "request_prefill_time_seconds", "First scheduled to first token.", REQUEST_BUCKETS
        )
        self.decode_time = histogram("request_decode_time_seconds", "First token to last token.", REQUEST_BUCKETS)
        tokens = token_buckets(max_model_len)
        self.request_prompt_tokens = histogram("request_prompt_tokens", "Prompt tokens per request.", tokens)
        self.request_generation_tokens = histogram(
            "request_generation_tokens", "Generated tokens per request (all its samples).", tokens
        )
        self.request_max_num_generation_tokens = histogram(
            "request_max_num_generation_tokens", "Generated tokens of a request's longest sample.", tokens
        )
        self.last_engine_stats: EngineStats | None = None

    def record_engine_stats(self, stats: EngineStats) -> None:
        previous = self.last_engine_stats
        self.num_requests_running.set(stats.num_running)
        self.num_requests_waiting.set(stats.num_waiting)
        self.kv_cache_usage.set(stats.kv_cache_usage)
        self.gpu_cache_usage.set(stats.kv_cache_usage)
        # The core sends running totals; counters take the increase since the last report.
        self.num_preemptions.inc(stats.num_preemptions - (previous.num_preemptions if previous else 0))
        self.prefix_cache_queries.inc(stats.prefix_cache_queries - (previous.prefix_cache_queries if previous else 0))
        self.prefix_cache_hits.inc(stats.prefix_cache_hits - (previous.prefix_cache_hits if previous else 0))
        for name, counter in self.spec_decode_counters.items():
            counter.inc(getattr(stats, name) - (getattr(previous, name) if previous else 0))
        self.last_engine_stats = stats

    def record_tokens(self, tokens: TokenStats) -> None:
        self.prompt_tokens.inc(tokens.num_prompt_tokens)
        self.prompt_tokens_cached.inc(tokens.num_cached_tokens)
        self.generation_tokens.inc(tokens.num_new_tokens)
        if tokens.ttft is not None:
            self.time_to_first_token.observe(tokens.ttft)
        if tokens.itl is not None:
            self.inter_token_latency.observe(tokens.itl)
            self.time_per_output_token.observe(tokens.itl)

    def record_finished(self, request: FinishedRequestStats) -> None:
        self.request_success.labels(self.model_name, request.finish_reason).inc()
        self.e2e_latency.observe(request.e2e_latency)
        self.queue_time.observe(request.queue_time)
        self.prefill_time.observe(request.prefill_time)
        self.decode_time.observe(request.decode_time)
        self.request_prompt_tokens.observe(request.num_prompt_tokens)
        self.request_generation_tokens.observe(request.num_generation_tokens)
        self.request_max_num_generation_tokens.observe(request.max_num_generation_tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)
