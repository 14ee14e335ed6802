"""What a run's start-up costs on this machine, part by part, each beside the plain way measured in the same run:

- the embedded serving stack (inference server and LLM proxy, each a process of its own), started side by side as a
  run does, and one after the other;
- the LLM proxy process alone, to its first answer (it loads the tokenizer only when a call first continues another);
- a new local MLflow database, copied from the cached empty one as a run does, and built by MLflow's migrations.

    .venv/bin/python benchmarks/startup_bench.py --repeats 3

Medians of `--repeats`; absolute seconds vary with the machine's load, the ratios less.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from lightning.metrics import new_local_db  # noqa: E402
from lightning.models import build_tiny_model  # noqa: E402
from lightning.stack import LocalStack  # noqa: E402
from lightning.store import open_store  # noqa: E402


def timed(action: Callable[[], object], repeats: int) -> float:
    seconds = []
    for _ in range(repeats):
        started = time.perf_counter()
        action()
        seconds.append(time.perf_counter() - started)
    return statistics.median(seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="startup-bench-"))
    model = build_tiny_model(tmp / "tiny", seed=0)
    url = f"sqlite:///{tmp}/store.db"
    store = open_store(url)

    def stack() -> LocalStack:
        return LocalStack(
            store, model, server="process", proxy="process", store_url=url, log_dir=tmp / "logs", start_timeout=600
        )

    specs = stack()  # the two processes a run starts (commands, environments, ports), to start one by one below
    children = [replace(child, process=None, client=None) for child in specs.processes]
    specs.close()

    def one_after_the_other() -> None:  # each waited for before the next starts
        for child in children:
            child.start()
        for child in children:
            child.stop()

    def proxy_alone() -> None:
        LocalStack(
            store, model, server="thread", proxy="process", store_url=url, log_dir=tmp / "logs", start_timeout=600
        ).close()

    counter = iter(range(10**6))

    def mlflow_db(copied: bool) -> Callable[[], None]:
        def make() -> None:
            path = tmp / f"mlflow-{next(counter)}" / "mlflow.db"
            path.parent.mkdir()
            if copied:
                new_local_db(path)
            else:
                from mlflow.tracking import MlflowClient

                MlflowClient(tracking_uri=f"sqlite:///{path}").search_experiments()

        return make

    new_local_db(tmp / "warm.db")  # the cache's copy made once, as on a machine's first run

    def load_tokenizer() -> None:  # in a fresh process, as the proxy would at start (less Python's own start)
        subprocess.run(
            [sys.executable, "-c", f"from transformers import AutoTokenizer as T; T.from_pretrained({str(model)!r})"],
            check=True,
        )

    def bare_python() -> None:
        subprocess.run([sys.executable, "-c", "pass"], check=True)

    stack_alone = timed(lambda: stack().close(), args.repeats)
    tokenizer = timed(load_tokenizer, args.repeats) - timed(bare_python, args.repeats)
    rows = [
        ("serving stack (2 processes)", stack_alone, timed(one_after_the_other, args.repeats)),
        ("LLM proxy process", timed(proxy_alone, args.repeats), None),
        ("the tokenizer a proxy loads on a first continuation", tokenizer, None),
        ("new MLflow database", timed(mlflow_db(True), args.repeats), timed(mlflow_db(False), args.repeats)),
    ]
    print("\n| part | as a run does (s) | the plain way (s) | ratio |\n|---|---|---|---|")
    for name, ours, plain in rows:
        ratio = f"{plain / ours:.1f}x" if plain else ""
        print(f"| {name} | {ours:.2f} | {plain:.2f} | {ratio} |" if plain else f"| {name} | {ours:.2f} | | |")


if __name__ == "__main__":
    main()
