"""The CPU kernels' build (runtime/kernels/cpu_build.py): announced with progress, done once,
found again by later starts and by other processes, never twice at once, and still possible
where the cache cannot be written. A fake compiler stands in for g++ (it only writes its
output file and notes its call), so these take no compile time."""

from __future__ import annotations

import fcntl
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from runtime.kernels.cpu_build import SOURCES, built_library, cache_dir, library_name

ROOT = Path(__file__).resolve().parents[1]
FAKE_COMPILER = """#!/bin/sh
echo "$@" >> "{calls}"
while [ $# -gt 0 ]; do
    if [ "$1" = -o ]; then : > "$2"; fi
    shift
done
"""


@pytest.fixture
def compiler(tmp_path: Path) -> Path:
    script = tmp_path / "fake-g++"
    script.write_text(FAKE_COMPILER.format(calls=tmp_path / "calls"))
    script.chmod(0o755)
    return script


def calls(compiler: Path) -> list[str]:
    log = compiler.parent / "calls"
    return log.read_text().splitlines() if log.exists() else []


@pytest.fixture
def kernel_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("RUNTIME_KERNEL_CACHE", str(tmp_path / "cache"))
    return cache_dir()


def test_the_first_build_says_so_and_later_ones_load_it(
    compiler: Path, kernel_cache: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, "runtime.kernels.cpu_build"):
        with built_library(str(compiler)) as library:
            assert library == kernel_cache / library_name() and library.exists()
        log = caplog.text
        assert "compiling the CPU kernels" in log and "once per machine" in log
        assert f"{len(SOURCES)} of {len(SOURCES)} sources compiled" in log
        assert "built the CPU kernels in" in log
        assert len(calls(compiler)) == len(SOURCES) + 1  # each source, then the link
        caplog.clear()
        with built_library(str(compiler)) as again:
            assert again == library
    assert len(calls(compiler)) == len(SOURCES) + 1
    assert "compiling" not in caplog.text


# A second process (a worker, another server) that starts while a build holds the lock.
WAITER = """
import logging, sys
logging.basicConfig(level="INFO", format="%(message)s", stream=sys.stdout)
from runtime.kernels.cpu_build import built_library
with built_library(sys.argv[1]) as library:
    print("loads", library, flush=True)
"""


def test_a_process_that_starts_during_a_build_waits_for_it(
    compiler: Path, kernel_cache: Path
) -> None:
    target = kernel_cache / library_name()
    kernel_cache.mkdir(parents=True)
    with open(target.with_suffix(".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # this test is the process that builds
        waiter = subprocess.Popen(
            [sys.executable, "-c", WAITER, str(compiler)],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            text=True,
            env=os.environ | {"RUNTIME_KERNEL_CACHE": str(kernel_cache.parent)},
        )
        try:
            assert waiter.stdout is not None
            assert "waiting for it" in waiter.stdout.readline()
            target.write_bytes(b"built by the first process")
        except BaseException:
            waiter.kill()
            waiter.wait()
            raise
    out, _ = waiter.communicate(timeout=30)
    assert waiter.returncode == 0
    assert out.strip() == f"loads {target}"
    assert calls(compiler) == []  # it compiled nothing itself


def test_an_unwritable_cache_builds_for_this_process_only(
    compiler: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("")  # no directory can be made under it, even by root
    monkeypatch.setenv("RUNTIME_KERNEL_CACHE", str(not_a_folder))
    with built_library(str(compiler)) as library:
        assert library.exists() and not library.is_relative_to(not_a_folder)
    assert not library.parent.exists()  # removed once loaded
    assert "cannot write the kernel cache" in caplog.text
    assert "RUNTIME_KERNEL_CACHE" in caplog.text
    assert len(calls(compiler)) == len(SOURCES) + 1
