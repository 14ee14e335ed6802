"""CPU a rollout costs, by process, beside the floor measured in the same run (issue 39). The demo's shape
(examples/copy_task/demo.yaml: its samples per task, runner tasks, runners per task, task runner, sampling, the
inference server's batch), a sampling round of 768 rollouts (issue 39's shape: the batch and dynamic sampling's two
refills when the demo sampled 8 a task; at 4 a task, the demo's now, a round is 384: `--rollouts 384 --trained
128`) without dynamic sampling's variable refills, on an open `Run` without Prefect: `stages.collect_rollouts` (the
rollout phase), then `adapt_spans`, `ppo_step` and `checkpoint` (the rest of the iteration) on 256 of them (the
batch the demo's update took at 8 a task; `--trained` changes it). Each process's CPU is read from /proc before and
after each part: the run's process (the store, the stages), the runner processes, the LLM proxy, the embedded
inference server, the trainer.

The floor, in the same run, with as many requests as a phase has rollouts and as many in flight as the demo's
runners: an aiohttp client with one kept-alive session posting a chat request to a minimal uvicorn app (plain ASGI,
uvloop, httptools) that answers a small JSON; then through a minimal forwarding app (the same, its upstream calls
on a kept-alive aiohttp session) between them. And transformers' `generate` in this process (TRL's sampling path)
on the same tiny model, prompts and token count, in batches the size of the inference server's, on one torch thread
as the server's.

`--prefect` runs each iteration as `make demo` does: the `training_iteration` flow on Prefect's temporary server (its
tasks, the runner tasks fanned out on Prefect's thread pool), then the progress and table artifacts the `train` flow
publishes after each iteration; Prefect's server is one more process counted, and Prefect's client work is in the
run's process. Without it the stages are called directly, and Prefect's share is left out.

    .venv/bin/python benchmarks/rollout_cpu.py [--iterations 6] [--warmup 2] [--rollouts 768] [--no-floor]
        [--prefect] [--config examples/copy_task/demo.yaml] [--set key=value ...] [--no-mlflow] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.machine_load import MachineLoad  # noqa: E402
from lightning import reporting, stages  # noqa: E402
from lightning.config import load_config  # noqa: E402
from lightning.config_file import apply_overrides, parse_overrides, read_config_file  # noqa: E402
from lightning.models import build_tiny_model  # noqa: E402
from lightning.run import Run  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")
PROCESSES = (
    "runner processes", "inference server", "LLM proxy", "inference server and LLM proxy", "the run's process",
    "Prefect's server", "trainer", "other",
)  # fmt: skip


def process_cpu(run: Run | None) -> dict[str, float]:
    """CPU seconds so far of this process (all threads) and of each process under it, by the part it plays."""
    runners = run is not None and run.config.task_runner == "processes"
    runner_pids = set(run.runner_processes().pids) if runners else set()
    cpu = {"the run's process": time.process_time()}
    pending = [os.getpid()]
    while pending:
        pid = pending.pop()
        try:
            tasks = Path(f"/proc/{pid}/task").iterdir()
            pending += [int(child) for task in tasks for child in (task / "children").read_text().split()]
            if pid == os.getpid():
                continue
            command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        name = (
            "runner processes" if pid in runner_pids
            else "Prefect's server" if "prefect.server" in command
            else "inference server and LLM proxy" if "lightning.stack" in command
            else "LLM proxy" if "proxy" in command else "inference server" if "lightning.inference" in command
            else "trainer" if "multiprocessing" in command else "other"
        )  # fmt: skip
        cpu[name] = cpu.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / TICK
    return cpu


def add_difference(total: dict[str, float], after: dict[str, float], before: dict[str, float]) -> None:
    for name, used in after.items():
        total[name] = total.get(name, 0.0) + used - before.get(name, 0.0)


def demo_config(path: str, workdir: Path, rollouts: int, overrides: list[str]) -> Any:
    """The demo's config, its batch sized to `rollouts` a phase, dynamic sampling and the warm start off, its
    store, MLflow and checkpoints under `workdir`."""
    data = read_config_file(path)
    samples = data.get("samples_per_task", 1)
    model_dir = build_tiny_model(workdir / "tiny", seed=0)
    data = apply_overrides(
        data,
        {
            "run_name": "rollout-cpu", "model": str(model_dir), "batch_size": rollouts // samples,
            "dynamic_sampling": False, "warm_start": None, "iterations": 100_000, "eval_every": 0,
            "checkpoint": {"keep_last": 1, "log_to_mlflow": False, "register_model": None},
            "mlflow_traces": {"train_per_iteration": 0},
            "store_url": f"sqlite:///{workdir}/store.db", "tracking_uri": f"sqlite:///{workdir}/mlflow.db",
            "output_dir": str(workdir / "runs"),
            **parse_overrides(overrides),
        },
    )  # fmt: skip
    return load_config(data)


async def measure_run(args: argparse.Namespace, workdir: Path) -> tuple[Any, dict[str, float], dict[str, float], list]:
    """CPU seconds by process over the measured iterations' rollout phases, and over the whole iterations; the
    phases' wall seconds."""
    config = demo_config(args.config, workdir, args.rollouts, args.set)
    run = await Run.open(config, track=not args.no_mlflow)
    phase: dict[str, float] = {}
    whole: dict[str, float] = {}
    seconds = []
    in_phase: dict[str, Any] = {}  # the latest phase's CPU at its start and end, wall seconds and summary
    collect_as_tasks = None
    if args.prefect:
        import flows.train
        from flows.artifacts import publish_progress
        from flows.rollouts import collect_rollouts as collect_as_tasks

        table_id = progress = None

    async def collect(run: Run, iteration: int, mode: Any) -> tuple[list[str], dict[str, Any]]:
        in_phase["start"], started = process_cpu(run), time.perf_counter()
        rollout_ids, rollouts = await (collect_as_tasks or stages.collect_rollouts)(run, iteration, mode)
        in_phase.update(seconds=time.perf_counter() - started, end=process_cpu(run), rollouts=rollouts)
        return rollout_ids[: args.trained], rollouts  # as many as the demo's dynamic sampling keeps

    if args.prefect:
        flows.train.collect_rollouts = collect  # the flow's rollout phase, measured
    try:
        for iteration in range(args.warmup + args.iterations):
            measured = iteration >= args.warmup
            start = process_cpu(run)
            started = time.perf_counter()
            if args.prefect:  # the flow, then what `train` publishes after each iteration
                await flows.train.training_iteration(run, iteration)
                done = 100.0 * (iteration + 1) / (args.warmup + args.iterations)
                progress = await publish_progress(f"{run.name}-progress", done, "Iterations done", progress)
                table_id = await flows.train._publish(run, table_id)
            else:
                rollout_ids, rollouts = await collect(run, iteration, "train")
                batch = await stages.adapt_spans(run, iteration, rollout_ids)
                metrics = await stages.ppo_step(run, iteration, batch["batch_path"])
                row = reporting.iteration_row(iteration, rollouts, batch, metrics, in_phase["seconds"])
                await stages.checkpoint(run, iteration, row)
            wall = time.perf_counter() - started
            elapsed, rollouts = in_phase["seconds"], in_phase["rollouts"]
            if measured:
                add_difference(phase, in_phase["end"], in_phase["start"])
                add_difference(whole, process_cpu(run), start)
                seconds.append(elapsed)
            print(
                f"iteration {iteration}: rollout phase {elapsed * 1000:.0f} ms ({rollouts['succeeded']} of "
                f"{rollouts['rollouts']} ok), iteration {wall * 1000:.0f} ms{'' if measured else ' (warm-up)'}; "
                f"load {os.getloadavg()[0]:.2f}",
                flush=True,
            )
    finally:
        await run.close()
    return config, phase, whole, seconds


# --- the floor ---------------------------------------------------------------------------------------------------

ANSWER = json.dumps(
    {"id": "x", "object": "chat.completion", "model": "m", "choices": [{"index": 0, "finish_reason": "stop",
     "message": {"role": "assistant", "content": "d"}}], "usage": {"prompt_tokens": 9, "completion_tokens": 2}}
).encode()  # fmt: skip


def serve_answer(port: int) -> None:
    """A minimal server: every POST answered with ANSWER."""
    import uvicorn

    async def app(scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        while (await receive()).get("more_body"):
            pass
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(ANSWER)).encode())]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": ANSWER})

    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False, loop="uvloop",
                http="httptools", timeout_keep_alive=300)  # fmt: skip


def serve_forward(port: int, upstream: str) -> None:
    """A minimal forwarding server: the request body posted upstream on a kept-alive session, its answer returned."""
    import aiohttp
    import uvicorn

    session: list[aiohttp.ClientSession] = []

    async def app(scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    session.append(aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)))
                    await send({"type": "lifespan.startup.complete"})
                else:
                    await session[0].close()
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        headers = {"content-type": "application/json"}
        async with session[0].post(upstream, data=body, headers=headers) as response:
            answer = await response.read()
        out = [(b"content-type", b"application/json"), (b"content-length", str(len(answer)).encode())]
        await send({"type": "http.response.start", "status": 200, "headers": out})
        await send({"type": "http.response.body", "body": answer})

    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False, loop="uvloop",
                http="httptools", lifespan="on", timeout_keep_alive=300)  # fmt: skip


async def post_all(url: str, requests: int, in_flight: int, rounds: int) -> float:
    """`rounds` rounds of `requests` chat requests, `in_flight` at a time, on one kept-alive session, after one
    round of warm-up; the CPU seconds the rounds took in this process."""
    import aiohttp

    body = {"model": "m", "messages": [{"role": "user", "content": "bdfg"}], "temperature": 1.0, "max_tokens": 2}
    gate = asyncio.Semaphore(in_flight)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:

        async def one() -> None:
            async with gate, session.post(url, json=body) as response:
                (await response.json())["choices"][0]["message"]["content"]

        await asyncio.gather(*(one() for _ in range(requests)))
        print("warm", flush=True)
        before = time.process_time()
        for _ in range(rounds):
            await asyncio.gather(*(one() for _ in range(requests)))
        return time.process_time() - before


def pid_cpu(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def floor(requests: int, in_flight: int, rounds: int) -> dict[str, dict[str, float]]:
    """CPU ms a request by process: client -> server (one hop), client -> forwarder -> server (two hops)."""
    from lightning.serving import free_port

    me = [sys.executable, __file__]
    server_port, forward_port = free_port(), free_port()
    server_url = f"http://127.0.0.1:{server_port}/v1/chat/completions"
    forward_url = f"http://127.0.0.1:{forward_port}/v1/chat/completions"
    started = [
        subprocess.Popen([*me, "--serve-answer", str(server_port)]),
        subprocess.Popen([*me, "--serve-forward", str(forward_port), server_url]),
    ]
    try:
        for port in (server_port, forward_port):
            _wait_for_port(port)
        found = {}
        for name, url, servers in (("one hop", server_url, started[:1]), ("two hops", forward_url, started)):
            client = subprocess.Popen([*me, "--post", url, str(requests), str(in_flight), str(rounds)],
                                      stdout=subprocess.PIPE, text=True)  # fmt: skip
            client.stdout.readline()  # warmed up
            before = {p.pid: pid_cpu(p.pid) for p in servers}
            client_cpu = float(client.communicate()[0])  # its own CPU over the rounds: not its imports
            calls = requests * rounds
            found[name] = {"client": 1000 * client_cpu / calls}
            for process, label in zip(servers, ("server", "forwarder"), strict=False):
                found[name][label] = 1000 * (pid_cpu(process.pid) - before[process.pid]) / calls
        return found
    finally:
        for process in started:
            process.terminate()
            process.wait()


def _wait_for_port(port: int) -> None:
    import socket

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise TimeoutError(f"nothing listened on {port} within 60 s")


def in_process_generate(config: Any, model_dir: Path, samples: int, batch: int) -> float:
    """CPU ms a sample of transformers' generate in this process: the demo's prompts (chat template), sampling
    settings and token count, `batch` sequences at a time, one torch thread."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from examples.copy_task.data import train_tasks

    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    tasks = train_tasks()[:samples]
    max_tokens = config.sampling.get("max_tokens", 2)

    def generate_all() -> None:
        for start in range(0, len(tasks), batch):
            chats = [[{"role": "user", "content": t["letters"]}] for t in tasks[start : start + batch]]
            texts = [tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=False) for c in chats]
            inputs = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
            with torch.no_grad():
                out = model.generate(**inputs, do_sample=True, temperature=1.0, max_new_tokens=max_tokens,
                                     min_new_tokens=max_tokens, pad_token_id=tokenizer.pad_token_id)  # fmt: skip
            tokenizer.batch_decode(out[:, inputs["input_ids"].shape[1] :], skip_special_tokens=True)

    generate_all()  # warm-up
    before = time.process_time()
    generate_all()
    return 1000 * (time.process_time() - before) / len(tasks)


# --- the table -----------------------------------------------------------------------------------------------------


def arguments() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(REPO / "examples/copy_task/demo.yaml"))
    parser.add_argument("--iterations", type=int, default=6, help="iterations measured")
    parser.add_argument("--warmup", type=int, default=2, help="iterations run first, not measured")
    parser.add_argument("--rollouts", type=int, default=768, help="a phase's rollouts (issue 39's shape)")
    parser.add_argument(
        "--trained", type=int, default=256,
        help="rollouts a phase the update takes (what the demo's dynamic sampling kept at 8 samples a task)",
    )  # fmt: skip
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a config override")
    parser.add_argument("--no-floor", action="store_true", help="the product path alone")
    parser.add_argument("--no-mlflow", action="store_true", help="the run without MLflow (Run.open(track=False))")
    parser.add_argument(
        "--prefect", action="store_true",
        help="each iteration as the training_iteration flow on Prefect's temporary server, which is counted too",
    )  # fmt: skip
    parser.add_argument("--json", type=Path, default=None, help="also write the tables' figures here")
    parser.add_argument("--serve-answer", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--serve-forward", nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--post", nargs=4, help=argparse.SUPPRESS)
    return parser


def main() -> None:
    args = arguments().parse_args()
    if args.serve_answer:
        return serve_answer(args.serve_answer)
    if args.serve_forward:
        return serve_forward(int(args.serve_forward[0]), args.serve_forward[1])
    if args.post:
        url, requests, in_flight, rounds = args.post
        return print(asyncio.run(post_all(url, int(requests), int(in_flight), int(rounds))))

    args.trained = min(args.rollouts, args.trained)
    load = MachineLoad()
    workdir = Path(tempfile.mkdtemp(prefix="rollout-cpu-"))
    config, phase, whole, seconds = asyncio.run(measure_run(args, workdir))
    rollouts = args.rollouts * args.iterations
    in_flight = min(args.rollouts, config.n_runners * config.runner_concurrency)
    floors = {} if args.no_floor else floor(args.rollouts, in_flight, max(args.iterations, 3))
    generate = None if args.no_floor else in_process_generate(
        config, workdir / "tiny", args.rollouts, config.inference.max_batch_size
    )  # fmt: skip

    print(
        f"\n{args.iterations} iterations of {args.rollouts} rollouts ({config.batch_size} tasks x "
        f"{config.samples_per_task}, the update on {args.trained}; {config.n_runners} runner tasks of "
        f"{config.runner_concurrency}, task_runner "
        f"{config.task_runner}; max_tokens {config.sampling.get('max_tokens')}), rollout phase median "
        f"{statistics.median(seconds) * 1000:.0f} ms; {os.cpu_count()} cores"
    )
    # Cores busy: a process's CPU seconds over the phases' wall seconds. Where the cores are many (a GPU machine), the
    # process nearest 1.0 (one event loop) is what bounds the phase's wall time.
    print(
        "\n| process | CPU ms a rollout, rollout phase | share | cores busy, rollout phase "
        f"| CPU ms a rollout, whole iteration{'' if args.prefect else ' (no Prefect)'} |"
    )
    print("|---|---|---|---|---|")
    total_phase, total_whole, phase_seconds = sum(phase.values()), sum(whole.values()), sum(seconds)
    rows = []
    for name in PROCESSES:
        if name in phase or name in whole:
            used = phase.get(name, 0.0)
            label = f"{name} ({config.n_runners})" if name == "runner processes" else name
            rows.append({
                "process": label, "phase_ms": 1000 * used / rollouts, "share": used / total_phase,
                "cores_busy": used / phase_seconds, "whole_ms": 1000 * whole.get(name, 0.0) / rollouts,
            })  # fmt: skip
            print(
                f"| {label} | {rows[-1]['phase_ms']:.2f} | {100 * rows[-1]['share']:.0f}% "
                f"| {rows[-1]['cores_busy']:.2f} | {rows[-1]['whole_ms']:.2f} |"
            )
    print(
        f"| **all** | **{1000 * total_phase / rollouts:.2f}** | | {total_phase / phase_seconds:.2f} "
        f"| **{1000 * total_whole / rollouts:.2f}** |"
    )
    if args.json:
        args.json.write_text(json.dumps({
            "rollouts_a_phase": args.rollouts, "iterations": args.iterations, "cores": os.cpu_count(),
            "phase_ms_median": 1000 * statistics.median(seconds), "processes": rows,
            "all_phase_ms": 1000 * total_phase / rollouts, "all_whole_ms": 1000 * total_whole / rollouts,
            "load": load.line(),
        }, indent=1))  # fmt: skip
    if floors:
        print(f"\nThe floor, same run ({args.rollouts} requests a round, {in_flight} in flight, kept-alive sessions):")
        print("\n| path | CPU ms a request, all processes | client | forwarder | server |")
        print("|---|---|---|---|---|")
        for name, found in floors.items():
            print(
                f"| {name} | {sum(found.values()):.3f} | {found['client']:.3f} "
                f"| {found.get('forwarder', float('nan')):.3f} | {found['server']:.3f} |"
            )
        print(f"| transformers generate in process (TRL's path), a sample | {generate:.3f} | | | |")
    print(f"\n{load.line()}")


if __name__ == "__main__":
    main()
