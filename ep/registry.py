"""Typed `register` objects handed to the ``ep_register_*`` hooks, and the registry they fill.

The host owns the registry: a plugin only calls ``register.add(...)``. The host knows which plugin
is calling (each plugin's hook implementation gets its own register), so a name clash names both
plugins and their distributions, and every entry can say where it came from.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from ep.errors import ConfigError, ContractError, PluginConflictError

__all__ = [
    "SEAMS",
    "SEAM_HOOKS",
    "Entry",
    "Option",
    "PluginRef",
    "Register",
    "Registry",
    "Seam",
]

Seam = Literal["kv_layout", "capture", "offload", "op"]
SEAMS: tuple[Seam, ...] = ("kv_layout", "capture", "offload", "op")

# The hook that fills each seam.
SEAM_HOOKS: dict[Seam, str] = {
    "kv_layout": "ep_register_kv_layouts",
    "capture": "ep_register_capture_policies",
    "offload": "ep_register_offload_policies",
    "op": "ep_register_ops",
}


@dataclass(frozen=True)
class PluginRef:
    """Who registered something: the plugin's name, module and distribution."""

    name: str
    module: str
    distribution: str  # "" for an unpackaged module given with --plugin
    version: str

    def describe(self) -> str:
        dist = f"{self.distribution} {self.version}" if self.distribution else "no distribution"
        return f"plugin {self.name!r} (module {self.module}, {dist})"


@dataclass(frozen=True)
class Option:
    """One option a plugin declares, validated by the host from any config source.

    ``type`` is one of bool, int, float, str. ``check`` returns an error message or "" for a
    valid value (for constraints beyond type and choices).
    """

    name: str
    type: type
    default: Any
    help: str
    choices: tuple[Any, ...] = ()
    check: Callable[[Any], str] | None = None

    def parse(self, raw: Any, *, where: str) -> Any:
        """Turn a TOML value (typed) or an environment/command-line string into ``type``."""
        value = _coerce(raw, self.type, where=where, name=self.name)
        if self.choices and value not in self.choices:
            allowed = ", ".join(repr(c) for c in self.choices)
            hint = _did_you_mean(str(value), [str(c) for c in self.choices])
            raise ConfigError(f"{where}: {value!r} is not allowed; expected one of {allowed}{hint}")
        if self.check is not None:
            problem = self.check(value)
            if problem:
                raise ConfigError(f"{where}: {value!r} is invalid: {problem}")
        return value


def _coerce(raw: Any, to: type, *, where: str, name: str) -> Any:
    if to is bool:
        if isinstance(raw, bool):
            return raw
        if isinstance(raw, str) and raw.strip().lower() in {"1", "true", "yes", "on"}:
            return True
        if isinstance(raw, str) and raw.strip().lower() in {"0", "false", "no", "off"}:
            return False
    elif to is int:
        if isinstance(raw, int) and not isinstance(raw, bool):
            return raw
        if isinstance(raw, str):
            try:
                return int(raw.strip().replace("_", ""), 0)
            except ValueError:
                pass
    elif to is float:
        if isinstance(raw, (int, float)) and not isinstance(raw, bool):
            return float(raw)
        if isinstance(raw, str):
            try:
                return float(raw)
            except ValueError:
                pass
    elif to is str:
        if isinstance(raw, str):
            return raw
    else:  # pragma: no cover - guarded when the option is declared
        raise TypeError(f"option {name}: unsupported type {to!r}")
    raise ConfigError(f"{where}: {raw!r} is not a valid {to.__name__}")


def _did_you_mean(word: str, candidates: list[str]) -> str:
    close = difflib.get_close_matches(word, candidates, n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


@dataclass(frozen=True)
class Entry:
    """One registered implementation: a named factory in a seam, and who provided it."""

    seam: Seam
    name: str
    factory: Callable[..., Any]
    options: tuple[Option, ...]
    description: str
    plugin: PluginRef

    def option(self, name: str) -> Option | None:
        return next((o for o in self.options if o.name == name), None)


@dataclass
class Registry:
    """Every seam's entries by name. Filled at start-up, frozen before the first use."""

    entries: dict[Seam, dict[str, Entry]] = field(
        default_factory=lambda: {seam: {} for seam in SEAMS}
    )
    frozen: bool = False

    def add(self, entry: Entry) -> None:
        if self.frozen:
            raise ContractError(
                f"{entry.plugin.describe()} registered {entry.seam} {entry.name!r} after start-up; "
                "register only from an ep_register_* hook"
            )
        seam = self.entries[entry.seam]
        if entry.name in seam:
            first = seam[entry.name].plugin
            raise PluginConflictError(
                f"two plugins register the {entry.seam} {entry.name!r}: {first.describe()} and "
                f"{entry.plugin.describe()}. Uninstall or disable one of them "
                "(GENAI_EP_DISABLE_PLUGINS=name), or rename one implementation"
            )
        seam[entry.name] = entry

    def get(self, seam: Seam, name: str, *, where: str = "") -> Entry:
        """The entry called ``name``; an unknown name is a ConfigError with a did-you-mean."""
        found = self.entries[seam].get(name)
        if found is None:
            known = sorted(self.entries[seam])
            prefix = f"{where}: " if where else ""
            raise ConfigError(
                f"{prefix}unknown {seam.replace('_', ' ')} {name!r}; registered: "
                f"{', '.join(known) or 'none'}{_did_you_mean(name, known)}. "
                "Run `genai-ep plugins` to see what is installed"
            )
        return found

    def names(self, seam: Seam) -> list[str]:
        return sorted(self.entries[seam])

    def __iter__(self) -> Iterator[Entry]:
        for seam in SEAMS:
            yield from self.entries[seam].values()


class Register:
    """What an ``ep_register_*`` hook receives: ``register.add(name, factory, ...)``.

    One register per plugin and seam, so the host always knows who registered what.
    """

    def __init__(self, registry: Registry, seam: Seam, plugin: PluginRef) -> None:
        self._registry = registry
        self._seam = seam
        self._plugin = plugin
        self._hook = SEAM_HOOKS[seam]

    @property
    def seam(self) -> Seam:
        return self._seam

    def add(
        self,
        name: str,
        factory: Callable[..., Any],
        *,
        options: tuple[Option, ...] | list[Option] = (),
        description: str = "",
    ) -> None:
        """Register ``factory`` under ``name``.

        For the three seams, ``factory(options)`` is called with a mapping of the declared options'
        validated values and must return an object satisfying the seam's Protocol. For ops,
        ``factory`` is the op definition itself (see ep.ops).
        """
        where = f"{self._plugin.describe()} in {self._hook}"
        if not isinstance(name, str) or not name.isidentifier():
            raise ContractError(
                f"{where}: name {name!r} must be a Python identifier (letters, digits, _)"
            )
        if not callable(factory) and self._seam != "op":
            raise ContractError(f"{where}: factory for {name!r} is not callable: {factory!r}")
        opts = tuple(options)
        for opt in opts:
            if not isinstance(opt, Option) or opt.type not in (bool, int, float, str):
                raise ContractError(
                    f"{where}: option {opt!r} of {name!r} must be an ep.Option of type "
                    "bool, int, float or str"
                )
            try:
                opt.parse(opt.default, where=f"{where}: default of option {opt.name!r}")
            except ConfigError as exc:
                raise ContractError(str(exc)) from None
        self._registry.add(
            Entry(self._seam, name, factory, opts, description.strip(), self._plugin)
        )


def option_values(entry: Entry, given: Mapping[str, Any]) -> dict[str, Any]:
    """Defaults of ``entry``'s options overlaid with already-validated ``given`` values."""
    values = {o.name: o.default for o in entry.options}
    values.update(given)
    return values
