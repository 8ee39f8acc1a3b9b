"""The ``genai-ep`` command line.

Every subcommand shares the configuration flags (``--config``, ``--plugin``, ``--backend``,
``--kv-layout``, ``--capture``, ``--offload``, ``--set key=value``); an ``EPError`` is printed as
one readable message (exit status 2), never as a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ep.config import Config, load_config
from ep.errors import ConfigError, EPError
from ep.plugins import PluginHost, get_host
from ep_graphs import DEFAULT_MODEL

__all__ = ["main"]

# Flags that set a config key directly.
_FLAG_KEYS = {
    "backend": ("decode.backend", "--backend"),
    "kv_layout": ("decode.kv_layout", "--kv-layout"),
    "capture": ("decode.capture", "--capture"),
    "offload": ("decode.offload", "--offload"),
    "device": ("decode.device", "--device"),
}


def _config_flags() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False)
    g = p.add_argument_group("configuration (defaults < file < environment < these flags)")
    g.add_argument("--config", metavar="FILE", help="TOML config file (default: ./genai-ep.toml)")
    g.add_argument(
        "--plugin",
        metavar="MODULE",
        action="append",
        default=[],
        help="load an unpackaged plugin module (repeatable)",
    )
    g.add_argument("--backend", help="ort | native")
    g.add_argument("--kv-layout", dest="kv_layout", help="a registered KV layout")
    g.add_argument("--capture", help="a registered capture policy")
    g.add_argument("--offload", help="a registered offload policy")
    g.add_argument("--device", help="cpu | cuda")
    g.add_argument(
        "--set",
        metavar="KEY=VALUE",
        action="append",
        default=[],
        help="set any config key, e.g. --set offload.budget=50%% (repeatable)",
    )
    return p


def cli_settings(args: argparse.Namespace) -> dict[str, tuple[Any, str]]:
    """The config layer given on the command line: dotted key -> (raw value, source)."""
    out: dict[str, tuple[Any, str]] = {}
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(
                f"--set {item!r} is not KEY=VALUE; write for example --set offload.budget=50%"
            )
        out[key.strip()] = (value.strip(), f"command line --set {key.strip()}")
    for attr, (key, flag) in _FLAG_KEYS.items():
        value = getattr(args, attr, None)
        if value is not None:
            out[key] = (value, f"command line {flag}")
    return out


def host_and_config(args: argparse.Namespace) -> tuple[PluginHost, Config]:
    host = get_host(args.plugin)
    config = load_config(host.registry, config_file=args.config, cli=cli_settings(args))
    return host, config


# --- subcommands -----------------------------------------------------------------------------


def _cmd_plugins(args: argparse.Namespace) -> int:
    host, _ = host_and_config(args)
    rows = host.describe()
    if args.json:
        print(json.dumps({"plugins": rows}, indent=2))
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title="genai-ep plugins")
    for col in ("name", "provides", "distribution", "version", "origin", "hooks"):
        table.add_column(col)
    for row in rows:
        provides = row["provides"]
        assert isinstance(provides, dict)
        table.add_row(
            str(row["name"]),
            "; ".join(f"{seam}: {', '.join(names)}" for seam, names in provides.items()),
            str(row["distribution"] or "-"),
            str(row["version"] or "-"),
            str(row["origin"]),
            ", ".join(row["hooks"]),  # type: ignore[arg-type]  # a list of str by construction
        )
    Console(width=140).print(table)
    return 0


def _cmd_config_show(args: argparse.Namespace) -> int:
    _, config = host_and_config(args)
    if args.json:
        print(json.dumps({"file": str(config.file) if config.file else None,
                          "settings": config.as_dict()}, indent=2))  # fmt: skip
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"genai-ep config (file: {config.file or 'none'})")
    for col in ("key", "value", "source"):
        table.add_column(col)
    for key, item in config.as_dict().items():
        table.add_row(key, repr(item["value"]), item["source"])
    Console(width=140).print(table)
    return 0


def build_parser() -> argparse.ArgumentParser:
    common = _config_flags()
    parser = argparse.ArgumentParser(
        prog="genai-ep",
        description="Run genai-style ONNX decoders with swappable KV layouts, capture and "
        "offload policies.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser(
        "plugins", parents=[common], help="list loaded plugins and what they provide"
    )
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=_cmd_plugins)

    p = sub.add_parser("config", help="inspect the effective configuration")
    csub = p.add_subparsers(dest="config_command", metavar="ACTION", required=True)
    show = csub.add_parser("show", parents=[common], help="effective values and their sources")
    show.add_argument("--json", action="store_true", help="print JSON")
    show.set_defaults(func=_cmd_config_show)

    p = sub.add_parser(
        "run",
        parents=[common],
        help="generate tokens (with no arguments: the bundled model on the CPU)",
        description="Prefill then decode with a genai-style decoder. Without --model, runs the "
        "bundled default model.",
    )
    p.add_argument(
        "--model",
        metavar="PATH",
        help="onnxruntime-genai folder, decoder .onnx, Hugging Face checkpoint folder or "
        "'spec:hidden=64,layers=2,...' (default: the bundled model)",
    )
    p.add_argument("--prompt", action="append", default=[], metavar="TEXT",
                   help="prompt text (repeat for more batch rows)")  # fmt: skip
    p.add_argument("--prompt-ids", action="append", default=[], metavar="1,2,3",
                   help="prompt token ids (repeat for more batch rows)")  # fmt: skip
    p.add_argument("--max-new-tokens", type=int, default=64, metavar="N")
    p.add_argument("--min-new-tokens", type=int, default=0, metavar="N",
                   help="EOS and stop ids are masked until this many new tokens")  # fmt: skip
    sampling = p.add_argument_group(
        "sampling (flags not given fall back to the model's genai_config.json search defaults)"
    )
    sampling.add_argument("--greedy", action="store_true", help="argmax decoding")
    sampling.add_argument("--temperature", type=float, help="0 means greedy")
    sampling.add_argument("--top-k", type=int, help="0 turns it off")
    sampling.add_argument("--top-p", type=float, help="nucleus sampling, in (0, 1]")
    sampling.add_argument("--min-p", type=float, help="drop tokens below min_p × the top one")
    sampling.add_argument("--repetition-penalty", type=float, help="1 turns it off")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--json", action="store_true",
                   help='print one JSON object: {"tokens", "text", "metrics"}')  # fmt: skip
    p.set_defaults(func=_cmd_run)

    from ep_graphs import add_build_arguments, run_build

    p = sub.add_parser(
        "build",
        help="build a decoder graph from a Hugging Face checkpoint or a spec",
        description="Build a genai-style decoder folder (model.onnx + genai_config.json).",
    )
    add_build_arguments(p)
    p.set_defaults(func=run_build)

    p = sub.add_parser(
        "rewrite",
        help="rewrite an existing decoder into this project's ops (the ep flavour)",
        description="Rewrite an onnxruntime-genai (contrib) or standard decoder into ai.genai_ep "
        "ops over a runtime-owned KV cache; OUT runs with genai-ep run --model OUT. Prints what "
        "was rewritten and, for everything left alone, why.",
    )
    p.add_argument("model", metavar="MODEL", help="onnxruntime-genai folder or decoder .onnx")
    p.add_argument("-o", "--output", required=True, metavar="OUT", help="folder to write")
    p.add_argument("--force", action="store_true", help="replace OUT when it is not empty")
    p.add_argument("--keep-matmul", action="store_true",
                   help="keep dense ONNX MatMuls (no named weights)")  # fmt: skip
    p.add_argument("--int4-float", action="store_true",
                   help="rewrite MatMulNBits with accuracy_level 4 too (float32)")  # fmt: skip
    p.add_argument("--strict", action="store_true", help="fail when anything is left alone")
    p.add_argument("--context-length", type=int, default=None, metavar="N",
                   help="context length of a bare .onnx without genai_config.json")  # fmt: skip
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=_cmd_rewrite)

    p = sub.add_parser(
        "kernels",
        help="compile every CUDA kernel with NVRTC (no GPU needed) and list them",
        description="Compile every registered CUDA kernel to a cubin (cached on disk) and list "
        "them. NVRTC needs no GPU: pass --arch to compile on a machine without one.",
    )
    p.add_argument("--arch", help="sm_XX to compile for (default: the GPU's own)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=_cmd_kernels)
    return parser


def _prompt_ids(text: str) -> list[int]:
    try:
        ids = [int(part) for part in text.replace(" ", "").split(",") if part]
    except ValueError:
        raise ConfigError(
            f"--prompt-ids {text!r} is not a comma-separated list of token ids, e.g. 1,2,3"
        ) from None
    if not ids:
        raise ConfigError("--prompt-ids is empty; give at least one token id, e.g. 1,2,3")
    return ids


_SAMPLING_FLAGS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty")


def _sampling(args: argparse.Namespace, genai_config: Path | None) -> Any:
    """Sampling from the flags; flags not given fall back to the model's ``search`` defaults.

    As onnxruntime-genai does: ``genai_config.json``'s search section (``do_sample``,
    ``temperature``, ``top_k``, ``top_p``, ``repetition_penalty``) is the model's default, and
    ``do_sample: false`` (or ``--greedy``) means argmax.
    """
    from ep.sampling import SamplingParams

    search: dict[str, Any] = {}
    if genai_config is not None:
        search = json.loads(genai_config.read_text()).get("search", {}) or {}
    given = {k: getattr(args, k) for k in _SAMPLING_FLAGS if getattr(args, k) is not None}
    if args.greedy:
        given["temperature"] = 0.0
    sampled = bool(search.get("do_sample", False))
    values: dict[str, Any] = {
        "temperature": float(search.get("temperature", 1.0)) if sampled else 0.0,
        "top_k": int(search.get("top_k", 0)) if sampled else 0,
        "top_p": float(search.get("top_p", 1.0)) if sampled else 1.0,
        "min_p": 0.0,
        "repetition_penalty": float(search.get("repetition_penalty", 1.0)),
    }
    values.update(given)
    return SamplingParams(**values, seed=args.seed)


def _cmd_run(args: argparse.Namespace) -> int:
    from ep.model import load_model
    from ep.runtime import GenerationOptions, Generator

    _, config = host_and_config(args)
    bundled = args.model is None
    layout = config.create("kv_layout")
    # Only ep graphs read a KV layout other than dense head-major (ep.ort.backend). A Hugging
    # Face checkpoint or a spec, which `run` converts anyway, is converted to the ep flavour for
    # such a layout; a given graph (onnxruntime-genai folder, .onnx) is loaded as it is and
    # refused at the first step with the rewrite command to run.
    from ep.ort.backend import gqa_can_bind

    source = str(DEFAULT_MODEL) if bundled else args.model
    spec_flavour = source.startswith("spec:") and ("flavour=" in source or "flavor=" in source)
    to_ep = not gqa_can_bind(layout) and not spec_flavour
    model = load_model(source, flavour="ep" if to_ep else None)
    prompts: list[str | list[int]] = [*args.prompt, *(_prompt_ids(p) for p in args.prompt_ids)]
    if not prompts:
        if not bundled:
            raise ConfigError("give a prompt: --prompt TEXT or --prompt-ids 1,2,3 (repeatable)")
        prompts = ["def "]
    sampling = _sampling(args, model.genai_config)
    options = GenerationOptions(
        max_new_tokens=args.max_new_tokens, min_new_tokens=args.min_new_tokens
    )
    backend: Any = config["decode.backend"]
    if backend == "native":
        from ep.native import NativeBackend

        # Each config key's source, so a declined capture can say where its inputs came from.
        sources = {key: config.source(key) for key in config.settings}
        sources.update(capture=config.source("decode.capture"))
        # The policy and where it came from: "'lru' (from command line --offload)".
        sources.update(offload=config.describe("decode.offload"))
        backend = NativeBackend(
            model,
            layout,
            device=config["decode.device"],
            capture=config.create("capture"),
            offload=config.create("offload"),
            budget=config.budget,
            piece=config.piece_bytes,
            sources=sources,
            sync_every=config["decode.sync_every"],
            run_ahead=config["decode.run_ahead"],
            fused=config["decode.fused"],
        )
    generator = Generator(
        model,
        layout=layout,
        backend=backend,
        device=config["decode.device"],
        threads=config["decode.threads"],
        sampling=sampling,
        options=options,
    )
    if args.json:
        result = generator.generate(prompts)
        out: dict[str, Any] = {"tokens": [list(t) for t in result.tokens]}
        if result.text is not None:
            out["text"] = list(result.text)
        out["metrics"] = result.metrics.to_dict()
        capture = getattr(generator.backend, "capture_metrics", None)
        if capture is not None:
            out["metrics"]["capture"] = capture.to_dict()
        fused = getattr(generator.backend, "fused_metrics", None)
        if fused is not None:  # the native backend's fused decode step
            out["metrics"]["fused"] = fused
        offload = getattr(generator.backend, "offload_counters", None)
        if offload is not None:  # the native backend's weight store (issue 8)
            out["metrics"]["offload"] = offload
        out["finish_reasons"] = list(result.finish_reasons)
        if result.notes:
            out["notes"] = list(result.notes)
        print(json.dumps(out))
        return 0

    stream = generator.stream(prompts)
    if len(prompts) == 1 and generator.tokenizer is not None:
        # One row with text: print it as it is generated.
        prompt = prompts[0]
        print(prompt if isinstance(prompt, str) else "", end="", flush=True)
        for step in stream:
            print(step.text[0] if step.text else "", end="", flush=True)
        print()
    else:
        for _ in stream:
            pass
    result = stream.result
    _print_result(prompts, result)
    return 0


def _print_result(prompts: Sequence[str | list[int]], result: Any) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=120)
    texts = result.text
    if len(prompts) > 1 or texts is None:
        for i, tokens in enumerate(result.tokens):
            shown = texts[i] if texts is not None else ",".join(map(str, tokens))
            console.print(f"[bold]row {i}[/bold] ({result.finish_reasons[i]}): {shown}")
    for note in result.notes:
        console.print(f"[yellow]note:[/yellow] {note}")
    table = Table(title="metrics")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key, value in result.metrics.to_dict().items():
        table.add_row(key, f"{value:.3f}" if isinstance(value, float) else str(value))
    console.print(table)


def _cmd_rewrite(args: argparse.Namespace) -> int:
    """``genai-ep rewrite MODEL -o OUT``: see ep.rewrite."""
    from ep.rewrite import RewriteOptions, rewrite_model

    options = RewriteOptions(
        named_weights=not args.keep_matmul,
        int4_float=args.int4_float,
        strict=args.strict,
        context_length=args.context_length,
    )
    report = rewrite_model(args.model, args.output, options=options, force=args.force)
    print(json.dumps(report.to_dict(), indent=2) if args.json else report.describe())
    return 0


def register_all_kernels() -> list[str]:
    """Import every module that registers kernels; the registered names, sorted."""
    import ep.kernels  # the ops' kernels
    import ep.native._kernels  # noqa: F401  # the native executor's own (bias add, cast, ...)
    from ep.device import KERNELS

    return KERNELS.names()


def _cmd_kernels(args: argparse.Namespace) -> int:
    import dataclasses

    from ep.device import compile_all_kernels

    register_all_kernels()
    rows = compile_all_kernels(args.arch)
    if args.json:
        print(json.dumps({"kernels": [dataclasses.asdict(r) for r in rows]}, indent=2))
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"genai-ep kernels ({len(rows)})")
    for col in ("kernel", "arch", "cubin bytes", "cache", "seconds", "note"):
        table.add_column(col)
    for r in rows:  # note: why a kernel was skipped or recompiled
        table.add_row(r.name, r.arch, str(r.cubin_bytes), r.cache, f"{r.seconds:.2f}", r.note)
    Console(width=140).print(table)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except EPError as exc:
        print(f"genai-ep: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # e.g. `genai-ep plugins --json | head`
        sys.stderr.close()
        return 0
    except KeyboardInterrupt:
        print("genai-ep: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
