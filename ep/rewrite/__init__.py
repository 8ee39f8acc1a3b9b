"""Rewrite an existing decoder (onnxruntime-genai ``contrib`` or plain ``standard``) into this
project's ops, so it runs as an ``ep`` graph over a runtime-owned KV cache.

    report = rewrite_model("genai-fp32", "genai-fp32-ep")   # or: genai-ep rewrite MODEL -o OUT
    print(report.describe())

`PATTERNS` lists what is rewritten. Anything else is left as it is (with the reason in the
report) when the result still runs; the attention moves for every layer or for none, since it
changes the graph's I/O. See ep/rewrite/README.md.
"""

from __future__ import annotations

from ep.rewrite._rewrite import TOKENIZER_FILES, rewrite_graph, rewrite_model
from ep.rewrite._types import PATTERNS, LeftAlone, RewriteOptions, RewriteReport

__all__ = [
    "PATTERNS",
    "TOKENIZER_FILES",
    "LeftAlone",
    "RewriteOptions",
    "RewriteReport",
    "rewrite_graph",
    "rewrite_model",
]
