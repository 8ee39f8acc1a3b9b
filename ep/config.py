"""One frozen configuration from defaults < TOML file < environment < command line.

Every value remembers where it came from, so an error or a declined capture can say
``offload = 'lru' (from config file ./genai-ep.toml)``.

Keys are dotted paths: ``decode.backend``, ``offload.budget`` and, for each registered plugin's own
options, ``kv_layout.NAME.OPTION``, ``capture.NAME.OPTION``, ``offload.NAME.OPTION``.
In the environment a key is ``GENAI_EP_`` + the path in capitals with ``__`` between its parts:
``GENAI_EP_DECODE__BACKEND=native``, ``GENAI_EP_KV_LAYOUT__PAGED__PAGE_SIZE=32``.
"""

from __future__ import annotations

import difflib
import os
import re
import tomllib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ep.errors import ConfigError, ContractError
from ep.registry import Entry, Option, Registry, Seam
from ep.seams import CapturePolicy, KVLayout, OffloadPolicy

__all__ = [
    "DEFAULT_CONFIG_FILE",
    "NON_CONFIG_ENV",
    "Budget",
    "Config",
    "Setting",
    "load_config",
    "parse_budget",
    "parse_piece",
]

DEFAULT_CONFIG_FILE = "genai-ep.toml"

# GENAI_EP_* variables that are not configuration keys (the plugin host and caches read them).
NON_CONFIG_ENV = frozenset(
    {
        "GENAI_EP_PLUGINS",
        "GENAI_EP_DISABLE_PLUGINS",
        "GENAI_EP_PLUGINS_EXTRA",
        "GENAI_EP_TRACE_HOOKS",
        "GENAI_EP_CACHE",
        "GENAI_EP_KERNEL_CACHE",
        "GENAI_EP_PDL",  # the CUDA device: 0 launches without programmatic dependent launch
        "GENAI_EP_FUSE",  # native plans: 0 binds each node alone (no fused QKV commit), A/B runs
        "GENAI_EP_EARLY",  # native plans: 0 loads no GEMV weights before the PDL wait (A/B runs)
        "GENAI_EP_GEMV",  # v1 forces the first-generation GEMV kernels (A/B runs)
        "GENAI_EP_ATTENTION",  # v1 forces the earlier decode attention kernel (A/B runs)
    }
)

# Which config key picks the implementation of each seam.
SEAM_KEYS: dict[Seam, str] = {
    "kv_layout": "decode.kv_layout",
    "capture": "decode.capture",
    "offload": "decode.offload",
}


@dataclass(frozen=True)
class Budget:
    """A device byte budget: an absolute number of bytes or a share of the weights' bytes."""

    text: str
    nbytes: int | None = None
    share: float | None = None

    def resolve(self, total_bytes: int) -> int:
        """Bytes allowed for weights that total ``total_bytes``."""
        if self.nbytes is not None:
            return self.nbytes
        assert self.share is not None
        return int(total_bytes * self.share)


_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}  # fmt: skip


def parse_budget(text: str) -> Budget:
    """Parse ``"50%"``, ``"2GiB"``, ``"1500000000"`` (a ConfigError says what is allowed)."""
    s = str(text).strip()
    percent = re.fullmatch(r"(\d+(?:\.\d+)?)\s*%", s)
    if percent:
        share = float(percent.group(1)) / 100
        if not 0 < share <= 1:
            raise ConfigError(f"budget {s!r} must be a share in (0%, 100%]")
        return Budget(s, share=share)
    size = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([a-zA-Z]*)", s)
    if size and size.group(2).lower() in _UNITS:
        nbytes = int(float(size.group(1)) * _UNITS[size.group(2).lower()])
        if nbytes <= 0:
            raise ConfigError(f"budget {s!r} must be more than 0 bytes")
        return Budget(s, nbytes=nbytes)
    raise ConfigError(
        f"budget {s!r} is not a size; expected bytes ('1500000000'), a size with a unit "
        "('2GiB', '512MB') or a share of the weights ('50%')"
    )


MIN_PIECE_BYTES = 256  # one arena alignment unit: smaller pieces only add copies and calls


def parse_piece(text: str | int) -> int:
    """Bytes of ``offload.piece``: ``"32MiB"``, ``"4194304"`` (a ConfigError says what is allowed).

    Weights larger than this are streamed in pieces of at most this size (`ep.offload`).
    """
    s = str(text).strip()
    size = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([a-zA-Z]*)", s)
    if size is None or size.group(2).lower() not in _UNITS:
        raise ConfigError(
            f"offload.piece = {s!r} is not a byte size; expected bytes ('33554432') or a size "
            "with a unit ('32MiB', '64MB'); a share ('50%') is not allowed here"
        )
    nbytes = int(float(size.group(1)) * _UNITS[size.group(2).lower()])
    if nbytes < MIN_PIECE_BYTES:
        raise ConfigError(
            f"offload.piece = {s!r} is {nbytes} bytes; expected at least {MIN_PIECE_BYTES} "
            "bytes: set e.g. --set offload.piece=32MiB"
        )
    return nbytes


def _parse_check(parse: Callable[[str], object]) -> Callable[[str], str]:
    """A key's check from its parser: the parser's error message, or "" when the value parses."""

    def check(value: str) -> str:
        try:
            parse(value)
        except ConfigError as exc:
            return str(exc)
        return ""

    return check


def _positive(value: int) -> str:
    return "" if value >= 1 else "must be at least 1"


# The host's own keys. The three seam keys are checked against the registry, not a fixed list.
CORE_OPTIONS: dict[str, Option] = {
    "decode.backend": Option(
        "backend", str, "ort", "who runs the graph: ONNX Runtime or our executor",
        choices=("ort", "native"),
    ),
    "decode.kv_layout": Option("kv_layout", str, "head_major", "a registered KV layout"),
    "decode.capture": Option("capture", str, "never", "a registered capture policy"),
    "decode.offload": Option("offload", str, "resident", "a registered offload policy"),
    "decode.device": Option(
        "device", str, "cpu", "where the model runs", choices=("cpu", "cuda")
    ),
    "decode.threads": Option(
        "threads", int, 0, "ONNX Runtime intra-op threads (0: its default)",
        check=lambda v: "" if v >= 0 else "must be 0 (default) or more",
    ),
    "decode.sync_every": Option(
        "sync_every", int, 1, "decode steps between host synchronisations", check=_positive
    ),
    "decode.run_ahead": Option(
        "run_ahead", bool, True,
        "native backend: launch the device loop's next k steps before reading the last k (the "
        "device never waits for the host; after a stop, up to k steps are surplus)",
    ),
    "decode.fused": Option(
        "fused", str, "off",
        "native backend: batch-1 decode steps as one persistent kernel (on, or auto: CUDA "
        "only, quietly off where the model does not fit); not bitwise the plan's logits",
        choices=("auto", "on", "off"),
    ),
    "offload.budget": Option(
        "budget", str, "100%", "device bytes for weights: bytes, '2GiB' or '50%'",
        check=_parse_check(parse_budget),
    ),
    "offload.piece": Option(
        "piece", str, "32MiB", "weights larger than this are streamed in pieces of this size",
        check=_parse_check(parse_piece),
    ),
}  # fmt: skip


@dataclass(frozen=True)
class Setting:
    """A resolved value and where it came from."""

    value: Any
    source: str  # "default", "config file PATH", "environment NAME", "command line --flag"

    def describe(self) -> str:
        return f"{self.value!r} (from {self.source})"


@dataclass(frozen=True)
class Config:
    """The effective configuration: every key with its value and source."""

    settings: Mapping[str, Setting]
    file: Path | None = None
    _registry: Registry | None = field(default=None, repr=False, compare=False)

    def __getitem__(self, key: str) -> Any:
        return self.settings[key].value

    def source(self, key: str) -> str:
        return self.settings[key].source

    def describe(self, key: str) -> str:
        return self.settings[key].describe()

    @property
    def budget(self) -> Budget:
        return parse_budget(self["offload.budget"])

    @property
    def piece_bytes(self) -> int:
        """``offload.piece`` in bytes."""
        return parse_piece(self["offload.piece"])

    def plugin_options(self, seam: Seam, name: str) -> dict[str, Any]:
        """The validated options of plugin ``name`` in ``seam`` (defaults filled in)."""
        prefix = f"{seam}.{name}."
        return {k[len(prefix) :]: s.value for k, s in self.settings.items() if k.startswith(prefix)}

    def create(self, seam: Seam) -> Any:
        """Instantiate the implementation chosen for ``seam`` with its options."""
        if self._registry is None:
            raise ConfigError("this Config was built without a registry; use load_config()")
        name = self[SEAM_KEYS[seam]]
        entry = self._registry.get(
            seam, name, where=f"{SEAM_KEYS[seam]} = {self.describe(SEAM_KEYS[seam])}"
        )
        made = entry.factory(self.plugin_options(seam, name))
        check_implements(seam, made, entry)
        return made

    def as_dict(self) -> dict[str, dict[str, Any]]:
        return {k: {"value": s.value, "source": s.source} for k, s in sorted(self.settings.items())}


_PROTOCOLS: dict[Seam, type] = {
    "kv_layout": KVLayout,
    "capture": CapturePolicy,
    "offload": OffloadPolicy,
}


def check_implements(seam: Seam, made: object, entry: Entry) -> None:
    """A factory must return an object with every method of its seam's Protocol."""
    protocol = _PROTOCOLS[seam]
    if isinstance(made, protocol):
        return
    # The Protocol's methods, plus its one attribute.
    required = sorted({n for n in vars(protocol) if not n.startswith("_")} | {"name"})
    missing = [n for n in required if not hasattr(made, n)]
    raise ContractError(
        f"{entry.plugin.describe()}: the factory of {seam.replace('_', ' ')} {entry.name!r} "
        f"returned {type(made).__name__}, which does not satisfy ep.seams.{protocol.__name__}; "
        f"missing: {', '.join(missing)}. Implement {', '.join(required)}"
    )


def _flatten(table: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in table.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_flatten(value, f"{path}."))
        else:
            out[path] = value
    return out


def _read_file(path: Path, *, explicit: bool) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        if explicit:
            raise ConfigError(
                f"config file {str(path)!r} (from --config) does not exist; "
                "give the path of a TOML file"
            ) from None
        return {}
    except OSError as exc:
        raise ConfigError(f"config file {str(path)!r} cannot be read: {exc}") from None
    try:
        return _flatten(tomllib.loads(text))
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {str(path)!r} is not valid TOML: {exc}") from None


def _env_layer(environ: Mapping[str, str], known: Iterable[str]) -> dict[str, tuple[Any, str]]:
    by_env = {"GENAI_EP_" + k.upper().replace(".", "__"): k for k in known}
    layer: dict[str, tuple[Any, str]] = {}
    for name, value in environ.items():
        if not name.startswith("GENAI_EP_") or name in NON_CONFIG_ENV:
            continue
        key = by_env.get(name)
        if key is None:
            candidates = sorted([*by_env, *NON_CONFIG_ENV])
            close = difflib.get_close_matches(name, candidates, n=1, cutoff=0.7)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise ConfigError(
                f"environment variable {name}={value!r} is not a genai-ep setting{hint}. "
                f"Config keys map to GENAI_EP_<SECTION>__<KEY>, e.g. GENAI_EP_DECODE__BACKEND; "
                "`genai-ep config show` lists every key"
            )
        layer[key] = (value, f"environment {name}")
    return layer


def _schema(registry: Registry) -> dict[str, Option]:
    schema = dict(CORE_OPTIONS)
    for entry in registry:
        if entry.seam == "op":
            continue
        for opt in entry.options:
            schema[f"{entry.seam}.{entry.name}.{opt.name}"] = opt
    return schema


def _unknown_key(
    key: str, raw: Any, source: str, schema: Mapping[str, Option], registry: Registry
) -> ConfigError:
    parts = key.split(".")
    if len(parts) == 3 and parts[0] in ("kv_layout", "capture", "offload"):
        seam: Seam = parts[0]  # type: ignore[assignment]  # checked just above
        if parts[1] not in registry.entries[seam]:
            names = registry.names(seam)
            close = difflib.get_close_matches(parts[1], names, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            return ConfigError(
                f"{key} = {raw!r} (from {source}): there is no {seam.replace('_', ' ')} plugin "
                f"{parts[1]!r}{hint}; registered: {', '.join(names) or 'none'}"
            )
        allowed = sorted(k.rsplit(".", 1)[1] for k in schema if k.startswith(f"{seam}.{parts[1]}."))
        close = difflib.get_close_matches(parts[2], allowed, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        return ConfigError(
            f"{key} = {raw!r} (from {source}): {seam.replace('_', ' ')} {parts[1]!r} has no option "
            f"{parts[2]!r}{hint}; its options: {', '.join(allowed) or 'none'}"
        )
    close = difflib.get_close_matches(key, list(schema), n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return ConfigError(
        f"unknown config key {key!r} = {raw!r} (from {source}){hint}. "
        "`genai-ep config show` lists every key"
    )


def load_config(
    registry: Registry,
    *,
    config_file: str | os.PathLike[str] | None = None,
    environ: Mapping[str, str] | None = None,
    cli: Mapping[str, tuple[Any, str]] | None = None,
    cwd: str | os.PathLike[str] | None = None,
) -> Config:
    """Resolve every key from defaults < file < environment < ``cli``.

    ``cli`` maps dotted keys to ``(raw value, "command line --flag")``. Without ``config_file``,
    ``./genai-ep.toml`` is read when it exists.
    """
    schema = _schema(registry)
    layers: list[dict[str, tuple[Any, str]]] = []

    explicit = config_file is not None
    if config_file is not None:
        path = Path(config_file)
    else:
        path = Path(cwd or os.getcwd()) / DEFAULT_CONFIG_FILE
    file_values = _read_file(path, explicit=explicit)
    layers.append({k: (v, f"config file {path}") for k, v in file_values.items()})
    layers.append(_env_layer(os.environ if environ is None else environ, schema))
    layers.append(dict(cli or {}))

    raw: dict[str, tuple[Any, str]] = {}
    for layer in layers:
        for key, (value, source) in layer.items():
            if key not in schema:
                raise _unknown_key(key, value, source, schema, registry)
            raw[key] = (value, source)

    settings: dict[str, Setting] = {}
    for key, opt in schema.items():
        value, source = raw.get(key, (opt.default, "default"))
        parsed = opt.parse(value, where=f"{key} = {value!r} (from {source})")
        settings[key] = Setting(parsed, source)

    for seam, key in SEAM_KEYS.items():
        s = settings[key]
        registry.get(seam, s.value, where=f"{key} = {s.describe()}")
    return Config(settings, path if file_values or explicit else None, registry)
