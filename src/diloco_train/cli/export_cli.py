"""``diloco export RUN``: the run's global weights as safetensors (ours and a Hugging Face Llama folder)."""

from __future__ import annotations

import argparse

from ..export import export

__all__ = ["EXPORT_EXAMPLE", "configure_export_parser", "export_main"]

EXPORT_EXAMPLE = "e.g. diloco export runs/diloco-20260101-120000 --out model/"


def configure_export_parser(p: argparse.ArgumentParser) -> None:
    """The options of ``diloco export`` on its subparser."""
    p.add_argument("run", metavar="RUN", help="the run folder (e.g. runs/diloco-...)")
    p.add_argument("--out", metavar="DIR", help="output folder (default: RUN/export)")
    p.add_argument(
        "--step", type=int, metavar="N", help="the checkpoint of step N (default: the newest)"
    )


def export_main(args: argparse.Namespace) -> int:
    done = export(args.run, args.out, step=args.step)
    print(
        f"exported step {done.step} of {args.run} (the global weights) to {done.out}/: model.safetensors + "
        f"config.json (diloco_train.export.load), hf/ (transformers.LlamaForCausalLM.from_pretrained); "
        f"tokenizer: {done.tokenizer}"
    )
    return 0
