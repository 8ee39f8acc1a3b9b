"""The ``genai-ep`` command line.

Every subcommand shares the configuration flags (``--config``, ``--plugin``, ``--backend``,
``--kv-layout``, ``--capture``, ``--offload``, ``--set key=value``); an ``EPError`` is printed as
one readable message (exit status 2), never as a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from typing import Any

from ep.config import Config, load_config
from ep.errors import ConfigError, EPError
from ep.plugins import PluginHost, get_host

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


Command = Callable[[argparse.Namespace], int]


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

    for register in _EXTRA_COMMANDS:
        register(sub, common)
    return parser


# Later subcommands (run, build, rewrite, kernels) add themselves here: (subparsers, common) -> None
_EXTRA_COMMANDS: list[Callable[[Any, argparse.ArgumentParser], None]] = []


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
