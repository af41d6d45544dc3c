"""Copy checkpoint tensors (Hugging Face names) into a model's (possibly packed, sharded) parameters.

Every parameter and every shard of a packed parameter must be loaded exactly once; anything left over or
missing is an error that names it.
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn

from pagedllm.loader.checkpoint_tensor import CheckpointTensor, copy_weight

IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def checkpoint_name_to_param(name: str, packed_modules: dict[str, tuple[str, object]]) -> tuple[str, object]:
    """'model.layers.0.self_attn.k_proj.weight' -> ('model.layers.0.self_attn.qkv_proj.weight', 'k')."""
    parts = name.split(".")
    for index, part in enumerate(parts):
        if part in packed_modules:
            packed_name, shard_id = packed_modules[part]
            return ".".join(parts[:index] + [packed_name] + parts[index + 1 :]), shard_id
    return name, None


def expected_loads(model: nn.Module) -> set[tuple[str, object]]:
    shards_of: dict[str, list[object]] = {}
    for packed_name, shard_id in model.packed_modules.values():
        shards_of.setdefault(packed_name, []).append(shard_id)
    expected = set()
    for name, _ in model.named_parameters():
        module_name = name.split(".")[-2]
        for shard_id in shards_of.get(module_name, [None]):
            expected.add((name, shard_id))
    return expected


def load_weights(model: nn.Module, named_tensors: Iterable[tuple[str, CheckpointTensor]], source: str) -> None:
    params = dict(model.named_parameters())
    tied = model.spec.tie_word_embeddings
    loaded: set[tuple[str, object]] = set()
    for name, tensor in named_tensors:
        if name.endswith(IGNORED_SUFFIXES) or (tied and name == "lm_head.weight"):
            continue
        param_name, shard_id = checkpoint_name_to_param(name, model.packed_modules)
        param = params.get(param_name)
        if param is None:
            raise ValueError(f"{source}: unexpected weight {name!r} (no such parameter in {model.spec.architecture})")
        weight_loader = getattr(param, "weight_loader", copy_weight)
        try:
            if shard_id is None:
                weight_loader(param, tensor)
            else:
                weight_loader(param, tensor, shard_id)
        except ValueError as error:
            raise ValueError(f"{source}: weight {name!r}: {error}") from None
        loaded.add((param_name, shard_id))
    missing = sorted(
        f"{name}" + (f" [{shard}]" if shard is not None else "") for name, shard in expected_loads(model) - loaded
    )
    if missing:
        raise ValueError(
            f"{source}: missing weights: {', '.join(missing[:10])}" + (" ..." if len(missing) > 10 else "")
        )
    params.clear()  # a method that converts a weight frees the old one now, not when this function returns
    for module in model.modules():  # every tensor is in: a quantized linear method converts its weight now
        method = getattr(module, "method", None)
        if method is not None:
            method.finish_loading(module)
