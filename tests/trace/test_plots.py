"""The run plot and the KV-cache picture come out as PNG files of sane size, from a real traced run."""

from __future__ import annotations

import pytest
from matplotlib.image import imread
from traced_runs import traced_generate

from pagedllm.trace.plots import choose_snapshot, draw_kv_blocks, plot_run
from pagedllm.trace.reader import load_trace


@pytest.fixture(scope="module")
def trace(llama_dir, tmp_path_factory):
    path = tmp_path_factory.mktemp("plots") / "trace.json"
    traced_generate(llama_dir, path, num_kv_blocks=24, trace_kv_every=3)
    return load_trace(str(path))


def assert_png(path, width: int, min_height: int) -> None:
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert 10_000 < path.stat().st_size < 2_000_000
    height, image_width, _ = imread(path).shape
    assert image_width == width and height >= min_height


def test_run_plot(trace, tmp_path):
    plot_run(trace, tmp_path / "run.png", roofline_tokens_per_s=1e4)
    assert_png(tmp_path / "run.png", 1000, 900)
    window = (trace.steps[3].start, trace.steps[-3].end)
    plot_run(trace, tmp_path / "window.png", window)
    assert_png(tmp_path / "window.png", 1000, 900)
    with pytest.raises(ValueError, match="no steps to plot"):
        plot_run(trace, tmp_path / "none.png", (-2.0, -1.0))


def test_kv_picture(trace, tmp_path):
    drawn = draw_kv_blocks(trace, tmp_path / "kv.png", step=4)
    assert drawn == 3  # snapshots are every 3 steps: the nearest one
    assert_png(tmp_path / "kv.png", 1100, 250)


def test_default_snapshot_is_the_fullest(trace):
    fullest = choose_snapshot(trace, None)
    in_use = [len(s.states) - s.states.count(".") - s.states.count("c") for s in trace.kv_snapshots.values()]
    assert len(fullest.states) - fullest.states.count(".") - fullest.states.count("c") == max(in_use) > 0
