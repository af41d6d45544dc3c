"""Shared fixtures: tiny random checkpoints written with transformers' save_pretrained, and their tokenizer; the
embedded default model's checkpoint (its tokenizer takes seconds to build, so once per session) and its transformers
reference (transformers' GGUF loader takes half a minute on two cores, so once per session too); `pagedllm serve` on the
default model, shared by the server tests that need it (a start takes 20-30 s on two cores).

No model hub is reachable, so the tokenizer is a byte-level BPE trained here on a few sentences.

The README's test command runs two pytest-xdist workers (`-n 2`, one per core of a 2-core machine; `--dist loadgroup`
from pyproject.toml). Each worker and every process it starts computes on one thread: two workers that each used
both cores would oversubscribe them, and OpenMP's spinning threads make that far slower than one thread each. A
file's tests run in one worker, so that its module fixtures start once; the tests that share the session's
default-model fixtures (its server, its transformers reference) all run in one worker, so that those start once too.
"""

from __future__ import annotations

import os

UNDER_XDIST = "PYTEST_XDIST_WORKER" in os.environ
if UNDER_XDIST:  # before torch and numpy are imported: their thread pools read these once
    for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(name, "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast  # noqa: E402

if UNDER_XDIST:
    torch.set_num_threads(1)  # in case a plugin imported torch before the variables above were set

SHARED_DEFAULT_MODEL = {"default_server", "default_reference"}  # session fixtures worth starting once


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which turns these marks into the groups it schedules by
def pytest_collection_modifyitems(items):
    """xdist groups (--dist loadgroup): the tests of one file run in one worker, so that its module fixtures start
    once; the tests that use the default model's shared fixtures, in whichever file, all in one worker."""
    for item in items:
        shared = SHARED_DEFAULT_MODEL & set(getattr(item, "fixturenames", ()))
        item.add_marker(pytest.mark.xdist_group("default_model" if shared else item.nodeid.split("::")[0]))


VOCAB_SIZE = 384
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paged attention keeps the KV cache in fixed-size blocks.",
    "def add(a, b):\n    return a + b\n",
    "Paris is the capital of France. Berlin is the capital of Germany.",
    "0123456789 + - * / = ( ) [ ] { }",
] * 20

TINY = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=1024,
    initializer_range=0.1,
    bos_token_id=1,
    eos_token_id=None,
    pad_token_id=0,
)

# name -> (model_type, config overrides)
TINY_MODELS = {
    "llama_gqa_untied": ("llama", dict(num_key_value_heads=2, tie_word_embeddings=False)),
    "llama3_rope_tied": (
        "llama",
        dict(
            num_key_value_heads=1,
            tie_word_embeddings=True,
            rope_theta=500000.0,
            rope_scaling=dict(
                rope_type="llama3",
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=64,
            ),
        ),
    ),
    "qwen3": ("qwen3", dict(num_key_value_heads=2, head_dim=32, tie_word_embeddings=True, rope_theta=1e6)),
    "qwen2_bias": ("qwen2", dict(num_key_value_heads=2, tie_word_embeddings=False, rope_theta=1e6)),
    "mistral": ("mistral", dict(num_key_value_heads=2, tie_word_embeddings=False, sliding_window=None)),
}


def train_tokenizer() -> PreTrainedTokenizerFast:
    tokenizer = Tokenizer(models.BPE(unk_token=None))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=["<pad>", "<s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", pad_token="<pad>")


def make_config(model_type: str, overrides: dict):
    config = AutoConfig.for_model(model_type, **{**TINY, **overrides})
    config.architectures = [type(AutoModelForCausalLM.from_config(config)).__name__]
    return config


def write_tiny_model(directory, name: str, seed: int = 0):
    model_type, overrides = TINY_MODELS[name]
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(make_config(model_type, overrides)).to(torch.float32).eval()
    model.save_pretrained(directory)
    train_tokenizer().save_pretrained(directory)
    return model


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory) -> dict[str, str]:
    """Every tiny checkpoint, written once per test session."""
    dirs = {}
    for name in TINY_MODELS:
        directory = tmp_path_factory.mktemp(name)
        write_tiny_model(directory, name)
        dirs[name] = str(directory)
    return dirs


@pytest.fixture(scope="session")
def llama_dir(tiny_model_dirs) -> str:
    return tiny_model_dirs["llama_gqa_untied"]


def local_worker(llm):
    """The Worker in this process: the engine's executor, or under tensor parallelism rank 0's."""
    from pagedllm.executor.distributed_executor import DistributedExecutor

    executor = llm.llm_engine.worker
    return executor.worker if isinstance(executor, DistributedExecutor) else executor


def capture_logits(llm) -> list[torch.Tensor]:
    """Record every logits tensor the engine computes (rows = sequences sampled that step; rank 0's model under
    tensor parallelism, whose compute_logits returns the gathered logits)."""
    model = local_worker(llm).model
    captured = []
    original = model.compute_logits

    def recording(hidden):
        logits = original(hidden)
        captured.append(logits.detach().clone())
        return logits

    model.compute_logits = recording
    return captured


@pytest.fixture(scope="session")
def default_checkpoint():
    """The embedded default model's checkpoint and tokenizer, opened as the engine opens them (no weights read)."""
    from pagedllm.loader.checkpoint import open_checkpoint

    return open_checkpoint(None, write_cache=False)


@pytest.fixture(scope="session")
def default_reference():
    """transformers' model of the embedded default GGUF, dequantized to float32 by transformers' own loader: the
    oracle for the default model's outputs."""
    from pagedllm.loader.default_model import default_model_path

    path = default_model_path()
    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def default_server(tmp_path_factory):
    """`pagedllm serve` on the embedded default model (max_model_len 1024, weights dequantized), its served name in
    .model; stopped at the end of the session with SIGTERM, which it must meet with status 0, having logged no
    traceback."""
    import httpx
    from server_process import start_server, stop_server

    log = tmp_path_factory.mktemp("default_server") / "server.log"
    # Dequantized: the tests that share it compare its logprobs with transformers' float32 model of the same file
    running = start_server(None, log, "--max-model-len", "1024", "--quantization", "none")
    running.model = httpx.get(f"{running.base_url}/v1/models").json()["data"][0]["id"]
    yield running
    status = stop_server(running)
    assert status == 0 and "Traceback" not in running.log(), f"status {status}:\n{running.log()}"
