"""The hooks a genai-ep plugin can implement.

A plugin is a module (or object) with functions named like these specs and decorated with
``ep.hookimpl``. The host calls every ``ep_register_*`` hook once at start-up, each plugin with its
own ``register`` object; the decode loop then calls the chosen implementations directly, never
through ``pm.hook`` per token.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from ep.registry import Register

PROJECT = "genai_ep"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


# ---------------------------------------------------------------------------------------------
# Start-up: contribute implementations
# ---------------------------------------------------------------------------------------------


@hookspec
def ep_register_kv_layouts(register: Register) -> None:
    """Contribute KV-cache layouts.

    :param register: call ``register.add(name, factory, options=..., description=...)`` once per
        layout. ``factory(options)`` receives the validated values of the declared options (from
        ``[kv_layout.NAME]`` in config) and returns an object satisfying ``ep.seams.KVLayout``.
    :return: nothing; return values are ignored.

    Called once per process, at start-up, before any configuration is resolved.

    For plugin authors: the layout only answers geometry questions (shape, strides, capacity
    buckets, growth plans); the core allocates and copies. A name already taken by another plugin
    is an error naming both plugins.
    """


@hookspec
def ep_register_capture_policies(register: Register) -> None:
    """Contribute CUDA-graph capture policies.

    :param register: call ``register.add(name, factory, options=..., description=...)`` once per
        policy; ``factory(options)`` returns an object satisfying ``ep.seams.CapturePolicy``
        (options come from ``[capture.NAME]``).
    :return: nothing; return values are ignored.

    Called once per process, at start-up.

    For plugin authors: ``decide`` returns a ``CaptureDecision`` with a reason; the core keeps the
    graphs, compares binding signatures before a replay and counts captures, replays,
    invalidations and fallbacks. A decline names its predicate and inputs.
    """


@hookspec
def ep_register_offload_policies(register: Register) -> None:
    """Contribute weight offload policies.

    :param register: call ``register.add(name, factory, options=..., description=...)`` once per
        policy; ``factory(options)`` returns an object satisfying ``ep.seams.OffloadPolicy``
        (options come from ``[offload.NAME]``).
    :return: nothing; return values are ignored.

    Called once per process, at start-up.

    For plugin authors: ``plan`` returns a placement per weight under the byte budget, with a
    reason; the core owns the pinned host store, the device arena, the copies and every counter.
    Say ``capture_safe=True`` only when no weight address changes during decode.
    """


@hookspec
def ep_register_ops(register: Register) -> None:
    """Contribute custom ops (schema, NumPy reference, device kernels) to this project's domain.

    :param register: call ``register.add(op.name, op)`` with an op definition from ``ep.ops``.
    :return: nothing; return values are ignored.

    Called once per process, at start-up, before the op set is registered into ONNX Runtime and
    frozen (ORT-NOTES.md: defining ops after a session exists can crash the process).

    For plugin authors: every op needs a NumPy reference; device kernels are optional and keyed by
    device. The host checks each output's shape and dtype against the schema.
    """
