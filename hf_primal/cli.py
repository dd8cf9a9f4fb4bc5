"""`hf-primal` command line."""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-primal", description="Primal-Attention for HuggingFace Transformers")
    sub = parser.add_subparsers(dest="command", required=True)
    layers = sub.add_parser("layers", help="list the primal attention layers of a saved model")
    layers.add_argument("path", help="model folder (or Hub id where the network allows)")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "layers":
        from transformers import AutoModel

        import hf_primal

        model = AutoModel.from_pretrained(args.path)
        for name in hf_primal.primal_layers(model):
            print(name)
        return 0
    return 1


if __name__ == "__main__":
    sys.exit(main())
