"""The plugin host: finds plugins, calls their ``ep_register_*`` hooks, owns the registry.

Built-in plugins and third-party ones are found the same way, through entry points in the group
``genai_ep``. Unpackaged modules can be added with ``--plugin module.path`` or
``GENAI_EP_PLUGINS_EXTRA=mod1,mod2``. ``GENAI_EP_PLUGINS`` is an allowlist and
``GENAI_EP_DISABLE_PLUGINS`` a blocklist (entry-point names, distribution names or module paths);
``GENAI_EP_TRACE_HOOKS=1`` prints every hook call to stderr.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.metadata as md
import os
import sys
import traceback
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import ModuleType
from typing import Literal

import pluggy

from ep import hookspecs
from ep.errors import EPError, PluginLoadError
from ep.registry import SEAM_HOOKS, SEAMS, PluginRef, Register, Registry

__all__ = ["ENTRY_POINT_GROUP", "PluginHost", "PluginInfo", "get_host", "reset_host"]

ENTRY_POINT_GROUP = "genai_ep"
THIS_DISTRIBUTION = "genai-ep"


@dataclass(frozen=True)
class PluginInfo:
    """A loaded plugin, as `genai-ep plugins` shows it."""

    ref: PluginRef
    origin: Literal["builtin", "entry point", "local"]
    hooks: tuple[str, ...]

    def as_dict(self, registry: Registry) -> dict[str, object]:
        provides = {
            seam: [e.name for e in registry.entries[seam].values() if e.plugin == self.ref]
            for seam in SEAMS
        }
        return {
            "name": self.ref.name,
            "module": self.ref.module,
            "distribution": self.ref.distribution or None,
            "version": self.ref.version or None,
            "origin": self.origin,
            "hooks": list(self.hooks),
            "provides": {seam: names for seam, names in provides.items() if names},
        }


def _split(value: str | None) -> list[str]:
    return [part.strip() for part in (value or "").split(",") if part.strip()]


class PluginHost:
    """Loads plugins once and fills a frozen `Registry` from their hooks."""

    def __init__(
        self,
        *,
        extra_modules: Iterable[str] = (),
        environ: Mapping[str, str] | None = None,
        entry_points: Iterable[md.EntryPoint] | None = None,
    ) -> None:
        env = os.environ if environ is None else environ
        self.allow = set(_split(env.get("GENAI_EP_PLUGINS")))
        self.block = set(_split(env.get("GENAI_EP_DISABLE_PLUGINS")))
        self.pm = pluggy.PluginManager(hookspecs.PROJECT)
        self.pm.add_hookspecs(hookspecs)
        if env.get("GENAI_EP_TRACE_HOOKS", "") not in ("", "0"):
            self.pm.trace.root.setwriter(lambda msg: sys.stderr.write(f"[genai-ep] {msg}"))
            self.pm.enable_tracing()
        self.plugins: list[PluginInfo] = []
        self.registry = Registry()

        eps = md.entry_points(group=ENTRY_POINT_GROUP) if entry_points is None else entry_points
        for ep in sorted(eps, key=lambda e: e.name):
            self._load_entry_point(ep)
        for module in [*_split(env.get("GENAI_EP_PLUGINS_EXTRA")), *extra_modules]:
            self._load_local(module)
        self._check_pending()
        self._collect()
        self.registry.frozen = True

    # -- loading ----------------------------------------------------------------------------

    def _wanted(self, *names: str) -> bool:
        if self.allow and not self.allow.intersection(names):
            return False
        return not self.block.intersection(names)

    def _load_entry_point(self, ep: md.EntryPoint) -> None:
        dist = ep.dist.name if ep.dist is not None else ""
        version = ep.dist.version if ep.dist is not None else ""
        if not self._wanted(ep.name, dist, ep.value):
            return
        ref = PluginRef(ep.name, ep.value, dist, version)
        try:
            module = ep.load()
        except Exception as exc:
            raise PluginLoadError(
                f"{ref.describe()} failed to import: {type(exc).__name__}: {exc}\n"
                f"{_where(exc)}Fix or uninstall it, or skip it with "
                f"GENAI_EP_DISABLE_PLUGINS={ep.name}"
            ) from exc
        origin: Literal["builtin", "entry point"] = (
            "builtin" if dist == THIS_DISTRIBUTION else "entry point"
        )
        self._register(module, ref, origin)

    def _load_local(self, module_path: str) -> None:
        if not self._wanted(module_path):
            return
        ref = PluginRef(module_path, module_path, "", "")
        try:
            module = importlib.import_module(module_path)
        except Exception as exc:
            raise PluginLoadError(
                f"local plugin module {module_path!r} (from --plugin or GENAI_EP_PLUGINS_EXTRA) "
                f"failed to import: {type(exc).__name__}: {exc}\n{_where(exc)}"
                "Check the module path is importable (on sys.path / PYTHONPATH)"
            ) from exc
        self._register(module, ref, "local")

    def _register(
        self, module: ModuleType, ref: PluginRef, origin: Literal["builtin", "entry point", "local"]
    ) -> None:
        if self.pm.is_registered(module) or self.pm.has_plugin(ref.name):
            raise PluginLoadError(
                f"{ref.describe()} is loaded twice (as an entry point and with --plugin?); "
                "load it one way only"
            )
        try:
            self.pm.register(module, name=ref.name)
        except pluggy.PluginValidationError as exc:
            raise PluginLoadError(f"{ref.describe()} is not a valid plugin: {exc}") from exc
        hooks = tuple(sorted(c.name for c in self.pm.get_hookcallers(module) or ()))
        self.plugins.append(PluginInfo(ref, origin, hooks))

    def _check_pending(self) -> None:
        """A hook implementation with no matching spec is a misspelling: fail loudly."""
        try:
            self.pm.check_pending()
        except pluggy.PluginValidationError as exc:
            known = [name for name in dir(hookspecs) if name.startswith("ep_")]
            bad = [
                name
                for name in self.pm.hook.__dict__
                if name.startswith("ep_") and name not in known
            ]
            hints = []
            for name in bad:
                close = difflib.get_close_matches(name, known, n=1)
                hints.append(f"{name!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
            raise PluginLoadError(
                f"a plugin implements a hook genai-ep does not define: {', '.join(hints)}. "
                f"Known hooks: {', '.join(known)}. ({exc})"
            ) from exc

    def _collect(self) -> None:
        """Call each plugin's ``ep_register_*`` hooks with a register bound to that plugin."""
        refs = {info.ref.name: info.ref for info in self.plugins}
        for seam, hook_name in SEAM_HOOKS.items():
            caller = getattr(self.pm.hook, hook_name)
            for impl in caller.get_hookimpls():
                ref = refs[impl.plugin_name]
                others = [p for p in self.pm.get_plugins() if p is not impl.plugin]
                only_this = self.pm.subset_hook_caller(hook_name, remove_plugins=others)
                try:
                    only_this(register=Register(self.registry, seam, ref))
                except EPError:
                    raise
                except Exception as exc:
                    raise PluginLoadError(
                        f"{ref.describe()} raised in {hook_name}: {type(exc).__name__}: {exc}\n"
                        f"{_where(exc)}Skip it with GENAI_EP_DISABLE_PLUGINS={ref.name}"
                    ) from exc

    # -- queries ----------------------------------------------------------------------------

    def describe(self) -> list[dict[str, object]]:
        return [info.as_dict(self.registry) for info in self.plugins]


def _where(exc: BaseException) -> str:
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if not f.filename.startswith("<")]
    if not frames:
        return ""
    last = frames[-1]
    return f"  (at {last.filename}:{last.lineno})\n"


_default_host: PluginHost | None = None


def get_host(extra_modules: Iterable[str] = ()) -> PluginHost:
    """The process-wide host (plugins load once); extra modules make a fresh one."""
    global _default_host
    extra = tuple(extra_modules)
    if extra:
        return PluginHost(extra_modules=extra)
    if _default_host is None:
        _default_host = PluginHost()
    return _default_host


def reset_host() -> None:
    """Forget the process-wide host (tests that change the environment call this)."""
    global _default_host
    _default_host = None
