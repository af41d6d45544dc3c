"""Pictures of a trace (matplotlib, the optional extra `plot`): a run over time, and the KV block pool at one step."""

from __future__ import annotations

import math

import numpy as np

from pagedllm.trace.events import CACHED, FREE, SHARED
from pagedllm.trace.reader import KvSnapshot, StepRow, Trace

FREE_COLOUR, CACHED_COLOUR, EMPTY_COLOUR = (0.94, 0.94, 0.94), (0.68, 0.68, 0.68), (1.0, 1.0, 1.0)


def require_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ImportError("plots need matplotlib: pip install 'pagedllm[plot]'") from None


def new_figure(width: float, height: float):
    require_matplotlib()
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), dpi=100, layout="constrained")


def plot_run(
    trace: Trace,
    path: str,
    window: tuple[float, float] | None = None,
    roofline_tokens_per_s: float | None = None,
) -> None:
    """Four panels over time: output tokens/s (with the roofline rate where known), tokens per step (prefill,
    decode), running and waiting requests, KV blocks in use and in the prefix cache.

    window: (start, end) in seconds since the trace's origin; only the steps inside are drawn (None: all).
    """
    steps = [s for s in trace.steps if window is None or (window[0] <= s.start and s.end <= window[1])]
    if not steps:
        raise ValueError("no steps to plot: the trace (or the window) holds none")
    origin = steps[0].start
    # Step i is drawn from step i-1's end to its own (the first from its start): steps tile the time axis.
    edges = np.array([origin] + [step.end for step in steps]) - origin

    def column(key: str) -> np.ndarray:
        return np.array([step.counts[key] for step in steps])

    figure = new_figure(10, 9)
    rate_axes, tokens_axes, requests_axes, kv_axes = figure.subplots(4, 1, sharex=True)
    draw_output_rate(rate_axes, steps, origin, roofline_tokens_per_s)
    decode, prefill = column("decode_tokens"), column("prefill_tokens")
    tokens_axes.stairs(decode, edges, fill=True, label="decode", color="tab:blue")
    tokens_axes.stairs(decode + prefill, edges, baseline=decode, fill=True, label="prefill", color="tab:orange")
    tokens_axes.set_ylabel("tokens per step")
    requests_axes.stairs(column("running"), edges, baseline=None, label="running", linewidth=1.5)
    requests_axes.stairs(column("waiting"), edges, baseline=None, label="waiting", linewidth=1.5)
    requests_axes.set_ylabel("requests")
    num_blocks = trace.metadata["num_kv_blocks"]
    kv_axes.stairs(100 * column("kv_used") / num_blocks, edges, baseline=None, label="in use", linewidth=1.5)
    cached = 100 * column("kv_cached") / num_blocks
    kv_axes.stairs(cached, edges, baseline=None, label="in the prefix cache", linewidth=1.5)
    kv_axes.set_ylim(0, 105)
    kv_axes.set_ylabel(f"% of {num_blocks} KV blocks")
    kv_axes.set_xlabel("seconds")
    for axes in (rate_axes, tokens_axes, requests_axes, kv_axes):
        axes.grid(alpha=0.3)
        axes.legend(loc="upper right", fontsize="small")
    figure.suptitle(f"{trace.metadata.get('model', '')}: {len(steps)} steps in {edges[-1]:.2f} s")
    figure.savefig(path)


def draw_output_rate(axes, steps: list[StepRow], origin: float, roofline_tokens_per_s: float | None) -> None:
    """Generated tokens per second in time bins (a step's tokens count when they reach the host)."""
    duration = max(steps[-1].end - origin, 1e-9)
    num_bins = min(100, max(10, len(steps) // 4))
    edges = np.linspace(0, duration, num_bins + 1)
    ends = [step.end - origin for step in steps]
    tokens, _ = np.histogram(ends, bins=edges, weights=[step.counts["generated"] for step in steps])
    axes.stairs(tokens / (duration / num_bins), edges, label="output tokens/s", color="tab:green")
    mean_rate = sum(step.counts["generated"] for step in steps) / duration
    axes.axhline(mean_rate, color="tab:green", linestyle=":", label=f"mean {mean_rate:,.0f}")
    if roofline_tokens_per_s:
        axes.axhline(
            roofline_tokens_per_s, color="tab:red", linestyle="--", label=f"roofline {roofline_tokens_per_s:,.0f}"
        )
    axes.set_ylabel("output tokens/s")


def choose_snapshot(trace: Trace, step: int | None) -> KvSnapshot:
    """The snapshot of `step`, else the nearest one; with step None, the one with the most blocks in use (then the
    most shared)."""
    if not trace.kv_snapshots:
        raise ValueError("the trace holds no KV block snapshots: record it with trace_kv_every / --trace-kv-every")
    snapshots = trace.kv_snapshots.values()
    if step is None:
        return max(snapshots, key=lambda snapshot: (blocks_in_use(snapshot.states), snapshot.states.count(SHARED)))
    return min(snapshots, key=lambda snapshot: (abs(snapshot.step - step), snapshot.step))


def draw_kv_blocks(trace: Trace, path: str, step: int | None = None) -> int:
    """The block pool as a grid, block 0 at the top left: free, cached and free, or in use coloured by the request
    holding it (its earliest holder when shared), shared blocks dotted. Returns the step drawn (choose_snapshot)."""
    from matplotlib.patches import Patch

    snapshot = choose_snapshot(trace, step)
    num_blocks = len(snapshot.states)
    columns = math.ceil(math.sqrt(2 * num_blocks))
    rows = math.ceil(num_blocks / columns)
    palette = owner_palette()
    image = np.array([EMPTY_COLOUR] * (rows * columns), dtype=float)
    for block_id, (state, owner) in enumerate(zip(snapshot.states, snapshot.owners)):
        if state == FREE:
            image[block_id] = FREE_COLOUR
        elif state == CACHED:
            image[block_id] = CACHED_COLOUR
        else:
            image[block_id] = palette[owner % len(palette)]
    figure = new_figure(11, max(2.5, 8 * rows / columns + 1.3))
    axes = figure.subplots()
    axes.imshow(image.reshape(rows, columns, 3), interpolation="nearest")
    shared = [block_id for block_id, state in enumerate(snapshot.states) if state == SHARED]
    dot_size = min(20.0, max(2.0, (400 / columns) ** 2 / 8))
    axes.scatter([b % columns for b in shared], [b // columns for b in shared], s=dot_size, color="black")
    if columns <= 100:  # cell borders, while cells are big enough to see them
        axes.set_xticks(np.arange(-0.5, columns), minor=True)
        axes.set_yticks(np.arange(-0.5, rows), minor=True)
        axes.grid(which="minor", color="white", linewidth=0.8)
    row_starts = range(0, rows, max(1, rows // 12))
    axes.set_yticks(row_starts, [f"block {row * columns}" for row in row_starts], fontsize="small")
    axes.tick_params(which="both", bottom=False, left=False, labelbottom=False)
    owners = sorted({o for s, o in zip(snapshot.states, snapshot.owners) if s not in (FREE, CACHED)})
    legend = [Patch(color=FREE_COLOUR, label="free"), Patch(color=CACHED_COLOUR, label="cached, free (reusable)")]
    if len(owners) <= 12:
        names = trace.request_names
        legend += [Patch(color=palette[o % len(palette)], label=f"request {names.get(o, '?')}") for o in owners]
    else:
        legend.append(Patch(color=palette[0], label=f"in use by {len(owners)} requests (colour = request)"))
    legend.append(axes.scatter([], [], s=dot_size, color="black", label="shared by 2+ requests (prefix)"))
    axes.legend(handles=legend, loc="upper left", bbox_to_anchor=(1.01, 1), fontsize="small", frameon=False)
    used = blocks_in_use(snapshot.states)
    figure.suptitle(
        f"KV cache after scheduling step {snapshot.step}: {num_blocks} blocks of "
        f"{trace.metadata.get('block_size', '?')} tokens\n{used} in use ({len(shared)} shared), "
        f"{snapshot.states.count(CACHED)} cached and free, {snapshot.states.count(FREE)} free",
        fontsize="medium",
    )
    figure.savefig(path)
    return snapshot.step


def blocks_in_use(states: str) -> int:
    return len(states) - states.count(FREE) - states.count(CACHED)


def owner_palette() -> list[tuple[float, float, float]]:
    """tab10's colours, then tab20's light shades, without grey (grey means free or cached)."""
    from matplotlib import colormaps

    strong = [colour for index, colour in enumerate(colormaps["tab10"].colors) if index != 7]
    light = [colour for index, colour in enumerate(colormaps["tab20"].colors) if index % 2 and index != 15]
    return strong + light
