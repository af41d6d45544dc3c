"""The `pagedllm` command: chat with a model, generate completions, benchmark the engine, or summarise a trace.

Building the parser imports argparse and the flags' rules alone (no torch, no transformers): `pagedllm --help` is
fast, and the flags are checked before anything heavy is imported. Each command imports what it runs."""

from __future__ import annotations

import argparse
import contextlib
import sys

from pagedllm.entrypoints.engine_args import add_engine_flags, engine_kwargs, flag, flag_named_error

# Chat's sampling where neither a flag nor the model's generation_config sets it: greedy decoding of a small chat
# model loops on one sentence (benchmarks/chat_loops.py, benchmarks/NOTES.md "Chat sampling defaults").
CHAT_SAMPLING = {"temperature": 0.7, "top_p": 0.9, "repetition_penalty": 1.1}
GENERATE_SAMPLING = {"temperature": 0.0}  # generate: greedy, one completion for a prompt
SAMPLING_FLAGS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def add_common_flags(parser: argparse.ArgumentParser, command: str) -> None:
    group = parser.add_argument_group("sampling")
    group.add_argument("--max-tokens", type=int, default=256, help="most tokens to generate per answer (256)")
    group.description = (
        f"default: the model's generation_config, else {describe_settings(CHAT_SAMPLING)} (the rest off); "
        "--message is seeded by --seed: the same command gives the same answer"
        if command == "chat"
        else "default: greedy (--temperature 0), the rest off"
    )
    group.add_argument("--temperature", type=float, help="0 = greedy; higher, more varied")
    group.add_argument("--top-p", type=float, help="nucleus sampling mass (1.0 = off)")
    group.add_argument("--top-k", type=int, help="keep the k most likely tokens (0 = off)")
    group.add_argument("--min-p", type=float, help="drop tokens below min-p x the top one's probability (0 = off)")
    group.add_argument("--repetition-penalty", type=float, help="> 1 discourages repeats (1.0 = off)")
    group.add_argument("--stop", action="append", default=[], help="stop at this text (repeat the flag for several)")
    add_engine_flags(parser, command)


def package_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("pagedllm")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "(not installed)"


class PrintVersion(argparse.Action):
    """--version: the version is looked up only when asked for (importlib.metadata would add ~0.1 s to every run)."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        print(f"pagedllm {package_version()}")
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pagedllm",
        description="A small, readable LLM inference engine. Runs the embedded SmolLM2-135M-Instruct "
        "when no --model is given.",
    )
    parser.add_argument("--version", action=PrintVersion, help="print the version and exit")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    chat = commands.add_parser("chat", help="chat in the terminal, answers streamed as they are generated")
    chat.add_argument("--message", help="answer this one message and exit")
    chat.add_argument("--system", help="system prompt for the conversation")
    add_common_flags(chat, "chat")
    generate = commands.add_parser("generate", help="complete prompts given as arguments or in a file")
    generate.add_argument("prompts", nargs="*", help="prompts to complete")
    generate.add_argument("--file", help="a text file with one prompt per line")
    generate.add_argument("--n", type=int, default=1, help="completions per prompt (sample i uses seed + i)")
    generate.add_argument("--logprobs", type=int, help="print each token's logprob and the N most likely tokens")
    add_common_flags(generate, "generate")
    from pagedllm.entrypoints.bench_args import build_parser as build_bench_parser

    bench = commands.add_parser(
        "bench", help="throughput on nano-vllm's workload (scaled on a CPU), against the roofline"
    )
    build_bench_parser(bench)
    from pagedllm.entrypoints.trace_summary import build_parser as build_trace_summary_parser

    trace_summary = commands.add_parser("trace-summary", help="summarise a trace; plot it; draw the KV cache")
    build_trace_summary_parser(trace_summary)
    from pagedllm.entrypoints.openai.cli_args import add_serve_flags

    serve = commands.add_parser("serve", help="an OpenAI-compatible HTTP server (needs pagedllm[serve])")
    add_serve_flags(serve)
    return parser


def run_serve(args: argparse.Namespace) -> None:
    from pagedllm.entrypoints.openai.api_server import run_server  # without the serve extra: an ImportError saying so

    run_server(args)


def make_llm(args: argparse.Namespace):
    from pagedllm import LLM

    return LLM(**engine_kwargs(args, args.command))


def sampling_settings(args: argparse.Namespace, model_defaults: dict) -> tuple[dict, str]:
    """The sampling flags' values and where they come from: each flag given; for the rest, chat takes what the
    model's generation_config sets (`model_defaults`) or, where it sets nothing, CHAT_SAMPLING; generate is greedy."""
    given = {name: getattr(args, name) for name in SAMPLING_FLAGS if getattr(args, name) is not None}
    if args.command != "chat":
        return GENERATE_SAMPLING | given, "generate's default: greedy"
    if model_defaults:
        return model_defaults | given, "the model's generation_config"
    return CHAT_SAMPLING | given, "pagedllm chat's defaults: the model's generation_config sets none"


def sampling_params(args: argparse.Namespace, model_defaults: dict | None = None):
    """The command's SamplingParams (a ValueError names the flag at fault). Chat's --message is seeded with --seed,
    so the same command gives the same answer."""
    from pagedllm.sampling.params import SamplingParams

    settings, _ = sampling_settings(args, model_defaults or {})
    seed = args.seed if args.command == "chat" and args.message is not None else None
    return SamplingParams(
        **settings, stop=args.stop, max_tokens=args.max_tokens, seed=seed, n=getattr(args, "n", 1),
        logprobs=getattr(args, "logprobs", None),
    )  # fmt: skip


def describe_settings(settings: dict) -> str:
    return ", ".join(f"{name} {value:g}" for name, value in settings.items())


def describe_sampling(args: argparse.Namespace, model_defaults: dict) -> str:
    """The chat's start-up line: the settings it samples with and where they come from."""
    settings, source = sampling_settings(args, model_defaults)
    given = [flag(name) for name in SAMPLING_FLAGS if getattr(args, name) is not None]
    return f"sampling with {describe_settings(settings)} ({source}{'; given: ' + ', '.join(given) if given else ''})"


def stream_reply(llm, conversation: list[dict], params) -> str:
    """Print the assistant's answer as it is generated; return the whole answer."""
    engine = llm.llm_engine
    request_id = engine.next_request_id()
    engine.add_request(request_id, llm.chat_prompt(conversation), params)
    text = ""
    try:
        while engine.has_unfinished_requests():
            for output in engine.step():
                new_text = output.outputs[0].text
                print(new_text[len(text) :], end="", flush=True)
                text = new_text
    except KeyboardInterrupt:
        engine.abort_request(request_id)
    print(flush=True)
    return text


CHAT_HELP = (
    "/exit or /quit (or exit, an empty line, Ctrl-D) ends the chat; /reset forgets the conversation; "
    "/system TEXT sets the system prompt and starts over (/system alone removes it); /help shows this"
)
EXIT_WORDS = ("/exit", "/quit", "exit", "quit")


def new_conversation(system: str | None) -> list[dict]:
    return [{"role": "system", "content": system}] if system else []


def chat_command(text: str, system: str | None, conversation: list[dict]) -> tuple[str | None, list[dict]]:
    """A /command typed in the chat: the system prompt and the conversation after it."""
    name, _, argument = text.partition(" ")
    if name == "/reset":
        print("(conversation forgotten)", file=sys.stderr)
        return system, new_conversation(system)
    if name == "/system":
        system = argument.strip() or None
        print(f"(system prompt {'set' if system else 'removed'}; conversation started over)", file=sys.stderr)
        return system, new_conversation(system)
    if name != "/help":
        print(f"unknown command {name}", file=sys.stderr)
    print(CHAT_HELP, file=sys.stderr)
    return system, conversation


def enable_line_editing() -> None:
    """Arrow keys and history for input() in a terminal (GNU readline, where Python has it)."""
    if sys.stdin.isatty():
        with contextlib.suppress(ImportError):  # Python built without readline: plain input()
            import readline  # noqa: F401  (importing it is what turns line editing on)


def run_chat(args: argparse.Namespace) -> None:
    if args.message is not None and not args.message.strip():
        raise ValueError("--message is empty; give the message to answer")
    sampling_params(args)  # the flags' values checked before the model loads
    llm = make_llm(args)
    model_defaults = llm.llm_engine.model_sampling_defaults
    params = sampling_params(args, model_defaults)
    print(f"pagedllm chat: {describe_sampling(args, model_defaults)}", file=sys.stderr)
    system = args.system
    conversation = new_conversation(system)
    if args.message is not None:
        conversation.append({"role": "user", "content": args.message})
        stream_reply(llm, conversation, params)
        return
    enable_line_editing()
    print("Chat with the model; /help lists the commands, an empty line or Ctrl-D ends the chat.", file=sys.stderr)
    while True:
        try:
            message = input("> ")
        except EOFError:
            break
        text = message.strip()
        if not text or text.lower() in EXIT_WORDS:
            break
        if text.startswith("/"):
            system, conversation = chat_command(text, system, conversation)
            continue
        conversation.append({"role": "user", "content": message})
        conversation.append({"role": "assistant", "content": stream_reply(llm, conversation, params)})


def read_prompts(args: argparse.Namespace) -> list[str]:
    prompts = list(args.prompts)
    if args.file:
        try:
            with open(args.file, encoding="utf-8") as handle:
                prompts += [line.rstrip("\n") for line in handle if line.strip()]
        except OSError as error:
            raise ValueError(f"cannot read --file: {error}") from None
    if not prompts:
        raise ValueError("give at least one prompt, as arguments or with --file")
    empty = [index for index, prompt in enumerate(prompts) if not prompt]
    if empty:
        raise ValueError(f"prompt {empty[0]} is empty; give at least one character")
    return prompts


def run_generate(args: argparse.Namespace) -> None:
    prompts = read_prompts(args)
    params = sampling_params(args)
    llm = make_llm(args)
    outputs = llm.generate(prompts, params, use_tqdm=len(prompts) > 1)
    for index, output in enumerate(outputs):
        if len(outputs) > 1:
            print(f"--- [{index}] {output.prompt}")
        for completion in output.outputs:
            if params.n > 1:
                print(f"--- sample {completion.index}")
            print(completion.text, flush=True)
            if completion.logprobs is not None:
                print(describe_logprobs(completion), flush=True)
    tokenizer = llm.get_tokenizer()
    if getattr(tokenizer, "chat_template", None) and any(not c.text.strip() for o in outputs for c in o.outputs):
        print(
            "pagedllm: an answer is empty: this is a chat model, which may end at once on a raw prompt; "
            'try `pagedllm chat --message "..."`',
            file=sys.stderr,
        )


def describe_logprobs(completion) -> str:
    """One line per generated token: its logprob, then the most likely tokens with theirs."""
    lines = []
    for token_id, entries in zip(completion.token_ids, completion.logprobs):
        chosen = entries[token_id]
        top = ", ".join(f"{e.decoded_token!r} {e.logprob:.3f}" for e in sorted(entries.values(), key=lambda e: e.rank))
        lines.append(f"  {chosen.decoded_token!r:>16} {chosen.logprob:8.3f}  rank {chosen.rank:<4} top: {top}")
    lines.append(f"  cumulative logprob {completion.cumulative_logprob:.3f}")
    return "\n".join(lines)


def run_bench(args: argparse.Namespace) -> None:
    from pagedllm.entrypoints.bench import run

    run(args)


def run_trace_summary(args: argparse.Namespace) -> None:
    from pagedllm.entrypoints.trace_summary import run

    run(args)


COMMANDS = {
    "chat": run_chat, "generate": run_generate, "bench": run_bench, "serve": run_serve,
    "trace-summary": run_trace_summary,
}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        COMMANDS[args.command](args)
    except (ValueError, TypeError, OSError, ImportError) as error:
        print(f"pagedllm: error: {flag_named_error(error, args)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
