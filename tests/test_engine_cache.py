"""The engine cache of ``tests/engines.py``: a cached binary is proven before it is trusted.

Each test runs ``llama_server()`` over a cache of its own (``WSLB_CACHE_DIR`` in a temp dir,
the model linked from the real cache) with the real, proven llama-server as what a build makes
(the build step is replaced by a copy of it: a real build takes 6 minutes, and what is under
test is the decision to build, not CMake). The proofs are real: the binary loads Gemma and
produces one token, or dies. A binary that dies with SIGILL is a shell script that kills
itself with it, as a binary built for another CPU does at its first instruction it lacks.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import engines
from tests.engines import Build, EngineSetupError

pytestmark = pytest.mark.engine

SIGILL_SCRIPT = "#!/bin/sh\nkill -ILL $$\n"


@pytest.fixture(scope="module")
def good() -> Path:
    """The real cache's proven binary (built here first if need be)."""
    return engines.llama_server()


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, good: Path) -> Iterator[Path]:
    model = engines.gemma_gguf()
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / model.name).symlink_to(model)
    monkeypatch.setenv("WSLB_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(engines, "_PROVEN", {})
    yield tmp_path


class Builder:
    """Stands in for CMake: each build writes ``next`` (the good binary by default)."""

    def __init__(self, good: Path) -> None:
        self.good = good
        self.built: list[str] = []
        self.sigill_for: set[str] = set()

    def __call__(self, build: Build, home: Path) -> Path:
        self.built.append(build.name)
        home.mkdir(parents=True, exist_ok=True)
        binary = home / "llama-server"
        if build.name in self.sigill_for:
            binary.write_text(SIGILL_SCRIPT)
            binary.chmod(0o755)
        else:
            shutil.copy2(self.good, binary)
        return binary


@pytest.fixture
def builder(monkeypatch: pytest.MonkeyPatch, good: Path) -> Builder:
    b = Builder(good)
    monkeypatch.setattr(engines, "_build_into", b)
    return b


def test_every_build_is_portable_and_keyed_by_its_flags() -> None:
    for build in (*engines.X86_BUILDS, *engines.GENERIC_BUILDS):
        flags = (*engines.CMAKE_FLAGS, *build.flags)
        assert "-DGGML_NATIVE=OFF" in flags
        assert not any("native" in f and not f.endswith("=OFF") for f in flags), flags
        if build in engines.X86_BUILDS:
            assert "-DGGML_AVX512=OFF" in flags and "-DGGML_AMX_TILE=OFF" in flags
    keys = {b.key for b in (*engines.X86_BUILDS, *engines.GENERIC_BUILDS)}
    assert len(keys) == 3
    a = Build("x86-64-v3", ("-DGGML_AVX2=ON",))
    assert a.key != Build("x86-64-v3", ("-DGGML_AVX2=ON", "-DGGML_AVX512=ON")).key
    assert a.key.startswith(f"{engines.LLAMA_CPP_PYTHON}-x86-64-v3-")


def test_empty_cache_builds_proves_and_records(cache: Path, builder: Builder) -> None:
    binary = engines.llama_server()
    first = engines.builds()[0]
    assert builder.built == [first.name]
    record = json.loads((binary.parent / "proof.json").read_text())
    assert record["sha256"] == engines._sha256(binary)
    assert record["build"] == first.name and "-DGGML_NATIVE=OFF" in record["flags"]
    # A second call in another process (a fresh _PROVEN) proves it again, builds nothing.
    engines._PROVEN.clear()
    assert engines.llama_server() == binary
    assert builder.built == [first.name]


def test_truncated_binary_is_rebuilt_not_reused(cache: Path, builder: Builder) -> None:
    binary = engines.llama_server()
    engines._PROVEN.clear()
    with binary.open("r+b") as f:
        f.truncate(1_000_000)
    assert engines.llama_server() == binary
    assert len(builder.built) == 2
    assert binary.stat().st_size == builder.good.stat().st_size


def test_binary_from_another_flags_key_is_never_used(cache: Path, builder: Builder) -> None:
    first = engines.builds()[0]
    other = Build(first.name, (*first.flags, "-DGGML_AVX512=ON"))
    stray = builder(other, cache / "llama-server" / other.key)
    builder.built.clear()
    binary = engines.llama_server()
    assert binary != stray and binary.parent.name == first.key
    assert builder.built == [first.name]


def test_cached_binary_that_dies_with_sigill_is_rebuilt(cache: Path, builder: Builder) -> None:
    """It was proven once (its record matches it) and dies now, as a cache carried to another
    CPU would: proven again, found dead, rebuilt."""
    binary = engines.llama_server()
    engines._PROVEN.clear()
    binary.write_text(SIGILL_SCRIPT)
    record = json.loads((binary.parent / "proof.json").read_text())
    record["sha256"] = engines._sha256(binary)
    (binary.parent / "proof.json").write_text(json.dumps(record))
    assert engines.llama_server() == binary
    assert len(builder.built) == 2
    log = (binary.parent / "build.log").read_text()
    assert "cached binary failed its proof" in log and "killed by SIGILL" in log, log


def test_a_build_that_sigills_falls_back_to_the_safer_one(
    cache: Path, builder: Builder, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(engines, "builds", lambda: engines.X86_BUILDS)
    first, safer = engines.X86_BUILDS
    builder.sigill_for = {first.name}
    binary = engines.llama_server()
    assert builder.built == [first.name, safer.name]
    assert binary.parent.name == safer.key
    failed = cache / "llama-server" / first.key / f"failed-{engines.cpu_fingerprint()}.txt"
    why = failed.read_text()
    assert "killed by SIGILL (an instruction this CPU does not run)" in why, why
    assert not (cache / "llama-server" / first.key / "llama-server").exists()
    # Remembered for this CPU: the next run goes straight to the safer build.
    engines._PROVEN.clear()
    assert engines.llama_server() == binary
    assert builder.built == [first.name, safer.name]


def test_no_build_works_names_every_attempt(
    cache: Path, builder: Builder, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(engines, "builds", lambda: engines.X86_BUILDS)
    builder.sigill_for = {b.name for b in engines.X86_BUILDS}
    with pytest.raises(EngineSetupError) as err:
        engines.llama_server()
    text = str(err.value)
    assert "no llama-server build works on this machine" in text
    for b in engines.X86_BUILDS:
        assert f"[{b.name}]" in text
    assert text.count("SIGILL") >= 2


def test_cpu_without_avx2_skips_the_v3_build(monkeypatch: pytest.MonkeyPatch) -> None:
    if os.uname().machine != "x86_64":
        pytest.skip("x86-64 builds")
    monkeypatch.setattr(engines, "cpu_flags", lambda: frozenset({"sse4_2", "avx"}))
    assert [b.name for b in engines.builds()] == ["x86-64-v2"]
