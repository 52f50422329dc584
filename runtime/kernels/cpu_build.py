"""Build the CPU kernels' shared library (cpu.py loads it): once per machine and version of
their source, announced in the log, cached where every later start finds it.

The library is keyed by the sources, the flags and the CPU's feature flags (it is built with
-march=native), and lives in `cache_dir()`, which a worker process finds as its parent does
(the same environment). A build compiles each source in parallel, logging each one done with
the time so far, then links; it is written atomically and serialized by a lock file next to
it, so processes starting at once (data-parallel workers, two servers) compile once while the
others wait for it. Where the cache cannot be written, the build goes to a temporary
directory for this process only, with a warning that every start will build again.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from contextlib import contextmanager
from pathlib import Path
from typing import IO

log = logging.getLogger(__name__)

HERE = Path(__file__).parent
NAMES = ("attention", "decode", "fused", "linear", "panels", "quant", "repacked", "sampling")
SOURCES = tuple(HERE / f"cpu_{name}.cpp" for name in NAMES)
HEADER_NAMES = ("attention_tiles", "blocks", "common", "lanes", "rows", "team")
HEADERS = tuple(HERE / f"cpu_{name}.h" for name in HEADER_NAMES)
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17",
         "-fno-math-errno", "-fno-trapping-math")  # fmt: skip
# $RUNTIME_KERNEL_ISA: "native" (unset) builds for every instruction the CPU has; "avx2" leaves
# AVX-512 out, to run and measure the AVX2 kernels on a CPU that has both.
ISA_FLAGS = {"native": (), "avx2": ("-mno-avx512f",)}
# While a slow machine compiles, a line this often says it is still at it.
HEARTBEAT = 10.0


def cache_dir() -> Path:
    root = os.environ.get("RUNTIME_KERNEL_CACHE") or os.environ.get("XDG_CACHE_HOME")
    return Path(root or Path.home() / ".cache") / "runtime-kernels"


def build_flags() -> tuple[str, ...]:
    """FLAGS and those of $RUNTIME_KERNEL_ISA."""
    isa = os.environ.get("RUNTIME_KERNEL_ISA") or "native"
    if isa not in ISA_FLAGS:
        raise ValueError(f"RUNTIME_KERNEL_ISA={isa!r} is not one of {', '.join(ISA_FLAGS)}")
    return FLAGS + ISA_FLAGS[isa]


def library_name() -> str:
    key = hashlib.sha256(" ".join(build_flags()).encode() + _cpu_flags().encode())
    for path in SOURCES + HEADERS:
        key.update(path.read_bytes())
    return f"cpu_kernels-{key.hexdigest()[:16]}.so"


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""


@contextmanager
def built_library(compiler: str) -> Iterator[Path]:
    """The library's path, built first if no earlier start did; a private build (the cache
    is not writable) is removed on exit, once the caller has loaded it."""
    target = cache_dir() / library_name()
    if target.exists():
        yield target
        return
    lock = _open_lock(target)
    if lock is None:
        with tempfile.TemporaryDirectory(prefix="runtime-kernels-") as private:
            yield compile_library(compiler, Path(private) / target.name, cached=False)
        return
    with lock:
        _wait_for_lock(lock, target)
        if not target.exists():  # else whoever held the lock built it meanwhile
            compile_library(compiler, target, cached=True)
    yield target


def _open_lock(target: Path) -> IO[str] | None:
    """The build's lock file, or None (with a warning) where the cache cannot be written."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        return open(target.with_suffix(".lock"), "a")
    except OSError as exc:
        log.warning(
            "cannot write the kernel cache %s (%s): building for this process only, so every "
            "start builds again; set RUNTIME_KERNEL_CACHE to a writable directory",
            target.parent,
            exc.strerror or exc,
        )
        return None


def _wait_for_lock(lock: IO[str], target: Path) -> None:
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        log.info("another process is building the CPU kernels into %s: waiting for it", target)
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when its holder closes it, or dies


def compile_library(compiler: str, target: Path, cached: bool) -> Path:
    """Compile every source (in parallel), link them into `target`, atomically."""
    started = time.monotonic()
    log.info(
        "compiling the CPU kernels (%d C++ sources) with %s into %s%s",
        len(SOURCES),
        compiler,
        target,
        ": once per machine and kernel version, later starts load it" if cached else "",
    )
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        objects = [Path(scratch) / f"{source.stem}.o" for source in SOURCES]
        compile_flags = [flag for flag in build_flags() if flag != "-shared"]
        commands = [
            [compiler, *compile_flags, "-c", str(source), "-o", str(obj)]
            for source, obj in zip(SOURCES, objects, strict=True)
        ]
        _run_all(commands, started)
        built = Path(scratch) / target.name
        _run([compiler, "-shared", "-fopenmp", *map(str, objects), "-o", str(built)])
        os.replace(built, target)  # atomic: a reader sees the whole library or none
    log.info("built the CPU kernels in %.1f s", time.monotonic() - started)
    return target


def _run_all(commands: list[list[str]], started: float) -> None:
    """Run the compilations side by side (as many as there are cores), logging progress."""
    with ThreadPoolExecutor(min(len(commands), os.cpu_count() or 1)) as pool:
        pending: set[Future[None]] = {pool.submit(_run, command) for command in commands}
        try:
            while pending:
                done, pending = wait(pending, timeout=HEARTBEAT, return_when=FIRST_COMPLETED)
                for job in done:
                    job.result()  # a compiler error: CalledProcessError
                finished = len(commands) - len(pending)
                elapsed = time.monotonic() - started
                log.info("CPU kernels: %d of %d sources compiled (%.1f s)", finished,
                         len(commands), elapsed)  # fmt: skip
        finally:
            for job in pending:
                job.cancel()


def _run(command: list[str]) -> None:
    subprocess.run(command, check=True, capture_output=True, text=True)


def find_compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
