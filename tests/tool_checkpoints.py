"""Tiny Qwen3 checkpoints for the server's tool-call and reasoning tests: a hermes-style chat template that renders
tools, tool calls, tool results and thinking, a tokenizer holding the thinking markers as tokens, and a "scripted"
variant whose greedy reply to any chat prompt is a fixed text (real weights, so the engine runs as for any model)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from conftest import make_config, train_tokenizer
from tokenizers import AddedToken
from transformers import AutoModelForCausalLM

# The thinking markers are single tokens, as the reasoning parsers require; the tool-call markers are plain text (a
# forced output that spells an added token is refused by llguidance 1.9, which treats every added token as special).
MARKERS = ["<think>", "</think>"]

# Qwen-like layout, written for these tests: tools listed in the system turn, calls as <tool_call> JSON blocks,
# results in a user turn, earlier thinking kept, enable_thinking=false closing an empty thinking block.
TOOLS_CHAT_TEMPLATE = (
    "{% if tools or messages[0].role == 'system' %}<|im_start|>system\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}\n{% endif %}"
    "{% if tools %}Functions you may call, one per <tool_call></tool_call> block:\n<tools>\n"
    "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}</tools>{% endif %}<|im_end|>\n"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'tool' %}"
    "<|im_start|>user\n<tool_response>\n{{ message.content }}\n</tool_response><|im_end|>\n"
    "{% elif message.role == 'assistant' %}<|im_start|>assistant\n"
    "{% if message.reasoning_content %}<think>{{ message.reasoning_content }}</think>{% endif %}"
    "{{ message.content or '' }}"
    "{% for call in message.tool_calls or [] %}<tool_call>\n"
    '{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}\n</tool_call>'
    "{% endfor %}<|im_end|>\n"
    "{% elif message.role != 'system' or not loop.first %}"
    "<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}"
    "{% endif %}"
)


def tools_tokenizer():
    tokenizer = train_tokenizer()
    tokenizer.add_tokens([AddedToken(marker, special=False, normalized=False) for marker in MARKERS])
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>"], "eos_token": "<|im_end|>"})
    tokenizer.chat_template = TOOLS_CHAT_TEMPLATE
    return tokenizer


def write_tools_model(directory: Path, script: str | None = None, seed: int = 0) -> str:
    """A tiny untied Qwen3 with the tools tokenizer; with a script, its greedy reply to every chat prompt is the
    script, then <|im_end|>."""
    tokenizer = tools_tokenizer()
    overrides = dict(
        num_key_value_heads=2,
        head_dim=32,
        tie_word_embeddings=False,
        rope_theta=1e6,
        vocab_size=len(tokenizer),
        max_position_embeddings=4096,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(make_config("qwen3", overrides)).to(torch.float32).eval()
    if script is not None:
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
        prompt = prompt["input_ids"] if hasattr(prompt, "keys") else prompt
        chain = [prompt[-1], *tokenizer.encode(script, add_special_tokens=False), tokenizer.eos_token_id]
        script_weights(model, chain)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return str(directory)


def script_weights(model, chain: list[int]) -> None:
    """Make the model a bigram table on the chain: every layer's output projections are zero, so the last hidden
    state is the current token's embedding, and the lm head row of each next token points along it (logit ~32,
    against ~0.2 for the rest). The chain's tokens must be distinct."""
    assert len(set(chain)) == len(chain), "a scripted reply needs distinct tokens"
    embeddings, lm_head = model.model.embed_tokens.weight, model.lm_head.weight
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        lm_head.normal_(0.0, 0.02)
        for token, next_token in zip(chain, chain[1:]):
            hidden = embeddings[token] / embeddings[token].pow(2).mean().sqrt()  # the final RMSNorm (weight 1)
            lm_head[next_token] += 4.0 * hidden / hidden.norm()


def tool_schema(name: str, parameters: dict) -> dict:
    return {"type": "function", "function": {"name": name, "description": f"the {name} tool", "parameters": parameters}}


WEATHER = tool_schema(
    "get_weather",
    {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 8},
            "unit": {"enum": ["celsius", "fahrenheit"]},
            "days": {"type": "integer", "minimum": 1, "maximum": 7},
        },
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
)
TIME = tool_schema(
    "get_time",
    {
        "type": "object",
        "properties": {"zone": {"enum": ["UTC", "CET"]}, "exact": {"type": "boolean"}},
        "required": ["zone"],
        "additionalProperties": False,
    },
)


def hermes_call(name: str, arguments: dict) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"
