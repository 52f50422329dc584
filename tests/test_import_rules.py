"""The tree's rules, as tests: what each process may import.

Each check runs in a fresh interpreter, since this one has long since loaded everything.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Runs the scheduler process's code (its entry point, the actor, the pure core) on a request,
# with the model-free worker of tests/fake_worker.py, then lists what it must not have loaded.
SCHEDULER_PROCESS = """
import sys
import trio
import runtime.processes.actor_main
from runtime.config.engine import EngineConfig
from runtime.config.sampling import SamplingParams
from runtime.scheduler.actor import SchedulerActor
from runtime.wire.messages import AddRequest, StepOutputs, Submit
from tests.fake_worker import fake_worker, memory_pipe

async def main():
    frontend, scheduler_frontend = memory_pipe()
    worker, scheduler_worker = memory_pipe()
    actor = SchedulerActor(EngineConfig(model="unused", max_model_len=64), frozenset({0}))
    async with trio.open_nursery() as nursery:
        nursery.start_soon(actor.run, scheduler_frontend, scheduler_worker)
        nursery.start_soon(fake_worker, worker, 16)
        await frontend.recv()
        add = AddRequest("r", (1, 2, 3), 4, SamplingParams(ignore_eos=True))
        await frontend.send(Submit((add,), ()))
        while True:
            msg = await frontend.recv()
            if isinstance(msg, StepOutputs) and "length" in msg.finish_reasons:
                break
        nursery.cancel_scope.cancel()

trio.run(main)
"""

LOADED = """
print(" ".join(sorted(m for m in {names!r} if m in sys.modules)))
"""


def loaded_after(code: str, names: list[str]) -> list[str]:
    """Which of `names` are in sys.modules after running `code` in a fresh interpreter."""
    result = subprocess.run(
        [sys.executable, "-c", code + LOADED.format(names=names)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.split()


def test_the_scheduler_process_never_loads_torch_or_transformers() -> None:
    assert loaded_after(SCHEDULER_PROCESS, ["torch", "transformers"]) == []


def test_starting_actors_does_not_load_them_into_the_api_process() -> None:
    """In process mode the supervisor spawns interpreters; only inproc mode imports actors."""
    code = "import sys\nimport runtime.processes.supervisor\n"
    names = ["torch", "transformers", "runtime.scheduler.actor", "runtime.worker.actor"]
    assert loaded_after(code, names) == []


def imports_of(path: Path, top: str) -> list[str]:
    """Every module of package `top` that a file imports, at any depth of its code."""
    modules = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            modules.append(node.module)
        elif isinstance(node, ast.Import):
            modules.extend(alias.name for alias in node.names)
    return [m for m in modules if m == top or m.startswith(f"{top}.")]


def offenders(folder: str, top: str, allowed: tuple[str, ...] = ()) -> list[str]:
    """Imports of package `top` in `folder`'s files, but for modules under `allowed`."""
    found = {
        f"{path.relative_to(ROOT)}: {module}"
        for path in sorted((ROOT / folder).rglob("*.py"))
        for module in imports_of(path, top)
        if not any(module == a or module.startswith(f"{a}.") for a in allowed)
    }
    return sorted(found)


def test_api_depends_only_on_the_engine_protocol() -> None:
    """api/ serves any EngineClient: it never reaches into the engine's internals."""
    assert offenders("api", "runtime", allowed=("runtime.protocol",)) == []


def test_runtime_does_not_import_api_or_tools_but_from_its_entry_points() -> None:
    """The entry points (runtime/cli) sit above runtime/ and api/; nothing else in runtime/
    knows the HTTP layer, and the product never imports tools/."""
    below_cli = [f for f in offenders("runtime", "api") if not f.startswith("runtime/cli/")]
    assert below_cli == []
    assert offenders("runtime", "tools") == []
    assert offenders("api", "tools") == []


def test_the_client_does_not_load_the_server() -> None:
    """`api.client` works beside any program: it loads no web framework and no engine."""
    names = ["quart", "hypercorn", "torch", "transformers", "runtime", "api.http", "api.routes"]
    assert loaded_after("import sys\nimport api.client\n", names) == []
