"""`hf-primal` command line: demo, convert, layers."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Optional, Sequence


def _layers(value: str):
    if value == "all":
        return "all"
    try:
        return [int(v) for v in value.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--layers {value!r} is not allowed: use 'all' or comma-separated indices such as -1 or 0,3"
        ) from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-primal", description="Primal-Attention for HuggingFace Transformers")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="convert + calibrate + fine-tune the embedded all-MiniLM-L6-v2 (offline)")
    demo.add_argument("--output-dir", default="hf_primal_demo")
    demo.add_argument("--quick", action="store_true", help="reduced sizes (about a minute)")
    demo.add_argument("--low-rank", type=int, default=30)
    demo.add_argument("--rank-multi", type=int, default=10)
    demo.add_argument("--eta", type=float, default=0.1)

    conv = sub.add_parser("convert", help="convert a stock BERT / ViT / GPT-2 checkpoint to Primal-Attention")
    conv.add_argument("src", help="local model folder (or Hub id where the network allows)")
    conv.add_argument("out", help="output folder")
    conv.add_argument("--layers", type=_layers, default=[-1], help="'all' or indices, e.g. -1 or 0,3 (default -1)")
    conv.add_argument("--low-rank", type=int, default=30)
    conv.add_argument("--rank-multi", type=int, default=10)
    conv.add_argument("--eta", type=float, default=0.1)
    conv.add_argument("--calibration", help="text file (one example per line) or .pt file of pixel_values for attention transfer")
    conv.add_argument("--calibration-steps", type=int, default=300)
    conv.add_argument("--calibration-target", choices=["layer", "attention"], default="layer")
    conv.add_argument("--max-length", type=int, default=128, help="token limit for text calibration")
    conv.add_argument("--push-to-hub", metavar="REPO_ID", help="upload the output folder to this Hub repository")

    layers = sub.add_parser("layers", help="list the primal attention layers of a saved model")
    layers.add_argument("path")
    return parser


def _load_for_conversion(src: str):
    """The stock model with its own head, plus its tokenizer / image processor when SRC has one."""
    import transformers
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(src)
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


def _calibration_batches(path: str, model, processor, max_length: int, batch_size: int = 16):
    import torch

    if path.endswith(".pt"):
        pixels = torch.load(path)
        return [{"pixel_values": pixels[i:i + batch_size]} for i in range(0, len(pixels), batch_size)]
    if processor is None or not hasattr(processor, "__call__") or not hasattr(processor, "pad_token"):
        raise SystemExit(f"--calibration {path}: a text file needs a tokenizer saved in SRC")
    if processor.pad_token is None:
        processor.pad_token = processor.eos_token
    with open(path, encoding="utf-8") as handle:
        lines = [line.strip() for line in handle if line.strip()]
    if not lines:
        raise SystemExit(f"--calibration {path}: the file has no non-empty lines")
    return [dict(processor(lines[i:i + batch_size], padding=True, truncation=True, max_length=max_length,
                           return_tensors="pt")) for i in range(0, len(lines), batch_size)]


def push_folder(folder: str, repo_id: str) -> None:
    """Upload exactly the converted folder (weights, config, remote code, model card, processor)."""
    from huggingface_hub import CommitOperationAdd, HfApi

    api = HfApi()
    repo_id = api.create_repo(repo_id, exist_ok=True).repo_id
    operations = [
        CommitOperationAdd(path_in_repo=os.path.relpath(os.path.join(root, name), folder).replace(os.sep, "/"),
                           path_or_fileobj=os.path.join(root, name))
        for root, _, names in os.walk(folder)
        for name in sorted(names)
    ]
    api.create_commit(repo_id=repo_id, operations=operations, commit_message="Upload Primal-Attention model (hf_primal)")


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    import hf_primal

    if args.command == "demo":
        from .demo import run_demo

        run_demo(args.output_dir, quick=args.quick, low_rank=args.low_rank, rank_multi=args.rank_multi, eta=args.eta)
        return 0
    if args.command == "convert":
        spec = hf_primal.PrimalAttentionConfig(layers=args.layers, low_rank=args.low_rank, rank_multi=args.rank_multi,
                                               eta=args.eta)
        model, processor = _load_for_conversion(args.src)
        data = _calibration_batches(args.calibration, model, processor, args.max_length) if args.calibration else None
        model = hf_primal.convert(model, spec, calibration_data=data, steps=args.calibration_steps,
                                  target=args.calibration_target)
        if data is not None:
            model.primal_conversion_report["calibration"] = (
                f"{os.path.basename(args.calibration)}; " + model.primal_conversion_report["calibration"]
            )
        hf_primal.save_converted(model, args.out, processor=processor)
        print(f"converted {len(hf_primal.primal_layers(model))} layer(s) of {args.src} -> {args.out}")
        for row in model.primal_conversion_report["layers"]:
            print(f"  {row['layer']}: relative output error {row['error_before']:.4f} -> {row['error_after']:.4f}")
        if args.push_to_hub:
            push_folder(args.out, args.push_to_hub)
            print(f"pushed {args.out} to {args.push_to_hub}")
        return 0
    if args.command == "layers":
        from transformers import AutoModel

        model = AutoModel.from_pretrained(args.path)
        for name in hf_primal.primal_layers(model):
            print(name)
        return 0
    return 1


if __name__ == "__main__":
    sys.exit(main())
