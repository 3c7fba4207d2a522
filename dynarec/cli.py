"""The ``dynarec`` command."""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

__all__ = ["main"]


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dynarec", description="Recommendation models with fixed and dynamic embeddings.")
    sub = parser.add_subparsers(dest="command", required=True)

    from dynarec import bench, demo

    p = sub.add_parser("demo", help="train the built-in demo and print its metrics")
    demo.add_arguments(p)
    p.set_defaults(run=demo.main)

    p = sub.add_parser("bench", help="run a benchmark (medians, with its baseline in the same run)")
    bench.add_arguments(p)
    p.set_defaults(run=bench.main)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _build_parser().parse_args(argv)
    try:
        args.run(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"dynarec {args.command}: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
