"""Every user mistake is a clear ValueError/TypeError before anything is scheduled, and the engine keeps serving.

One table: each case names what is called, with what input, the exception it must raise and words its message must
contain. After every case a good greedy request gives the same tokens as before the case, and no KV block is held.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import VOCAB_SIZE, train_tokenizer
from safetensors import torch as safetensors_torch
from tokenizers import normalizers

from pagedllm import LLM, SamplingParams, StructuredOutputsParams
from pagedllm.layers.linear import ColumnParallelLinear

GOOD = {"prompt_token_ids": [5, 6, 7]}
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
REJECTING_TEMPLATE = "{{ raise_exception('roles must alternate user/assistant') }}"
USER = {"role": "user", "content": "Hi"}
CONFIG = "config.py"  # construction-time cases that must fail in EngineConfig, before any file is read


@dataclass
class Context:
    llm: LLM  # the shared engine every prompt case runs against
    model_dirs: dict[str, str]
    tmp_path: Path


@dataclass(frozen=True)
class CheckpointEdit:
    """A copy of one tiny checkpoint, changed in one way; `words` may name the copy as {path}."""

    model: str = "llama_gqa_untied"
    config: dict | None = None  # config.json keys to overwrite
    tensors: dict | None = None  # tensor name -> new shape (zeros), or None to delete it
    truncate_to: float | None = None  # keep this fraction of model.safetensors' bytes

    def apply(self, source: str, destination: Path) -> Path:
        shutil.copytree(source, destination)
        if self.config:
            config = json.loads((destination / "config.json").read_text())
            (destination / "config.json").write_text(json.dumps({**config, **self.config}))
        weights_file = destination / "model.safetensors"
        if self.tensors:
            weights = safetensors_torch.load_file(weights_file)
            for name, shape in self.tensors.items():
                if shape is None:
                    del weights[name]
                else:
                    weights[name] = torch.zeros(shape)
            safetensors_torch.save_file(weights, weights_file)
        if self.truncate_to is not None:
            data = weights_file.read_bytes()
            weights_file.write_bytes(data[: int(len(data) * self.truncate_to)])
        return destination


def generate_in_batch(ctx: Context, prompt):
    """The bad prompt second in a batch: the good one before it must not be left queued."""
    return ctx.llm.generate([GOOD, prompt], GREEDY, use_tqdm=False)


def generate(ctx: Context, prompts):
    return ctx.llm.generate(prompts, GREEDY, use_tqdm=False)


def add_request(ctx: Context, prompt):
    return ctx.llm.llm_engine.add_request("user-0", prompt, GREEDY)


def generate_with_params(ctx: Context, sampling_params):
    return ctx.llm.generate([GOOD] * 3, sampling_params, use_tqdm=False)


def chat(ctx: Context, messages):
    return ctx.llm.chat(messages, GREEDY, use_tqdm=False, chat_template=TEMPLATE)


def chat_prompt(ctx: Context, conversation):
    return ctx.llm.chat_prompt(conversation, chat_template=TEMPLATE)


def chat_with_rejecting_template(ctx: Context, messages):
    return ctx.llm.chat(messages, GREEDY, use_tqdm=False, chat_template=REJECTING_TEMPLATE)


def generate_while_user_request_runs(ctx: Context, user_request_id):
    engine = ctx.llm.llm_engine
    engine.add_request(user_request_id, GOOD, GREEDY)
    try:
        return ctx.llm.generate(GOOD, GREEDY, use_tqdm=False)
    finally:
        engine.abort_request(user_request_id)


def structured_outputs(ctx: Context, kwargs):
    return StructuredOutputsParams(**kwargs)


def generate_constrained(ctx: Context, kwargs):
    """The bad constraint second in a batch: the first request runs while it compiles, and is aborted when it fails."""
    params = SamplingParams(temperature=0, max_tokens=4, structured_outputs=StructuredOutputsParams(**kwargs))
    return ctx.llm.generate([GOOD, GOOD], [GREEDY, params], use_tqdm=False)


def sampling_params(ctx: Context, kwargs):
    return SamplingParams(**kwargs)


def build_llm(ctx: Context, kwargs):
    return LLM(ctx.model_dirs["llama_gqa_untied"], **kwargs)


def build_llm_from(ctx: Context, model):
    return LLM(model)


def load_edited(ctx: Context, edit: CheckpointEdit):
    directory = edit.apply(ctx.model_dirs[edit.model], ctx.tmp_path / "model")
    return LLM(str(directory), num_kv_blocks=8)


def load_file(ctx: Context, name_and_bytes):
    name, data = name_and_bytes
    path = ctx.tmp_path / name
    path.write_bytes(data)
    return LLM(str(path))


def column_loader(ctx: Context, shape):
    """ColumnParallelLinear's own loader (the models use its merged and qkv subclasses)."""
    layer = ColumnParallelLinear(64, 128)
    return layer.weight_loader(layer.weight, torch.zeros(shape))


@dataclass(frozen=True)
class Case:
    call: Callable
    input: object
    error: type[Exception]
    words: tuple[str, ...]
    raised_in: str | None = None  # the file whose code must raise it (CONFIG: before the checkpoint is read)


def case(call, value, error, *words, raised_in=None, id):
    return pytest.param(Case(call, value, error, words, raised_in), id=id)


def resized(name: str, shape: tuple[int, ...], model: str = "llama_gqa_untied") -> CheckpointEdit:
    return CheckpointEdit(model=model, tensors={name: shape})


LAYER0 = "model.layers.0"
# fmt: off
CASES = [
    # --- prompts (issue 7, points 1 and 7) ---
    case(generate_in_batch, "", ValueError, "prompts[1]", "empty", id="empty-text"),
    case(generate_in_batch, "   ", ValueError, "prompts[1]", "tokenizes to zero tokens", id="zero-token-in-batch"),
    case(generate, "   ", ValueError, "tokenizes to zero tokens", id="zero-token-alone"),
    case(generate, {"prompt": "  "}, ValueError, "tokenizes to zero tokens", id="zero-token-prompt-dict"),
    case(generate_in_batch, {"prompt_token_ids": []}, ValueError, "non-empty", id="empty-ids"),
    case(generate_in_batch, {"prompt_token_ids": [5, VOCAB_SIZE]}, ValueError,
         f"outside the vocabulary [0, {VOCAB_SIZE})", id="id-past-vocab"),
    case(generate_in_batch, {"prompt_token_ids": [-1]}, ValueError, "outside the vocabulary", id="negative-id"),
    case(generate_in_batch, {"prompt_token_ids": [5] * 64}, ValueError, "64 tokens, but max_model_len is 64",
         id="prompt-at-max-model-len"),
    case(generate_in_batch, {"prompt_token_ids": [5] * 100}, ValueError, "100 tokens, but max_model_len is 64",
         id="prompt-past-max-model-len"),
    case(generate_in_batch, 42, TypeError, "prompts[1]", "prompt must be a str", "got int 42", id="prompt-int"),
    case(generate_in_batch, None, TypeError, "prompt must be a str", "NoneType", id="prompt-none"),
    case(generate_in_batch, 1.5, TypeError, "prompt must be a str", "float 1.5", id="prompt-float"),
    case(generate_in_batch, b"hi", TypeError, "prompt must be a str", "bytes", "decode", id="prompt-bytes"),
    case(generate, 42, TypeError, "prompt must be a str", "int 42", id="prompts-not-a-list"),
    case(generate_in_batch, {"prompt_token_ids": [[5, 6], [7]]}, TypeError, "prompt_token_ids",
         "flat list of ints", "item 0 is list", id="nested-ids"),
    case(generate_in_batch, {"prompt_token_ids": [5.0, 6.0]}, TypeError, "prompt_token_ids", "item 0 is float",
         id="float-ids"),
    case(generate_in_batch, {"prompt_token_ids": [5, True]}, TypeError, "prompt_token_ids", "item 1 is bool",
         id="bool-ids"),
    case(generate_in_batch, {"prompt_token_ids": np.array([1, 0], dtype=bool)}, TypeError, "prompt_token_ids",
         "integer dtype", "bool", id="bool-numpy-ids"),
    case(generate_in_batch, {"prompt_token_ids": np.array([[5, 6]])}, TypeError, "prompt_token_ids", "1-D", "2-D",
         id="2d-numpy-ids"),
    case(generate_in_batch, {"prompt_token_ids": None}, TypeError, "prompt_token_ids must be a list of ints",
         id="ids-none"),
    case(generate_in_batch, {"prompt_token_ids": "5 6"}, TypeError, "prompt_token_ids must be a list of ints",
         id="ids-str"),
    case(generate_in_batch, {"prompt": 5}, TypeError, "prompt['prompt'] must be a str", id="prompt-dict-int-text"),
    case(generate_in_batch, {"text": "hi"}, ValueError, "unsupported key", "'text'", id="prompt-dict-unknown-key"),
    case(generate_in_batch, {}, ValueError, "neither 'prompt' nor 'prompt_token_ids'", id="prompt-dict-empty"),
    case(generate_in_batch, "caf\udce9", ValueError, "prompt", "lone surrogate", "U+DCE9", id="lone-surrogate"),
    case(add_request, 1.5, TypeError, "prompt must be a str", id="add-request-float"),
    case(add_request, "   ", ValueError, "tokenizes to zero tokens", id="add-request-zero-tokens"),
    # --- chat (point 7) ---
    case(chat, [{"role": "user"}], ValueError, "messages[0]", "no 'content' key", id="chat-no-content"),
    case(chat, [USER, {"content": "x"}], ValueError, "messages[1]", "no 'role' key", id="chat-no-role"),
    case(chat, [USER, {"role": "user", "content": None}], TypeError, "messages[1]['content']", "must be a str",
         id="chat-content-none"),
    case(chat, [{"role": 1, "content": "x"}], TypeError, "messages[0]['role']", "must be a str", id="chat-role-int"),
    case(chat, [USER, "hello"], TypeError, "messages[1]", "must be a dict", id="chat-message-str"),
    case(chat, [[USER], [USER, {"role": "user"}]], ValueError, "messages[1][1]", "'content'",
         id="chat-second-conversation"),
    case(chat, [[USER], []], ValueError, "messages[1]", "empty conversation", id="chat-empty-conversation"),
    case(chat, "Hi", TypeError, "messages must be", id="chat-str"),
    case(chat, [{"role": "user", "content": "caf\udce9"}], ValueError, "messages[0]['content']", "lone surrogate",
         id="chat-lone-surrogate"),
    case(chat_prompt, [{"role": "user"}], ValueError, "conversation[0]", "'content'", id="chat-prompt-no-content"),
    case(chat_with_rejecting_template, [USER], ValueError, "chat template rejected", "roles must alternate",
         id="chat-template-raises"),
    # --- generate()'s own arguments and request ids (points 5 and 7) ---
    case(generate_with_params, "greedy", TypeError, "sampling_params must be a SamplingParams", "str",
         id="sampling-params-str"),
    case(generate_with_params, [GREEDY, GREEDY, {"temperature": 0}], TypeError, "sampling_params[2]", "dict",
         id="sampling-params-list-of-dicts"),
    case(generate_with_params, [GREEDY, GREEDY], ValueError, "got 2 SamplingParams for 3 prompts",
         id="sampling-params-count"),
    case(generate_while_user_request_runs, "0", ValueError, "generate() cannot run", "'0'", "abort_request",
         id="generate-while-user-request-0"),
    case(generate_while_user_request_runs, "generate-0", ValueError, "generate() cannot run", "'generate-0'",
         id="generate-while-user-request-generate-0"),
    # --- SamplingParams (kept from before; the sampling helper owns the rest) ---
    case(sampling_params, dict(temperature=-0.5), ValueError, "temperature must be >= 0", id="sp-temperature"),
    case(sampling_params, dict(top_p=0.0), ValueError, "top_p must be in", id="sp-top-p-0"),
    case(sampling_params, dict(top_p=1.5), ValueError, "top_p must be in", id="sp-top-p-1.5"),
    case(sampling_params, dict(top_k=-2), ValueError, "top_k must be an int >= -1", id="sp-top-k"),
    case(sampling_params, dict(max_tokens=0), ValueError, "max_tokens must be an int >= 1", id="sp-max-tokens"),
    case(sampling_params, dict(stop_token_ids=[-3]), ValueError, "stop_token_ids", id="sp-stop-token-ids"),
    case(sampling_params, dict(seed="x"), TypeError, "seed must be an int", id="sp-seed"),
    case(sampling_params, dict(seed=True), TypeError, "seed must be an int", id="sp-seed-bool"),
    case(sampling_params, dict(seed=2**64), ValueError, "seed must be an int in", id="sp-seed-2**64"),
    case(sampling_params, dict(top_k=2**63), ValueError, "top_k must be an int", id="sp-top-k-2**63"),
    case(sampling_params, dict(temperature="0.5"), TypeError, "temperature must be a number", id="sp-temperature-str"),
    case(sampling_params, dict(temperature=None), TypeError, "temperature must be a number", id="sp-temperature-none"),
    case(sampling_params, dict(temperature=float("nan")), ValueError, "finite", id="sp-temperature-nan"),
    case(sampling_params, dict(stop_token_ids=5), TypeError, "stop_token_ids must be a list", id="sp-stop-ids-int"),
    case(sampling_params, dict(n=0), ValueError, "n must be an int >= 1", id="sp-n"),
    case(sampling_params, dict(n=2, seed=2**64 - 1), ValueError, "seed + n - 1 must be", id="sp-n-seed"),
    # --- SamplingParams against the model and the engine (issue 9): refused at add_request, nothing queued ---
    case(generate_with_params, SamplingParams(stop_token_ids=[5, VOCAB_SIZE]), ValueError, "stop_token_ids",
         f"token id {VOCAB_SIZE} outside the vocabulary [0, {VOCAB_SIZE})", id="sp-stop-token-past-vocab"),
    case(generate_with_params, SamplingParams(logit_bias={VOCAB_SIZE + 3: 1.0}), ValueError, "logit_bias",
         f"token id {VOCAB_SIZE + 3} outside the vocabulary", id="sp-logit-bias-past-vocab"),
    case(generate_with_params, SamplingParams(logprobs=VOCAB_SIZE + 1), ValueError, "logprobs must be in",
         f"[0, {VOCAB_SIZE}]", id="sp-logprobs-past-vocab"),
    case(generate_with_params, SamplingParams(prompt_logprobs=VOCAB_SIZE + 1), ValueError, "prompt_logprobs",
         id="sp-prompt-logprobs-past-vocab"),
    case(generate_with_params, SamplingParams(n=300), ValueError, "n=300", "max_num_seqs=256", id="sp-n-past-max-seqs"),
    # --- structured outputs: refused when built, or when compiled (off the step path, while the others run) ---
    case(structured_outputs, dict(json="{not json"), ValueError, "structured_outputs.json is not valid JSON",
         id="so-json-malformed"),
    case(structured_outputs, dict(regex="a", choice=["b"]), ValueError, "exactly one of", "got regex, choice",
         id="so-two-constraints"),
    case(structured_outputs, dict(choice=[]), ValueError, "at least one string", id="so-choice-empty"),
    case(generate_constrained, dict(json={"type": "object", "properties": {"a": {"type": "nope"}}}), ValueError,
         "prompts[1]: structured_outputs.json", "Invalid type: nope", id="so-json-bad-type"),
    case(generate_constrained, dict(json={"type": "object", "if": {"type": "object"}}), ValueError,
         "structured_outputs.json", "Unimplemented keys", '"if"', id="so-json-unsupported-keyword"),
    case(generate_constrained, dict(regex="a(b"), ValueError, "structured_outputs.regex cannot be compiled",
         "unclosed group", id="so-regex"),
    case(generate_constrained, dict(grammar="start: foo"), ValueError, "structured_outputs.grammar",
         'unknown name: "foo"', id="so-grammar"),
    # --- LLM() settings (point 4, and point 7's dtype=[]): EngineConfig refuses them before any file is read ---
    case(build_llm, dict(gpu_memory_utilisation=0.5), TypeError, "unknown LLM argument", "gpu_memory_utilization",
         raised_in=CONFIG, id="llm-unknown-keyword"),
    case(build_llm, dict(block_size=24), ValueError, "block_size", "power of two", raised_in=CONFIG,
         id="llm-block-size"),
    case(build_llm, dict(max_num_seqs=0), ValueError, "max_num_seqs must be a positive int", raised_in=CONFIG,
         id="llm-max-num-seqs-0"),
    case(build_llm, dict(max_num_seqs=True), TypeError, "max_num_seqs must be a positive int", "bool",
         raised_in=CONFIG, id="llm-max-num-seqs-bool"),
    case(build_llm, dict(num_kv_blocks=8.0), TypeError, "num_kv_blocks", "float", raised_in=CONFIG,
         id="llm-num-kv-blocks-float"),
    case(build_llm, dict(enable_prefix_caching=1), TypeError, "enable_prefix_caching must be True or False",
         raised_in=CONFIG, id="llm-bool-setting-int"),
    case(build_llm, dict(async_scheduling="yes"), TypeError, "async_scheduling must be True, False or None",
         raised_in=CONFIG, id="llm-async-scheduling-str"),
    case(build_llm, dict(gpu_memory_utilization=float("nan")), ValueError, "gpu_memory_utilization",
         raised_in=CONFIG, id="llm-gpu-memory-utilization-nan"),
    case(build_llm, dict(dtype="int8"), ValueError, "dtype must be", "float16", raised_in=CONFIG, id="llm-dtype-int8"),
    case(build_llm, dict(dtype=[]), TypeError, "dtype must be", "got list", raised_in=CONFIG, id="llm-dtype-list"),
    case(build_llm, dict(dtype=torch.float64), ValueError, "dtype must be", raised_in=CONFIG, id="llm-dtype-float64"),
    case(build_llm, dict(seed=True), TypeError, "seed must be an int from 0 to 2**64 - 1", "bool", raised_in=CONFIG,
         id="llm-seed-bool"),
    case(build_llm, dict(seed=2**64), ValueError, "seed must be an int from 0 to 2**64 - 1", raised_in=CONFIG,
         id="llm-seed-2**64"),
    case(build_llm, dict(seed=-1), ValueError, "seed must be", raised_in=CONFIG, id="llm-seed-negative"),
    case(build_llm, dict(seed="0"), TypeError, "seed must be", raised_in=CONFIG, id="llm-seed-str"),
    case(build_llm, dict(device="tpu"), ValueError, "device must be", "'auto'", "'cpu'", raised_in=CONFIG,
         id="llm-device-tpu"),
    case(build_llm, dict(device=7), TypeError, "device must be", "'cpu'", raised_in=CONFIG, id="llm-device-int"),
    case(build_llm, dict(device="meta"), ValueError, "device must be", "'cpu'", raised_in=CONFIG,
         id="llm-device-meta"),
    case(build_llm, dict(device="cuda:99"), ValueError, "device must be", raised_in=CONFIG, id="llm-device-no-gpu"),
    case(build_llm, dict(device="cpu", attention_backend="triton"), ValueError, "attention_backend='triton'", "CUDA",
         raised_in=CONFIG, id="llm-triton-on-cpu"),
    case(build_llm, dict(attention_backend="flash"), ValueError, "attention_backend must be", "'torch'",
         raised_in=CONFIG, id="llm-attention-backend-unknown"),
    case(build_llm, dict(tokenizer="/nonexistent/tokenizer"), ValueError, "tokenizer", "/nonexistent/tokenizer",
         raised_in=CONFIG, id="llm-tokenizer-missing"),
    case(build_llm_from, 123, TypeError, "model must be", "int 123", raised_in=CONFIG, id="llm-model-int"),
    case(build_llm, dict(max_model_len=10**6), ValueError, "exceeds the model's limit of 1024",
         id="llm-max-model-len"),
    case(build_llm, dict(tensor_parallel_size=3), ValueError, "tensor_parallel_size", id="llm-tensor-parallel-size"),
    case(build_llm_from, "/nonexistent/model", ValueError, "neither a Hugging Face model directory nor a .gguf file",
         id="llm-model-missing"),
    # --- checkpoints (points 2 and 4): the source, the tensor, its shape and the shape the config implies ---
    case(load_edited, CheckpointEdit(config=dict(intermediate_size=64)), ValueError, "{path}", "mlp.",
         "shape (64, 128)", "implies (64, 64)", id="config-intermediate-size-smaller"),
    case(load_edited, CheckpointEdit(config=dict(intermediate_size=256)), ValueError, "{path}", "mlp.",
         "shape (64, 128)", "implies (64, 256)", id="config-intermediate-size-larger"),
    case(load_edited, CheckpointEdit(config=dict(num_key_value_heads=1)), ValueError, "{path}",
         f"'{LAYER0}.self_attn.k_proj.weight'", "shape (32, 64)", "implies (16, 64)", id="config-kv-heads-smaller"),
    case(load_edited, CheckpointEdit(config=dict(num_key_value_heads=4)), ValueError, "{path}",
         f"'{LAYER0}.self_attn.k_proj.weight'", "shape (32, 64)", "implies (64, 64)", id="config-kv-heads-larger"),
    case(load_edited, resized(f"{LAYER0}.mlp.gate_proj.weight", (129, 64)), ValueError, "{path}",
         f"'{LAYER0}.mlp.gate_proj.weight'", "shape (129, 64)", "implies (128, 64)", id="merged-column-gate"),
    case(load_edited, resized(f"{LAYER0}.mlp.up_proj.weight", (127, 64)), ValueError,
         f"'{LAYER0}.mlp.up_proj.weight'", "shape (127, 64)", "implies (128, 64)", id="merged-column-up"),
    case(load_edited, resized(f"{LAYER0}.self_attn.q_proj.weight", (96, 64)), ValueError,
         f"'{LAYER0}.self_attn.q_proj.weight'", "shape (96, 64)", "implies (64, 64)", id="qkv-q"),
    case(load_edited, resized(f"{LAYER0}.self_attn.k_proj.weight", (16, 64)), ValueError,
         f"'{LAYER0}.self_attn.k_proj.weight'", "shape (16, 64)", "implies (32, 64)", id="qkv-k"),
    case(load_edited, resized(f"{LAYER0}.self_attn.v_proj.weight", (32, 65)), ValueError,
         f"'{LAYER0}.self_attn.v_proj.weight'", "shape (32, 65)", "implies (32, 64)", id="qkv-v"),
    case(load_edited, resized(f"{LAYER0}.self_attn.k_proj.bias", (33,), model="qwen2_bias"), ValueError,
         f"'{LAYER0}.self_attn.k_proj.bias'", "shape (33,)", "implies (32,)", id="qkv-k-bias"),
    case(load_edited, resized(f"{LAYER0}.self_attn.o_proj.weight", (64, 65)), ValueError,
         f"'{LAYER0}.self_attn.o_proj.weight'", "shape (64, 65)", "implies (64, 64)", id="row-o-proj"),
    case(load_edited, resized(f"{LAYER0}.mlp.down_proj.weight", (64, 96)), ValueError,
         f"'{LAYER0}.mlp.down_proj.weight'", "shape (64, 96)", "implies (64, 128)", id="row-down-proj"),
    case(load_edited, resized("model.embed_tokens.weight", (383, 64)), ValueError, "'model.embed_tokens.weight'",
         "shape (383, 64)", "implies (384, 64)", id="vocab-embedding"),
    case(load_edited, resized("lm_head.weight", (400, 64)), ValueError, "'lm_head.weight'", "shape (400, 64)",
         "implies (384, 64)", id="lm-head"),
    case(load_edited, resized("model.norm.weight", (65,)), ValueError, "'model.norm.weight'", "(65,)", "(64,)",
         id="norm"),
    case(column_loader, (129, 64), ValueError, "shape (129, 64)", "implies (128, 64)", id="column-larger"),
    case(column_loader, (96, 64), ValueError, "shape (96, 64)", "implies (128, 64)", id="column-smaller"),
    case(load_edited, CheckpointEdit(config=dict(architectures=["GPT2LMHeadModel"])), ValueError,
         "unsupported model architecture", "supported: LlamaForCausalLM", id="architecture"),
    case(load_edited, CheckpointEdit(tensors={f"{LAYER0}.self_attn.k_proj.weight": None}), ValueError,
         "missing weights: model.layers.0.self_attn.qkv_proj.weight [k]", id="missing-weight"),
    case(load_edited, CheckpointEdit(tensors={"model.extra.weight": (64,)}), ValueError,
         "unexpected weight 'model.extra.weight'", id="unexpected-weight"),
    case(load_edited, CheckpointEdit(truncate_to=0.5), ValueError, "{path}/model.safetensors", "not a readable",
         id="safetensors-truncated"),
    case(load_edited, CheckpointEdit(truncate_to=0.0), ValueError, "{path}/model.safetensors", "not a readable",
         id="safetensors-empty"),
    case(load_file, ("bad.gguf", b""), ValueError, "bad.gguf", "not a readable GGUF", id="gguf-empty"),
    case(load_file, ("bad.gguf", b"GGUF" + b"\x03" * 20), ValueError, "bad.gguf", "not a readable GGUF",
         id="gguf-truncated"),
]
# fmt: on


@pytest.fixture(scope="module")
def stripping_tokenizer_dir(tmp_path_factory) -> str:
    """The test tokenizer with a normaliser that strips surrounding whitespace, so '   ' tokenizes to nothing."""
    tokenizer = train_tokenizer()
    tokenizer.backend_tokenizer.normalizer = normalizers.Strip()
    directory = tmp_path_factory.mktemp("stripping_tokenizer")
    tokenizer.save_pretrained(directory)
    return str(directory)


@pytest.fixture(scope="module")
def llm(llama_dir, stripping_tokenizer_dir):
    return LLM(llama_dir, tokenizer=stripping_tokenizer_dir, max_model_len=64, num_kv_blocks=32, block_size=16)


@pytest.fixture(scope="module")
def good_tokens(llm) -> list[int]:
    return greedy_tokens(llm, GOOD)


def greedy_tokens(llm: LLM, prompt) -> list[int]:
    return llm.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0].token_ids


def assert_nothing_held(llm: LLM) -> None:
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests() and not engine.requests
    engine.block_manager.check_invariants(holders=[])
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


@pytest.mark.parametrize("bad", CASES)
def test_bad_input_is_a_clear_error_and_the_engine_keeps_serving(bad, llm, good_tokens, tiny_model_dirs, tmp_path):
    with pytest.raises(bad.error) as raised:
        bad.call(Context(llm, tiny_model_dirs, tmp_path), bad.input)
    message = str(raised.value)
    for word in bad.words:
        assert word.replace("{path}", str(tmp_path / "model")) in message, message
    if bad.raised_in is not None:
        assert raised.traceback[-1].path.name == bad.raised_in, f"raised in {raised.traceback[-1].path}"
    assert_nothing_held(llm)
    assert greedy_tokens(llm, GOOD) == good_tokens
    assert_nothing_held(llm)


def test_every_engine_setting_has_a_rule():
    from dataclasses import fields

    from pagedllm.config import FIELD_RULES, EngineConfig

    assert set(FIELD_RULES) == {field.name for field in fields(EngineConfig)}


@pytest.mark.parametrize(
    "same_prompt",
    [
        {"prompt_token_ids": np.array([5, 6, 7])},
        {"prompt_token_ids": np.array([5, 6, 7], dtype=np.int32)},
        {"prompt_token_ids": [np.int64(5), np.int16(6), 7]},
        {"prompt_token_ids": (5, 6, 7)},
    ],
    ids=["ndarray-int64", "ndarray-int32", "numpy-scalars", "tuple"],
)
def test_numpy_and_tuple_token_ids_are_accepted(llm, good_tokens, same_prompt):
    output = llm.generate(same_prompt, GREEDY, use_tqdm=False)[0]
    assert output.prompt_token_ids == [5, 6, 7] and all(type(t) is int for t in output.prompt_token_ids)
    assert output.outputs[0].token_ids == good_tokens
    assert_nothing_held(llm)


def test_text_prompt_dict_equals_the_str(llm):
    text = "The quick brown fox"
    as_dict = llm.generate({"prompt": text}, GREEDY, use_tqdm=False)[0]
    assert as_dict.prompt == text
    assert as_dict.outputs[0].token_ids == greedy_tokens(llm, text)


def test_generate_leaves_a_user_request_to_its_owner(llm, good_tokens):
    """A refused generate() queues nothing: the user's streamed request still gets all its tokens, and generate()
    works once it is done, whatever id the user picked."""
    engine = llm.llm_engine
    engine.add_request("0", GOOD, GREEDY)
    with pytest.raises(ValueError, match="generate\\(\\) cannot run"):
        llm.generate({"prompt_token_ids": [9, 10]}, GREEDY, use_tqdm=False)
    streamed = []
    while engine.has_unfinished_requests():
        streamed += [output for output in engine.step() if output.request_id == "0"]
    assert streamed[-1].finished and streamed[-1].outputs[0].token_ids == good_tokens
    outputs = llm.generate([GOOD, GOOD], GREEDY, use_tqdm=False)
    assert [output.outputs[0].token_ids for output in outputs] == [good_tokens, good_tokens]
    assert not {output.request_id for output in outputs} & {"0", "1"}
    engine.add_request("0", GOOD, GREEDY)  # the user's ids stay free for the user after generate()
    engine.abort_request("0")
    assert_nothing_held(llm)


def test_request_that_can_never_fit_the_cache(llama_dir):
    llm = LLM(llama_dir, num_kv_blocks=2, block_size=16)
    with pytest.raises(ValueError, match="KV cache holds only 2 blocks"):
        llm.generate({"prompt_token_ids": [5] * 40}, GREEDY, use_tqdm=False)
    assert greedy_tokens(llm, GOOD)
    assert_nothing_held(llm)


def test_generation_stops_at_max_model_len(llm):
    output = llm.generate({"prompt_token_ids": [5] * 60}, SamplingParams(temperature=0, max_tokens=None), False)[0]
    assert output.outputs[0].finish_reason == "length"
    assert len(output.prompt_token_ids) + len(output.outputs[0].token_ids) == 64


def test_stop_token_ids_finish_with_stop(llm, good_tokens):
    params = SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[good_tokens[0]])
    output = llm.generate(GOOD, params, use_tqdm=False)[0].outputs[0]
    assert output.token_ids == [good_tokens[0]] and output.finish_reason == "stop"
