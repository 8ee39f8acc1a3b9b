"""Benchmark: the ``ort`` backend's Generator against a plain ONNX Runtime + NumPy loop.

Both run the same model with the same session settings, greedy, EOS masked so every run makes
exactly ``--new-tokens`` tokens per row; their tokens are asserted equal. The plain loop is what a
person would write: ``session.run`` with NumPy inputs, past grown by feeding ``present`` back (no
plugins, no IOBinding). Runs are interleaved (A B, B A, ...) after a warm-up; the figure is the
tokens/s ratio generator / plain per repeat pair, with median, min and max.

    .venv/bin/python tools/bench_ort_loop.py [--model DIR] [--batch 1 4] [--new-tokens 64]
        [--repeats 7] [--threads 0] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from _bench import machine_info, spread

from ep.model import DecoderModel, load_model
from ep.ort.session import SessionConfig, create_session
from ep.runtime import GenerationOptions, Generator
from ep_builtin.kv_head_major import HeadMajorLayout

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_MODEL = ROOT / "tests" / "data" / "genai-llama-tiny" / "genai-fp32"
PROMPT_LENGTHS = (12, 7, 10, 3)


def make_prompts(model: DecoderModel, batch: int) -> list[list[int]]:
    expected = model.folder.parent / "expected_tokens.json"
    if expected.is_file():
        prompts = json.loads(expected.read_text())["prompts"]
    else:
        rng = np.random.default_rng(0)
        prompts = [rng.integers(3, model.vocab_size, n).tolist() for n in PROMPT_LENGTHS]
    return [prompts[i % len(prompts)] for i in range(batch)]


class PlainLoop:
    """Greedy decode with session.run and NumPy: what one writes without this project."""

    def __init__(self, model: DecoderModel, threads: int) -> None:
        self.m = model
        self.sess = create_session(model.onnx_path, SessionConfig(intra_op_threads=threads))
        self.out_names = [o.name for o in self.sess.get_outputs()]
        self.eos = list(model.eos_token_ids)

    def generate(self, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
        m, io = self.m, self.m.io
        batch = len(prompts)
        lens = np.array([len(p) for p in prompts], dtype=np.int64)
        width = int(lens.max())
        ids = np.full((batch, width), m.pad_token_id, dtype=np.int64)
        # GroupQueryAttention graphs read per-row lengths from the mask sum: pad on the right.
        # Graphs with position_ids mask the pads: pad on the left.
        right = io.position_ids is None
        for b, p in enumerate(prompts):
            if right:
                ids[b, : len(p)] = p
            else:
                ids[b, width - len(p) :] = p
        if right:
            mask = (np.arange(width)[None, :] < lens[:, None]).astype(np.int64)
        else:
            mask = (np.arange(width)[None, :] >= (width - lens)[:, None]).astype(np.int64)
        empty = np.zeros((batch, m.kv_heads, 0, m.head_dim), dtype=m.kv_numpy_dtype)
        past = {name: empty for name in (*io.past_keys, *io.past_values)}
        pairs = list(
            zip(
                (*io.past_keys, *io.past_values),
                (*io.present_keys, *io.present_values),
                strict=True,
            )
        )
        out = np.empty((batch, new_tokens), dtype=np.int64)
        rows = np.arange(batch)
        for step in range(new_tokens):
            feed = {io.input_ids: ids, io.attention_mask: mask, **past}
            if io.position_ids:
                pos = np.maximum(np.cumsum(mask, axis=1) - 1, 0)[:, -ids.shape[1] :]
                feed[io.position_ids] = pos
            results = dict(zip(self.out_names, self.sess.run(None, feed), strict=True))
            logits = results[io.logits]
            first_right = step == 0 and right  # right padding: each row's own last position
            last = np.array(logits[rows, lens - 1] if first_right else logits[:, -1], np.float32)
            last[:, self.eos] = -np.inf
            token = last.argmax(axis=1)
            out[:, step] = token
            past = {p: results[q] for p, q in pairs}
            ids = token[:, None]
            if right:
                lens = lens + 1
                total = past[io.past_keys[0]].shape[2] + 1
                mask = (np.arange(total)[None, :] < lens[:, None]).astype(np.int64)
            else:
                mask = np.concatenate([mask, np.ones((batch, 1), dtype=np.int64)], axis=1)
        return out.tolist()


def bench(args: argparse.Namespace) -> dict[str, Any]:
    model = load_model(args.model)
    plain = PlainLoop(model, args.threads)
    # Token ids only, like the plain loop: no text decoding in the timed work.
    options = GenerationOptions(
        max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, decode_text=False
    )
    gen = Generator(model, layout=HeadMajorLayout(), options=options, threads=args.threads)
    results: dict[str, Any] = {
        "machine": machine_info("onnxruntime"),
        "model": model.describe(),
        "new_tokens": args.new_tokens,
        "repeats": args.repeats,
        "threads": args.threads or "onnxruntime default",
        "cases": [],
    }
    for batch in args.batch:
        prompts = make_prompts(model, batch)
        want = plain.generate(prompts, args.new_tokens)
        got = [list(t) for t in gen.generate(prompts).tokens]
        if got != want:
            raise SystemExit(f"batch {batch}: generator tokens differ from the plain loop")
        produced = batch * args.new_tokens
        tps: dict[str, list[float]] = {"generator": [], "plain": []}
        ratios = []
        best: dict[str, float] = {}
        for r in range(args.repeats):
            order = ("generator", "plain") if r % 2 == 0 else ("plain", "generator")
            seconds = {}
            for which in order:
                t0 = time.perf_counter()
                if which == "generator":
                    gen.generate(prompts)
                else:
                    plain.generate(prompts, args.new_tokens)
                seconds[which] = time.perf_counter() - t0
                tps[which].append(produced / seconds[which])
            ratios.append(seconds["plain"] / seconds["generator"])
            best["generator"] = min(best.get("generator", np.inf), seconds["generator"])
            best["plain"] = min(best.get("plain", np.inf), seconds["plain"])
        case = {
            "batch": batch,
            "prompt_lengths": [len(p) for p in prompts],
            "tokens_per_s": {k: spread(v) for k, v in tps.items()},
            "ratio_generator_over_plain": {
                **spread(ratios),
                "all": ratios,
                # the fastest run of each: robust to other load on a shared machine
                "of_best_runs": best["plain"] / best["generator"],
            },
        }
        results["cases"].append(case)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(DEFAULT_MODEL))
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=0, help="intra-op threads (0: default)")
    parser.add_argument("--json", type=Path, help="write the full results here")
    args = parser.parse_args(argv)
    results = bench(args)
    m = results["machine"]
    print(
        f"machine: {m['cpu']}, {m['cores']} cores ({m['usable_cores']} usable), "
        f"onnxruntime {m['onnxruntime']}, numpy {m['numpy']}, python {m['python']}"
    )
    print(f"model: {results['model']}")
    print(f"{args.new_tokens} new tokens per row, {args.repeats} interleaved repeats\n")
    print(
        f"{'batch':>5}  {'generator tok/s':>16}  {'plain tok/s':>12}  "
        f"{'ratio median':>12}  {'min':>6}  {'max':>6}  {'best/best':>9}"
    )
    for c in results["cases"]:
        t, r = c["tokens_per_s"], c["ratio_generator_over_plain"]
        print(
            f"{c['batch']:>5}  {t['generator']['median']:>16.0f}  {t['plain']['median']:>12.0f}  "
            f"{r['median']:>12.3f}  {r['min']:>6.3f}  {r['max']:>6.3f}  {r['of_best_runs']:>9.3f}"
        )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2) + "\n")
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
