"""pagedllm/envs.py: every environment variable declared once and read when asked for (not at import), and no other
module of the package reads the environment."""

from __future__ import annotations

from pathlib import Path

import pytest

import pagedllm
from pagedllm import envs

PACKAGE = Path(pagedllm.__file__).parent
DESIGN = PACKAGE.parent / "docs" / "design.md"


def test_each_variable_is_declared_once_with_a_doc():
    names = [variable.name for variable in envs.ALL]
    assert len(names) == len(set(names))
    declared = {value.name for value in vars(envs).values() if isinstance(value, envs.EnvVar)}
    assert declared == set(names)  # ALL lists every declaration
    assert all(variable.doc for variable in envs.ALL)
    torchrun = {variable.name for variable in envs.ALL if variable.set_by == "torchrun"}
    assert torchrun == {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}


def test_docs_list_every_pagedllm_variable():
    text = DESIGN.read_text()
    missing = [variable.name for variable in envs.ALL if variable.set_by != "torchrun" and variable.name not in text]
    assert not missing, f"docs/design.md does not list {missing}"


def test_values_are_read_when_asked_for(monkeypatch):
    monkeypatch.delenv("PAGEDLLM_SKINNY_GEMM", raising=False)
    assert envs.SKINNY_GEMM.get() is True
    monkeypatch.setenv("PAGEDLLM_SKINNY_GEMM", "0")
    assert envs.SKINNY_GEMM.get() is False
    monkeypatch.setenv("PAGEDLLM_SKINNY_GEMM", "")  # empty: as if unset
    assert envs.SKINNY_GEMM.get() is True
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", "/tmp/somewhere")
    assert envs.CACHE_DIR.get() == Path("/tmp/somewhere")
    monkeypatch.setenv("MASTER_PORT", "29500")
    assert envs.MASTER_PORT.get() == 29500
    monkeypatch.delenv("RANK", raising=False)
    assert envs.RANK.get() is None


@pytest.mark.parametrize(("text", "value"), [("1", True), ("true", True), ("ON", True), ("0", False), ("no", False)])
def test_switches_take_the_usual_words(monkeypatch, text, value):
    monkeypatch.setenv("PAGEDLLM_FUSED_SAMPLER", text)
    assert envs.FUSED_SAMPLER.get() is value


def test_a_value_that_does_not_parse_names_the_variable(monkeypatch):
    monkeypatch.setenv("PAGEDLLM_COMPILE", "maybe")
    with pytest.raises(ValueError, match="PAGEDLLM_COMPILE='maybe'"):
        envs.COMPILE.get()
    monkeypatch.setenv("WORLD_SIZE", "two")
    with pytest.raises(ValueError, match="WORLD_SIZE='two'"):
        envs.WORLD_SIZE.get()


def test_only_envs_reads_the_environment():
    readers = [
        str(path.relative_to(PACKAGE))
        for path in PACKAGE.rglob("*.py")
        if path.name != "envs.py" and any(word in path.read_text() for word in ("os.environ", "getenv", "environ["))
    ]
    assert not readers, f"read the environment through pagedllm/envs.py instead: {readers}"
