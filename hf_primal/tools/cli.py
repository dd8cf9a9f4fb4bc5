"""`hf-primal` command line: demo, convert, layers.

Each command imports what it needs from the package's rooms (the hooks are installed by the package import that
precedes any of its modules).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import traceback
from typing import Callable, NoReturn, Optional, Sequence

from ..modeling.config import PrimalAttentionConfig, parse_layers  # standard library only

_DEFAULTS = PrimalAttentionConfig()  # the one home of the defaults the flags below show and use


class CLIError(Exception):
    """An error the user can act on: printed as one line, exit status 1."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        # One line (argparse would print the whole usage block first); --help has the usage.
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _layers(value: str):
    if value.strip().lower() in ("auto", "last"):  # convert's measured / last-K choice, with --num-primal-layers
        return value.strip().lower()
    try:
        return parse_layers(value)
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"--{error}") from None


def _add_demo_command(add_parser: Callable[..., argparse.ArgumentParser], debug: argparse.ArgumentParser) -> None:
    demo = add_parser("demo", parents=[debug],
                          help="the recommended recipe on the embedded all-MiniLM-L6-v2: convert with distillation, "
                               "then fine-tune (offline, about 5 minutes)",
                          description="Convert the embedded all-MiniLM-L6-v2 with distillation from the original, "
                                      "fine-tune it next to the stock model, and save a shareable folder (offline).")
    demo.add_argument("--output", "--output-dir", dest="output_dir", default=None,
                      help="folder for the converted model and demo_results.json (default ~/.cache/hf_primal/demo, "
                           "or demo-quick with --quick; $HF_PRIMAL_HOME replaces ~/.cache/hf_primal)")
    demo.add_argument("--quick", action="store_true", help="smoke test with reduced sizes (about a minute); its "
                                                           "figures say nothing about the method")
    demo.add_argument("--low-rank", type=int, default=_DEFAULTS.low_rank,
                      help=f"low_rank s of the primal layer (default {_DEFAULTS.low_rank})")
    demo.add_argument("--rank-multi", type=int, default=_DEFAULTS.rank_multi,
                      help=f"rank_multi m of the primal layer (default {_DEFAULTS.rank_multi})")
    demo.add_argument("--eta", type=float, default=_DEFAULTS.eta,
                      help=f"weight of the KSVD loss while fine-tuning (default {_DEFAULTS.eta})")


def _add_convert_command(add_parser: Callable[..., argparse.ArgumentParser], debug: argparse.ArgumentParser) -> None:
    conv = add_parser("convert", parents=[debug],
                          help="convert a stock checkpoint (BERT, RoBERTa, DistilBERT, ViT, DeiT, GPT-2) to "
                               "Primal-Attention",
                          description="Convert a stock checkpoint of a supported architecture "
                                      "(hf_primal.SUPPORTED_ARCHITECTURES) to Primal-Attention and save a shareable "
                                      "folder (weights, config, remote code, model card, tokenizer).")
    conv.add_argument("src", help="local model folder (or Hub id where the network allows)")
    conv.add_argument("out", help="output folder")
    conv.add_argument("--layers", type=_layers, default=_DEFAULTS.layers,
                      help=f"'all', indices such as -1 or 0,3, or 'auto' / 'last' with --num-primal-layers K: the K "
                           "layers that cost least to convert (measured on --calibration) / the last K "
                           f"(default {','.join(map(str, _DEFAULTS.layers))})")
    conv.add_argument("--num-primal-layers", type=int, default=None, metavar="K",
                      help="with --layers auto or last: how many layers to convert")
    conv.add_argument("--sensitivity-steps", type=int, default=50,
                      help="with --layers auto: distillation steps per layer when measuring (default 50)")
    conv.add_argument("--low-rank", type=int, default=_DEFAULTS.low_rank,
                      help=f"low_rank s: rank of the primal projections (default {_DEFAULTS.low_rank})")
    conv.add_argument("--rank-multi", type=int, default=_DEFAULTS.rank_multi,
                      help=f"rank_multi m: encoders sample s*m tokens for the data-dependent weights "
                           f"(default {_DEFAULTS.rank_multi})")
    conv.add_argument("--eta", type=float, default=_DEFAULTS.eta,
                      help=f"KSVD loss weight stored in the config for training (default {_DEFAULTS.eta})")
    conv.add_argument("--calibration", metavar="FILE",
                      help="unlabeled data to adapt on: a text file (one example per line) "
                           "or a .pt file of pixel_values")
    conv.add_argument("--method", choices=["distill", "transfer"], default="distill",
                      help="with --calibration: distil the whole model from the original (distill, default, "
                           "recommended) or fit each converted block alone (transfer)")
    conv.add_argument("--steps", "--calibration-steps", dest="steps", type=int, default=None,
                      help="optimizer steps: distillation in all (default 4 passes over the data) or attention "
                           "transfer per layer (default 300)")
    conv.add_argument("--learning-rate", type=float, default=None,
                      help="learning rate of the pretrained weights (distill, default 5e-4) or of attention transfer "
                           "(default 3e-3)")
    conv.add_argument("--batch-size", type=int, default=32, help="calibration batch size (default 32)")
    conv.add_argument("--calibration-target", choices=["layer", "attention"], default="layer",
                      help="--method transfer: fit the whole transformer block's output (layer, default) or the "
                           "attention module's")
    conv.add_argument("--max-length", type=int, default=128, help="token limit for text calibration")
    conv.add_argument("--push-to-hub", metavar="REPO_ID", help="upload the output folder to this Hub repository")


def _add_layers_command(add_parser: Callable[..., argparse.ArgumentParser], debug: argparse.ArgumentParser) -> None:
    layers = add_parser("layers", parents=[debug], help="list the primal attention layers of a saved model",
                            description="List the primal attention layers of a saved model (exit status 1 if none).")
    layers.add_argument("path", help="model folder (or Hub id where the network allows)")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of `hf-primal` (standard library only)."""
    debug = _Parser(add_help=False)
    # SUPPRESS: a subcommand's default must not overwrite `hf-primal --debug convert ...`.
    debug.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                       help="show the full traceback when a command fails")
    parser = _Parser(prog="hf-primal", description="Primal-Attention for HuggingFace Transformers", parents=[debug])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_demo_command(sub.add_parser, debug)
    _add_convert_command(sub.add_parser, debug)
    _add_layers_command(sub.add_parser, debug)
    return parser


# A Hub id is "name" or "namespace/name"; anything else with a separator can only be a folder.
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")


def _looks_like_path(src: str) -> bool:
    if src.startswith((".", "~")) or os.path.isabs(src):
        return True
    separators = {os.sep, os.altsep} - {None, "/"}
    return any(sep in src for sep in separators) or not _HUB_ID.match(src)


def check_source(src: str) -> None:
    """Refuse a SRC that is neither a model folder nor shaped like a Hub id, without contacting the Hub."""
    path = os.path.expanduser(src)
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise CLIError(f"{src}: not a model folder (it has no config.json)")
        return
    if os.path.exists(path):
        raise CLIError(f"{src}: is a file; expected a model folder")
    if _looks_like_path(src):
        raise CLIError(f"{src}: no such folder")


def _load_failed(src: str, error: Exception) -> CLIError:
    if os.path.isdir(os.path.expanduser(src)):
        return CLIError(f"cannot load {src}: {error}")
    return CLIError(f"{src}: no such folder, and loading it as a Hub id failed: {error}")


def _load_for_conversion(src: str):
    """The stock model with its own head, plus its tokenizer / image processor when SRC has one."""
    import transformers
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(src)
    except (OSError, ValueError) as error:
        raise _load_failed(src, error) from error
    architecture = (getattr(config, "architectures", None) or [None])[0]
    model_class = getattr(transformers, architecture, None) if architecture else None
    if model_class is None:
        model_class = transformers.AutoModel
    model = model_class.from_pretrained(src)
    processor = None
    for loader in (transformers.AutoTokenizer, transformers.AutoImageProcessor):
        try:
            processor = loader.from_pretrained(src)
            break
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return model, processor


def _calibration_batches(path: str, processor, max_length: int, batch_size: int = 32):
    import torch

    from .convert import text_batches

    if not os.path.isfile(path):
        raise CLIError(f"--calibration {path}: no such file")
    if path.endswith(".pt"):
        pixels = torch.load(path)
        return [{"pixel_values": pixels[i:i + batch_size]} for i in range(0, len(pixels), batch_size)]
    if processor is None or not callable(processor) or not hasattr(processor, "pad_token"):
        raise CLIError(f"--calibration {path}: a text file needs a tokenizer saved in SRC")
    if processor.pad_token is None:
        processor.pad_token = processor.eos_token
    with open(path, encoding="utf-8") as handle:
        lines = [line.strip() for line in handle if line.strip()]
    if not lines:
        raise CLIError(f"--calibration {path}: the file has no non-empty lines")
    return text_batches(processor, lines, batch_size, max_length)


def _demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    run_demo(args.output_dir, quick=args.quick, low_rank=args.low_rank, rank_multi=args.rank_multi, eta=args.eta)
    return 0


def _convert(args: argparse.Namespace) -> int:
    check_source(args.src)
    from ..integration.hub import save_converted
    from ..modeling.architecture import primal_layers
    from .convert import convert

    choice = args.layers if isinstance(args.layers, str) and args.layers in ("auto", "last") else None
    if choice is None and args.num_primal_layers is not None:
        raise CLIError(f"--num-primal-layers {args.num_primal_layers} needs --layers auto or last")
    if choice is not None and args.num_primal_layers is None:
        raise CLIError(f"--layers {choice} needs --num-primal-layers K (how many layers to convert)")
    spec = PrimalAttentionConfig(layers=_DEFAULTS.layers if choice else args.layers, low_rank=args.low_rank,
                                 rank_multi=args.rank_multi, eta=args.eta)
    model, processor = _load_for_conversion(args.src)
    data = None
    if args.calibration:
        data = _calibration_batches(args.calibration, processor, args.max_length, args.batch_size)
    model = convert(model, spec, calibration_data=data, method=args.method, steps=args.steps,
                    learning_rate=args.learning_rate, target=args.calibration_target, layers=choice,
                    num_primal_layers=args.num_primal_layers, sensitivity_steps=args.sensitivity_steps)
    if data is not None:
        model.primal_conversion_report["calibration"] = (
            f"{os.path.basename(args.calibration)}; " + model.primal_conversion_report["calibration"]
        )
    save_converted(model, args.out, processor=processor)
    print(f"converted {len(primal_layers(model))} layer(s) of {args.src} -> {args.out}")
    report = model.primal_conversion_report
    if "layer_selection" in report:
        selection = report["layer_selection"]
        print(f"  layer sensitivity, cheapest first: {selection['ranking']}; converted {selection['chosen']}")
    for row in report["layers"]:
        print(f"  {row['layer']}: relative output error {row['error_before']:.4f} -> {row['error_after']:.4f}")
    if "distillation" in report:
        d = report["distillation"]
        cos = (f", mean-pooled embedding cosine {d['cosine_before']:.4f} -> {d['cosine_after']:.4f}"
               if d.get("cosine_after") is not None else "")
        print(f"  distillation: held-out loss {d['loss_before']:.4f} -> {d['loss_after']:.4f}{cos} "
              f"(kept step {d['best_step']} of {d['steps']}, {d['seconds']:.0f} s)")
    if report.get("verdict"):
        print(f"  {report['verdict']}")
    if args.push_to_hub:
        from ..modeling.shareable import upload_folder

        upload_folder(args.out, args.push_to_hub, commit_message="Upload Primal-Attention model (hf_primal)")
        print(f"pushed {args.out} to {args.push_to_hub}")
    return 0


def _list_layers(args: argparse.Namespace) -> int:
    check_source(args.path)
    from transformers import AutoModel
    from transformers.utils import logging as hf_logging

    # Listing needs no load report or progress bar (a stock checkpoint loaded as AutoModel reports its head).
    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        model = AutoModel.from_pretrained(args.path)
    except (OSError, ValueError) as error:
        raise _load_failed(args.path, error) from error
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()
    from ..modeling.architecture import primal_layers

    names = primal_layers(model)
    if not names:
        raise CLIError(f"no primal layers in {args.path} (its config.json has no primal_attention)")
    for name in names:
        print(name)
    return 0


_COMMANDS = {"demo": _demo, "convert": _convert, "layers": _list_layers}


def _one_line(error: BaseException, limit: int = 400) -> str:
    text = " ".join(str(error).split()) or type(error).__name__
    if not isinstance(error, CLIError):
        text = f"{type(error).__name__}: {text}"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run `hf-primal`; returns the exit status (errors: one line on stderr, status 1; --debug: the traceback)."""
    args = build_parser().parse_args(argv)
    debug = getattr(args, "debug", False)
    try:
        return _COMMANDS[args.command](args)
    except KeyboardInterrupt:
        print(f"hf-primal {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as error:
        if debug:
            traceback.print_exc()
        else:
            hint = "" if isinstance(error, CLIError) else " (--debug shows the traceback)"
            print(f"hf-primal {args.command}: error: {_one_line(error)}{hint}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
