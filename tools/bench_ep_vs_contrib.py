"""Benchmark: whole-model tokens/s of the ``ep`` flavour against the ``contrib`` flavour, CPU.

Both models carry the same weights: either both built by ep_graphs from one checkpoint or spec
(``--from build``, the default: the genai-llama-tiny checkpoint), or an onnxruntime-genai folder
and its rewrite by ``genai-ep rewrite`` (``--from rewrite``). Both run through the same
`Generator` on the ``ort`` backend (greedy, EOS masked so every row makes ``--new-tokens``
tokens); their tokens are asserted equal first. Runs are interleaved (A B, B A, ...) after a
warm-up; reported per batch: tokens/s of each (median, min, max) and the ratio ep / contrib per
repeat pair (median, min, max, and of the best runs).

    .venv/bin/python tools/bench_ep_vs_contrib.py [--from build|rewrite] [--hf DIR | --spec S]
        [--genai DIR] [--batch 1 4] [--new-tokens 32] [--repeats 5] [--threads 0] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from _bench import machine_info, spread

from ep.model import DecoderModel, load_model
from ep.rewrite import rewrite_model
from ep.runtime import GenerationOptions, Generator
from ep_builtin.kv_head_major import HeadMajorLayout
from ep_graphs import ModelSpec, build_model, load_hf_checkpoint, random_weights

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "tests" / "data" / "genai-llama-tiny"
PROMPT_LENGTHS = (12, 7, 10, 3)


def make_models(args: argparse.Namespace, work: Path) -> tuple[DecoderModel, DecoderModel, str]:
    """(ep model, contrib model, how they were made)."""
    if args.source == "rewrite":
        genai = Path(args.genai)
        rewrite_model(genai, work / "ep")
        return load_model(work / "ep"), load_model(genai), f"{genai} and its rewrite"
    if args.spec:
        spec = ModelSpec.parse(args.spec)
        weights = random_weights(spec, seed=0)
        made = f"spec {args.spec} (seed 0), built in both flavours"
    else:
        spec, weights = load_hf_checkpoint(Path(args.hf))
        made = f"checkpoint {args.hf}, built in both flavours"
    for flavour in ("ep", "contrib"):
        build_model(spec, weights, flavour=flavour, out_dir=work / flavour, progress=False)
    return load_model(work / "ep"), load_model(work / "contrib"), made


def make_prompts(model: DecoderModel, batch: int) -> list[list[int]]:
    expected = TINY / "expected_tokens.json"
    if model.vocab_size == 512 and expected.is_file():
        prompts = json.loads(expected.read_text())["prompts"]
    else:
        rng = np.random.default_rng(0)
        prompts = [rng.integers(3, model.vocab_size, n).tolist() for n in PROMPT_LENGTHS]
    return [prompts[i % len(prompts)] for i in range(batch)]


def bench(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="bench-ep-") as tmp:
        ep_model, contrib_model, made = make_models(args, Path(tmp))
        options = GenerationOptions(
            max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, decode_text=False
        )
        gens = {
            name: Generator(m, layout=HeadMajorLayout(), options=options, threads=args.threads)
            for name, m in (("ep", ep_model), ("contrib", contrib_model))
        }
        results: dict[str, Any] = {
            "machine": machine_info("onnxruntime", "onnxruntime-extensions"),
            "models": {
                "made_from": made,
                "ep": ep_model.describe(),
                "contrib": contrib_model.describe(),
            },
            "new_tokens": args.new_tokens,
            "repeats": args.repeats,
            "threads": args.threads or "onnxruntime default",
            "cases": [],
        }
        for batch in args.batch:
            prompts = make_prompts(ep_model, batch)
            got = {name: [list(t) for t in g.generate(prompts).tokens] for name, g in gens.items()}
            if got["ep"] != got["contrib"]:
                raise SystemExit(f"batch {batch}: the ep flavour's tokens differ from contrib's")
            produced = batch * args.new_tokens
            tps: dict[str, list[float]] = {"ep": [], "contrib": []}
            ratios = []
            best = {"ep": np.inf, "contrib": np.inf}
            for r in range(args.repeats):
                order = ("ep", "contrib") if r % 2 == 0 else ("contrib", "ep")
                seconds = {}
                for name in order:
                    t0 = time.perf_counter()
                    gens[name].generate(prompts)
                    seconds[name] = time.perf_counter() - t0
                    tps[name].append(produced / seconds[name])
                    best[name] = min(best[name], seconds[name])
                ratios.append(seconds["contrib"] / seconds["ep"])
            results["cases"].append(
                {
                    "batch": batch,
                    "prompt_lengths": [len(p) for p in prompts],
                    "tokens_per_s": {k: spread(v) for k, v in tps.items()},
                    "ratio_ep_over_contrib": {
                        **spread(ratios),
                        "all": ratios,
                        "of_best_runs": best["contrib"] / best["ep"],
                    },
                }
            )
        for g in gens.values():
            close = getattr(g.backend, "close", None)
            if callable(close):
                close()
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--from", dest="source", choices=("build", "rewrite"), default="build")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--hf", default=str(TINY / "hf"), help="checkpoint for --from build")
    source.add_argument("--spec", help="random-weight spec for --from build")
    parser.add_argument("--genai", default=str(TINY / "genai-fp32"), help="for --from rewrite")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=0, help="intra-op threads (0: default)")
    parser.add_argument("--json", type=Path, help="write the full results here")
    args = parser.parse_args(argv)
    if args.new_tokens < 1 or args.repeats < 1 or min(args.batch) < 1:
        parser.error("--new-tokens, --repeats and --batch must be >= 1")
    results = bench(args)
    m = results["machine"]
    print(
        f"machine: {m['cpu']}, {m['cores']} cores ({m['usable_cores']} usable), onnxruntime "
        f"{m['onnxruntime']}, extensions {m['onnxruntime_extensions']}, numpy {m['numpy']}"
    )
    print(f"models: {results['models']['made_from']}")
    print(f"{args.new_tokens} new tokens per row, {args.repeats} interleaved repeats\n")
    print(
        f"{'batch':>5}  {'ep tok/s':>9}  {'contrib tok/s':>13}  {'ep/contrib':>10}  "
        f"{'min':>6}  {'max':>6}  {'best/best':>9}"
    )
    for c in results["cases"]:
        t, r = c["tokens_per_s"], c["ratio_ep_over_contrib"]
        print(
            f"{c['batch']:>5}  {t['ep']['median']:>9.0f}  {t['contrib']['median']:>13.0f}  "
            f"{r['median']:>10.3f}  {r['min']:>6.3f}  {r['max']:>6.3f}  {r['of_best_runs']:>9.3f}"
        )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2) + "\n")
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
