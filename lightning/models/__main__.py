"""Command line for model builders: `python -m lightning.models build-tiny DIR`."""

from __future__ import annotations

import argparse

from lightning.models.tiny import build_tiny_model


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m lightning.models")
    commands = parser.add_subparsers(dest="command", required=True)
    tiny = commands.add_parser("build-tiny", help="write a tiny random-weight model and tokenizer to DIR")
    tiny.add_argument("dir")
    tiny.add_argument("--seed", type=int, default=0)
    tiny.add_argument("--hidden-size", type=int, default=64)
    tiny.add_argument("--num-layers", type=int, default=2)
    tiny.add_argument("--num-heads", type=int, default=4)
    tiny.add_argument("--max-positions", type=int, default=512)
    args = parser.parse_args(argv)
    path = build_tiny_model(
        args.dir,
        seed=args.seed,
        hidden_size=args.hidden_size,
        num_layers=args.num_layers,
        num_heads=args.num_heads,
        max_positions=args.max_positions,
    )
    print(path)


if __name__ == "__main__":
    main()
