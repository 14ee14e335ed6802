"""Command line for model builders: `python -m lightning.models build-tiny DIR` (also `lightning models ...`)."""

from __future__ import annotations

import argparse
import inspect

from lightning.models.tiny import build_tiny_model

OPTIONS = ("seed", "hidden_size", "num_layers", "num_heads", "max_positions")
"""build_tiny_model's keyword arguments the command takes; their defaults are the function's own (one place)."""


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="lightning models", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    tiny = commands.add_parser(
        "build-tiny",
        help="write a tiny random-weight model and tokenizer to DIR",
        description="Write a tiny random-init Llama and a tokenizer trained on the fly to DIR, as a Hugging Face "
        "directory (nothing is downloaded): the model `model: tiny` builds, which vLLM's CPU build serves too.",
    )
    tiny.add_argument("dir")
    defaults = inspect.signature(build_tiny_model).parameters
    for name in OPTIONS:
        default = defaults[name].default
        tiny.add_argument(f"--{name.replace('_', '-')}", type=int, default=default, help=f"(default: {default})")
    args = parser.parse_args(argv)
    print(build_tiny_model(args.dir, **{name: getattr(args, name) for name in OPTIONS}))


if __name__ == "__main__":
    main()
