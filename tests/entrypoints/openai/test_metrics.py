"""The server's speculative-decoding counters take the engine's running totals as increases (vLLM's names, under
the server's prefix)."""

from __future__ import annotations

import pytest

pytest.importorskip("prometheus_client", reason="the server needs the serve extra")

from pagedllm.entrypoints.openai.core_loop import EngineStats  # noqa: E402
from pagedllm.entrypoints.openai.metrics import ServerMetrics  # noqa: E402


def test_spec_decode_counters_follow_the_engines_totals():
    metrics = ServerMetrics("m", max_model_len=64)
    for drafts, draft_tokens, accepted in [(2, 7, 3), (5, 16, 9)]:  # running totals, as the core loop sends them
        metrics.record_engine_stats(EngineStats(1, 0, 0.5, 0, 0, 0, drafts, draft_tokens, accepted))
    text = metrics.render().decode()
    assert 'spec_decode_num_drafts_total{model_name="m"} 5.0' in text
    assert 'spec_decode_num_draft_tokens_total{model_name="m"} 16.0' in text
    assert 'spec_decode_num_accepted_tokens_total{model_name="m"} 9.0' in text
