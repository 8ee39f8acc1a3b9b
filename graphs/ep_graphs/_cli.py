"""``genai-ep build``: the argparse wiring the project CLI (ep/cli.py) calls."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from ep.errors import ConfigError

from ._build import build_model, convert_checkpoint
from ._flavour import FLAVOURS
from ._quant import Int4Options
from ._spec import DTYPES, ModelSpec
from ._weights import random_weights

__all__ = ["add_build_arguments", "run_build"]


def add_build_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``build`` options to `parser`."""
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--hf",
        metavar="DIR",
        type=Path,
        help="Hugging Face checkpoint folder (config.json + safetensors) to convert",
    )
    source.add_argument(
        "--spec",
        metavar="SPEC",
        help="random-weight model from a spec string, e.g. "
        '"hidden=64,layers=2,heads=4,kv_heads=2,vocab=512"',
    )
    parser.add_argument(
        "--flavour",
        default="contrib",
        choices=sorted(FLAVOURS),
        help="graph flavour: standard (plain ONNX ops) or contrib (onnxruntime-genai format); "
        "default contrib",
    )
    parser.add_argument(
        "--dtype",
        choices=DTYPES,
        default=None,
        help="model dtype (default: fp32 for --hf, the spec's dtype for --spec)",
    )
    parser.add_argument(
        "--quant",
        choices=("int4",),
        default=None,
        help="quantize projections to 4 bits (MatMulNBits; contrib only)",
    )
    parser.add_argument(
        "--int4-block-size",
        type=int,
        default=32,
        metavar="N",
        help="int4 block size (16, 32, 64, 128, 256; default 32)",
    )
    parser.add_argument(
        "--int4-asymmetric",
        action="store_true",
        help="int4 with zero points instead of the symmetric scheme",
    )
    parser.add_argument(
        "--int4-accuracy-level",
        type=int,
        default=4,
        metavar="L",
        help="MatMulNBits accuracy_level (default 4, as onnxruntime-genai)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed for --spec weights (default 0)")
    parser.add_argument(
        "--tokenizer",
        metavar="DIR",
        type=Path,
        default=None,
        help="copy tokenizer.json/tokenizer_config.json from this folder",
    )
    parser.add_argument(
        "-o",
        "--output",
        metavar="OUT",
        type=Path,
        required=True,
        help="output folder (created; existing model files are replaced)",
    )
    parser.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="show a progress bar (default: when stderr is a terminal)",
    )


def run_build(args: argparse.Namespace) -> int:
    """Run ``build`` from parsed arguments; returns the exit status (errors raise EPError)."""
    quant: Int4Options | None = None
    if args.quant == "int4":
        quant = Int4Options(
            block_size=args.int4_block_size,
            symmetric=not args.int4_asymmetric,
            accuracy_level=args.int4_accuracy_level,
        )
    if args.hf is not None:
        if args.tokenizer is not None:
            raise ConfigError("--tokenizer is for --spec builds; --hf copies the checkpoint's own")
        out = convert_checkpoint(
            args.hf,
            args.output,
            flavour=args.flavour,
            dtype=args.dtype or "fp32",
            quant=quant,
            progress=args.progress,
        )
    else:
        spec = ModelSpec.parse(args.spec)
        if args.dtype is not None:
            spec = dataclasses.replace(spec, dtype=args.dtype)
        out = build_model(
            spec,
            random_weights(spec, args.seed),
            flavour=args.flavour,
            out_dir=args.output,
            quant=quant,
            tokenizer_dir=args.tokenizer,
            progress=args.progress,
        )
    size = sum(p.stat().st_size for p in out.iterdir() if p.is_file())
    print(f"wrote {out} ({args.flavour}, {size / 1e6:.1f} MB)", file=sys.stdout)
    return 0
