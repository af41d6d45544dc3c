"""`pagedllm trace-summary`: a trace (from --trace-file) in a few lines, and on request its plot over time and a
picture of the KV block pool at one step."""

from __future__ import annotations

import argparse


def build_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("trace", help="a trace written with --trace-file (or LLM(trace_file=...))")
    parser.add_argument("--plot", metavar="PNG", help="draw tokens/s, tokens per step, requests and KV use over time")
    parser.add_argument(
        "--kv-picture",
        metavar="PNG",
        help="draw the KV block pool at one step (needs a trace made with --trace-kv-every)",
    )
    parser.add_argument(
        "--step", type=int, help="the step of --kv-picture (the nearest snapshot; default: the fullest one)"
    )
    return parser


def run(args: argparse.Namespace) -> None:
    from pagedllm.trace.reader import load_trace
    from pagedllm.trace.summary import format_summary, summarize

    trace = load_trace(args.trace)
    print(format_summary(summarize(trace)))
    if args.plot:
        from pagedllm.trace.plots import plot_run

        plot_run(trace, args.plot, roofline_tokens_per_s=trace.metadata.get("roofline_output_tokens_per_s"))
        print(f"plot written to {args.plot}")
    if args.kv_picture:
        from pagedllm.trace.plots import draw_kv_blocks

        step = draw_kv_blocks(trace, args.kv_picture, args.step)
        print(f"KV picture of step {step} written to {args.kv_picture}")
    elif args.step is not None:
        raise ValueError("--step picks the step of --kv-picture; give --kv-picture too")
