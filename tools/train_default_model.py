"""Train the bundled default model: a small Llama on the Python standard library's own sources.

Torch is a development tool for this script only, never a runtime dependency of genai-ep. Run it
from the repository root in its own virtual environment:

    python3 -m venv /tmp/torchvenv
    /tmp/torchvenv/bin/pip install torch==2.13.0 numpy safetensors tokenizers
    /tmp/torchvenv/bin/python tools/train_default_model.py --out graphs/ep_graphs/default_model

(`torch==2.13.0` is the CPU build on this machine's disk; plain `torch` pulls a CUDA build of
several GB.) With the defaults it trains on one CPU thread for at most `--time-budget` seconds and
writes a Hugging Face Llama checkpoint folder: config.json, generation_config.json,
model.safetensors, tokenizer.json and tokenizer_config.json. README.md in that folder is written by
hand from this script's log.

Reproducibility: the file list is sorted, the validation split is a hash of each file's relative
path, and every random draw comes from generators seeded by `--seed`. The number of optimizer steps
is measured during warm-up (where the learning rate does not depend on it) unless `--steps` is
given, and the log prints `reproduce: ... --steps N`; the same command with that N on the same
Python version's stdlib, torch version and thread count gives the same weights.

The model has exactly Hugging Face Llama semantics (RMSNorm, half-split rotary embedding, grouped
query attention, SwiGLU, no biases, tied embeddings) so that a converter reading HF checkpoints
reproduces it; `--check-hf` compares it with `transformers` when that is installed.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import os
import platform
import sys
import sysconfig
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

try:
    import numpy as np
    import torch
    import torch.nn.functional as F
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from torch import nn
except ImportError as exc:  # the project's own venv deliberately has no torch
    raise SystemExit(
        f"train_default_model: cannot import {exc.name!r}; this script needs torch, numpy, "
        "safetensors and tokenizers in a separate venv: python3 -m venv /tmp/torchvenv && "
        "/tmp/torchvenv/bin/pip install torch==2.13.0 numpy safetensors tokenizers"
    ) from None

UNK, BOS, EOS = "<unk>", "<s>", "</s>"
UNK_ID, BOS_ID, EOS_ID = 0, 1, 2
PAD_ID = UNK_ID

# Directories whose sources are not representative Python: test suites (huge, repetitive),
# bundled third-party code, byte caches, generated data tables and build configuration.
SKIP_DIRS = frozenset(
    {"test", "tests", "idle_test", "site-packages", "__pycache__", "pydoc_data", "lib-dynload"}
)
MAX_FILE_BYTES = 300_000  # above this a stdlib .py file is generated data, not code
# The charmap codecs in encodings/ are 256-entry tables written by Tools/unicode/gencodec.py.
GENERATED_MARKERS = ("gencodec.py",)


# --- options ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelConfig:
    """Sizes of the Llama decoder; names and meanings are those of HF's LlamaConfig."""

    vocab_size: int = 1024
    hidden_size: int = 192
    intermediate_size: int = 512
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 48
    max_position_embeddings: int = 256
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    initializer_range: float = 0.02


@dataclass(frozen=True)
class TrainConfig:
    """Everything that decides the weights, besides the data and the model sizes."""

    seed: int = 1234
    batch_size: int = 8
    seq_len: int = 256
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    steps: int | None = None  # None: measured in warm-up to fit the time budget
    stop_after: int | None = None  # cut the schedule short here (replays a budget-stopped run)
    time_budget_s: float = 1800.0
    eval_every: int = 100
    eval_batches: int = 8
    threads: int = 1
    val_percent: int = 2


# --- data ------------------------------------------------------------------------------------


def stdlib_root() -> Path:
    """The directory of this interpreter's standard library sources."""
    return Path(sysconfig.get_paths()["stdlib"])


def collect_sources(root: Path) -> list[Path]:
    """Stdlib .py files worth learning from, sorted by relative POSIX path (deterministic)."""
    picked: list[Path] = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        dirs = rel.parts[:-1]
        if any(d in SKIP_DIRS or d.startswith("config-") for d in dirs):
            continue
        name = rel.name
        if name.startswith(("test_", "_sysconfigdata")):
            continue
        if not path.is_file() or path.stat().st_size > MAX_FILE_BYTES:
            continue
        picked.append(path)
    return sorted(picked, key=lambda p: p.relative_to(root).as_posix())


def read_sources(root: Path, paths: Sequence[Path]) -> list[tuple[str, str]]:
    """(relative path, text) for each file that is UTF-8 and not a generated table."""
    out: list[tuple[str, str]] = []
    for path in paths:
        try:
            text = path.read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            continue  # a handful of legacy files; skipping them keeps the decode strict
        head = text[:2000]
        if any(marker in head for marker in GENERATED_MARKERS):
            continue
        out.append((path.relative_to(root).as_posix(), text))
    return out


def is_validation(rel_path: str, val_percent: int) -> bool:
    """Hash split: stable whatever other files exist, unlike an index-based split."""
    digest = hashlib.sha256(rel_path.encode("utf-8")).digest()
    return int.from_bytes(digest[:4], "big") % 100 < val_percent


def data_fingerprint(docs: Sequence[tuple[str, str]]) -> str:
    """sha256 over paths and contents in order, so two runs can tell they saw the same data."""
    h = hashlib.sha256()
    for rel, text in docs:
        h.update(rel.encode("utf-8") + b"\0" + text.encode("utf-8") + b"\0")
    return h.hexdigest()


# --- tokenizer -------------------------------------------------------------------------------


def train_tokenizer(texts: Sequence[str], vocab_size: int) -> Tokenizer:
    """A byte-level BPE with <unk>=0, <s>=1, </s>=2; any text round-trips through it."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[UNK, BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    # Like Llama tokenizers: encode() starts with <s>; decode(skip_special_tokens) drops it.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, BOS_ID)]
    )
    ids = [tok.token_to_id(t) for t in (UNK, BOS, EOS)]
    if ids != [UNK_ID, BOS_ID, EOS_ID] or tok.get_vocab_size() != vocab_size:
        raise SystemExit(
            f"tokenizer: special ids {ids}, vocab {tok.get_vocab_size()}; expected "
            f"[{UNK_ID}, {BOS_ID}, {EOS_ID}] and {vocab_size}: lower --vocab-size for this data"
        )
    return tok


def encode_stream(tok: Tokenizer, texts: Sequence[str]) -> np.ndarray:
    """All texts as one int32 token stream, each followed by </s>."""
    pieces: list[np.ndarray] = []
    for enc in tok.encode_batch(list(texts), add_special_tokens=False):
        pieces.append(np.asarray([*enc.ids, EOS_ID], dtype=np.int32))
    return np.concatenate(pieces)


# --- model (plain torch, Hugging Face Llama semantics) ---------------------------------------


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """HF's half-split convention: (x1, x2) -> (-x2, x1) over the last dim's two halves."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope_cos_sin(
    positions: torch.Tensor, head_dim: int, theta: float
) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        d, hd = cfg.hidden_size, cfg.head_dim
        self.q_proj = nn.Linear(d, cfg.num_attention_heads * hd, bias=False)
        self.k_proj = nn.Linear(d, cfg.num_key_value_heads * hd, bias=False)
        self.v_proj = nn.Linear(d, cfg.num_key_value_heads * hd, bias=False)
        self.o_proj = nn.Linear(cfg.num_attention_heads * hd, d, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        c = self.cfg
        q = self.q_proj(x).view(b, t, c.num_attention_heads, c.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        # HF repeat_kv: KV head j serves query heads j*rep .. j*rep+rep-1.
        rep = c.num_attention_heads // c.num_key_value_heads
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=c.head_dim**-0.5)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, c.num_attention_heads * c.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaBody(nn.Module):
    """Attribute names mirror HF's `LlamaModel` so state_dict keys get the `model.` prefix."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """Decoder with tied embeddings: the LM head is `model.embed_tokens.weight`."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = LlamaBody(cfg)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        t = ids.shape[1]
        if t > self.cfg.max_position_embeddings:
            raise ValueError(f"sequence of {t} tokens > {self.cfg.max_position_embeddings}")
        cos, sin = rope_cos_sin(
            torch.arange(t, device=ids.device), self.cfg.head_dim, self.cfg.rope_theta
        )
        x = self.model.embed_tokens(ids)
        for layer in self.model.layers:
            x = layer(x, cos, sin)
        return self.model.norm(x) @ self.model.embed_tokens.weight.T

    def init_weights(self, generator: torch.Generator) -> None:
        """Normal(0, initializer_range); residual outputs scaled by 1/sqrt(2 * layers)."""
        std = self.cfg.initializer_range
        resid_std = std / math.sqrt(2 * self.cfg.num_hidden_layers)
        for name, p in self.named_parameters():
            if name.endswith("layernorm.weight") or name == "model.norm.weight":
                nn.init.ones_(p)
            elif name.endswith(("o_proj.weight", "down_proj.weight")):
                nn.init.normal_(p, 0.0, resid_std, generator=generator)
            else:
                nn.init.normal_(p, 0.0, std, generator=generator)


def count_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


# --- training --------------------------------------------------------------------------------


def lr_at(step: int, total: int, tc: TrainConfig) -> float:
    """Linear warm-up, then cosine to min_lr_ratio * lr. Warm-up does not depend on `total`."""
    if step < tc.warmup_steps:
        return tc.lr * (step + 1) / tc.warmup_steps
    progress = min(1.0, (step - tc.warmup_steps) / max(1, total - tc.warmup_steps))
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    return tc.lr * (tc.min_lr_ratio + (1.0 - tc.min_lr_ratio) * cosine)


def batches(stream: np.ndarray, tc: TrainConfig, generator: torch.Generator) -> Iterator[Any]:
    """Random windows of the token stream, each prefixed with <s> ("start of context")."""
    body = tc.seq_len  # <s> + (seq_len - 1) inputs, targets shifted by one: seq_len + 1 tokens
    data = torch.from_numpy(stream.astype(np.int64))
    high = len(stream) - body
    while True:
        starts = torch.randint(0, high, (tc.batch_size,), generator=generator)
        rows = torch.stack([data[s : s + body] for s in starts.tolist()])
        bos = torch.full((tc.batch_size, 1), BOS_ID, dtype=torch.int64)
        seq = torch.cat((bos, rows), dim=1)
        yield seq[:, :-1], seq[:, 1:]


def fixed_val_batches(stream: np.ndarray, tc: TrainConfig, count: int) -> list[Any]:
    """Evenly spaced, non-overlapping validation windows: the same every eval."""
    body = tc.seq_len
    n_windows = min(count * tc.batch_size, (len(stream) - 1) // body)
    stride = (len(stream) - body - 1) // max(1, n_windows)
    data = torch.from_numpy(stream.astype(np.int64))
    rows = [data[i * stride : i * stride + body] for i in range(n_windows)]
    out = []
    for i in range(0, n_windows, tc.batch_size):
        chunk = torch.stack(rows[i : i + tc.batch_size])
        bos = torch.full((chunk.shape[0], 1), BOS_ID, dtype=torch.int64)
        seq = torch.cat((bos, chunk), dim=1)
        out.append((seq[:, :-1], seq[:, 1:]))
    return out


@torch.no_grad()
def evaluate(model: LlamaForCausalLM, val: Sequence[Any]) -> float:
    model.eval()
    total, count = 0.0, 0
    for x, y in val:
        logits = model(x)
        total += F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum").item()
        count += y.numel()
    model.train()
    return total / count


def make_optimizer(model: nn.Module, tc: TrainConfig) -> torch.optim.Optimizer:
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    groups = [
        {"params": decay, "weight_decay": tc.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    # foreach=False: the single-tensor path is the reference one, same on every build.
    return torch.optim.AdamW(groups, lr=tc.lr, betas=(tc.beta1, tc.beta2), eps=1e-8, foreach=False)


def log(msg: str) -> None:
    print(msg, flush=True)


def train(
    model: LlamaForCausalLM, train_stream: np.ndarray, val_stream: np.ndarray, tc: TrainConfig
) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(tc.seed + 1)
    opt = make_optimizer(model, tc)
    val = fixed_val_batches(val_stream, tc, tc.eval_batches)
    it = batches(train_stream, tc, gen)
    total = tc.steps if tc.steps is not None else 10**9
    t0 = time.monotonic()
    timed_from: float | None = None
    history: list[dict[str, float]] = []
    ema: float | None = None
    step = 0
    stopped_by_budget = False
    while step < total:
        if tc.steps is None and step == 10:
            timed_from = time.monotonic()
        if tc.steps is None and step == tc.warmup_steps and timed_from is not None:
            # Steps 10..warm-up measure speed (earlier steps include allocator warm-up).
            per_step = (time.monotonic() - timed_from) / (step - 10)
            per_step *= 1.0 + 3.0 / tc.eval_every  # an eval costs about 3 steps
            remaining = tc.time_budget_s * 0.92 - (time.monotonic() - t0) - 60.0
            total = max(step + 1, step + int(remaining / per_step))
            log(f"plan: {per_step:.3f} s/step measured -> {total} steps in total")
        lr = lr_at(step, total, tc)
        for group in opt.param_groups:
            group["lr"] = lr
        x, y = next(it)
        logits = model(x)
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), tc.grad_clip))
        opt.step()
        step += 1
        value = float(loss.item())
        ema = value if ema is None else 0.98 * ema + 0.02 * value
        elapsed = time.monotonic() - t0
        if step % 20 == 0 or step == 1:
            tok_s = step * tc.batch_size * tc.seq_len / elapsed
            log(
                f"step {step:5d}/{total if total < 10**9 else '?'} loss {value:.4f} "
                f"ema {ema:.4f} lr {lr:.2e} gnorm {gnorm:.2f} {tok_s:.0f} tok/s "
                f"{elapsed:.0f}s"
            )
        if step % tc.eval_every == 0 or step == total:
            vl = evaluate(model, val)
            history.append({"step": step, "train_ema": ema, "val": vl, "elapsed_s": elapsed})
            log(f"eval step {step} val_loss {vl:.4f} (ppl {math.exp(vl):.2f}) {elapsed:.0f}s")
        if tc.stop_after is not None and step >= tc.stop_after:
            log(f"stop: --stop-after {tc.stop_after}")
            break
        if tc.time_budget_s > 0 and elapsed > tc.time_budget_s:
            stopped_by_budget = True
            log(f"stop: time budget {tc.time_budget_s:.0f}s spent at step {step} of {total}")
            break
    return {
        "steps": step,
        "planned_steps": total,
        "train_seconds": time.monotonic() - t0,
        "stopped_by_budget": stopped_by_budget,
        "history": history,
        "train_loss_ema": ema,
    }


# --- sampling --------------------------------------------------------------------------------


@torch.no_grad()
def generate(
    model: LlamaForCausalLM,
    tok: Tokenizer,
    prompt: str,
    new_tokens: int,
    temperature: float,
    generator: torch.Generator,
) -> str:
    """Greedy when temperature is 0; plain softmax sampling otherwise. Stops at </s>."""
    model.eval()
    ids = tok.encode(prompt).ids  # starts with <s> (post-processor)
    for _ in range(new_tokens):
        window = ids[-model.cfg.max_position_embeddings :]
        logits = model(torch.tensor([window]))[0, -1]
        if temperature <= 0:
            nxt = int(logits.argmax())
        else:
            probs = torch.softmax(logits / temperature, dim=-1)
            nxt = int(torch.multinomial(probs, 1, generator=generator))
        if nxt == EOS_ID:
            break
        ids.append(nxt)
    return str(tok.decode(ids, skip_special_tokens=True))


# --- output ----------------------------------------------------------------------------------


def hf_config(cfg: ModelConfig) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "hidden_act": "silu",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "vocab_size": cfg.vocab_size,
        "max_position_embeddings": cfg.max_position_embeddings,
        "rope_theta": cfg.rope_theta,
        # transformers >= 5 reads this form; older versions read rope_theta above.
        "rope_parameters": {"rope_theta": cfg.rope_theta, "rope_type": "default"},
        "rope_scaling": None,
        "rms_norm_eps": cfg.rms_norm_eps,
        "initializer_range": cfg.initializer_range,
        "tie_word_embeddings": True,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "pad_token_id": PAD_ID,
        "pretraining_tp": 1,
        "use_cache": True,
        "torch_dtype": "float32",
        "dtype": "float32",
    }


def save_checkpoint(out: Path, model: LlamaForCausalLM, tok: Tokenizer, cfg: ModelConfig) -> None:
    out.mkdir(parents=True, exist_ok=True)
    # Tied: only model.embed_tokens.weight is stored, as HF does with tie_word_embeddings.
    tensors = {k: v.detach().contiguous().float() for k, v in model.state_dict().items()}
    # One metadata key only: safetensors writes a map's keys in no fixed order, and the file
    # must be byte-identical across reruns.
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "model.safetensors").chmod(0o644)  # safetensors creates it 0600
    (out / "config.json").write_text(json.dumps(hf_config(cfg), indent=2) + "\n")
    gen_cfg = {
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "pad_token_id": PAD_ID,
        "do_sample": False,
    }
    (out / "generation_config.json").write_text(json.dumps(gen_cfg, indent=2) + "\n")
    tok.save(str(out / "tokenizer.json"))
    tok_cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "unk_token": UNK,
        "pad_token": UNK,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": cfg.max_position_embeddings,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2) + "\n")


def check_against_transformers(out: Path, model: LlamaForCausalLM) -> None:
    """Load the written folder with transformers and compare logits with this model's."""
    try:
        import transformers
    except ImportError:
        log("check-hf: transformers is not installed; skipped")
        return
    hf = transformers.LlamaForCausalLM.from_pretrained(str(out), torch_dtype=torch.float32)
    hf.eval()
    model.eval()
    ids = torch.randint(3, model.cfg.vocab_size, (2, model.cfg.max_position_embeddings))
    with torch.no_grad():
        ours = model(ids)
        theirs = hf(ids).logits
    diff = float((ours - theirs).abs().max())
    log(f"check-hf: transformers {transformers.__version__} max |logit diff| {diff:.3e}")
    if diff > 1e-3:
        raise SystemExit(f"check-hf: logits differ by {diff:.3e} (> 1e-3): semantics diverge")


# --- command line ----------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    mc, tc = ModelConfig(), TrainConfig()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--out", type=Path, default=Path("graphs/ep_graphs/default_model"))
    p.add_argument("--stdlib", type=Path, default=None, help="default: this Python's stdlib")
    for f in dataclasses.fields(ModelConfig):
        p.add_argument(
            f"--{f.name.replace('_', '-')}",
            type=type(getattr(mc, f.name)),
            default=getattr(mc, f.name),
        )
    for f in dataclasses.fields(TrainConfig):
        if f.name in ("steps", "stop_after", "time_budget_s"):
            continue
        p.add_argument(
            f"--{f.name.replace('_', '-')}",
            type=type(getattr(tc, f.name)),
            default=getattr(tc, f.name),
        )
    p.add_argument(
        "--steps",
        type=int,
        default=None,
        help="optimizer steps; default: measured in warm-up to fit --time-budget",
    )
    p.add_argument(
        "--stop-after",
        type=int,
        default=None,
        help="stop after this many steps of the --steps schedule (replays a run that "
        "the time budget cut short)",
    )
    p.add_argument(
        "--time-budget",
        type=float,
        default=tc.time_budget_s,
        help="wall-clock seconds for training (hard stop; 0 = none)",
    )
    p.add_argument("--max-weight-bytes", type=int, default=8_000_000)
    p.add_argument(
        "--check-hf",
        action="store_true",
        help="compare logits with transformers' LlamaForCausalLM on the written folder",
    )
    p.add_argument("--sample-tokens", type=int, default=80)
    return p.parse_args(argv)


def reproduce_command(argv: Sequence[str], result: dict[str, Any]) -> str:
    """This run's flags with the step count pinned, so a rerun needs no timing."""
    kept: list[str] = []
    skip_value = False
    for arg in argv:
        if skip_value:
            skip_value = False
            continue
        if arg in ("--steps", "--stop-after", "--time-budget"):
            skip_value = True
            continue
        if arg.startswith(("--steps=", "--stop-after=", "--time-budget=")):
            continue
        kept.append(arg)
    # No time budget: a slower machine must not cut the replay short.
    kept += ["--steps", str(result["planned_steps"]), "--time-budget", "0"]
    if result["steps"] != result["planned_steps"]:
        kept += ["--stop-after", str(result["steps"])]
    return " ".join(["python", "tools/train_default_model.py", *kept])


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    mc = ModelConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(ModelConfig)})
    tc = TrainConfig(
        **{
            f.name: getattr(args, f.name)
            for f in dataclasses.fields(TrainConfig)
            if f.name not in ("steps", "stop_after", "time_budget_s")
        },
        steps=args.steps,
        stop_after=args.stop_after,
        time_budget_s=args.time_budget,
    )
    if mc.num_attention_heads % mc.num_key_value_heads or mc.head_dim % 2:
        raise SystemExit(
            f"model: {mc.num_attention_heads} heads, {mc.num_key_value_heads} KV heads, head_dim "
            f"{mc.head_dim}; heads must be a multiple of KV heads and head_dim even"
        )
    if tc.seq_len > mc.max_position_embeddings:
        raise SystemExit(f"--seq-len {tc.seq_len} > --max-position-embeddings; lower it")
    # The tokenizer trainer is multi-threaded; one thread keeps the machine shared and the
    # merges in a fixed order.
    os.environ.setdefault("RAYON_NUM_THREADS", str(tc.threads))
    torch.set_num_threads(tc.threads)
    torch.manual_seed(tc.seed)
    t_start = time.monotonic()

    log(f"python {platform.python_version()} torch {torch.__version__} threads {tc.threads}")
    log(f"model {dataclasses.asdict(mc)}")
    log(f"train {dataclasses.asdict(tc)}")
    root = args.stdlib or stdlib_root()
    docs = read_sources(root, collect_sources(root))
    train_docs = [d for d in docs if not is_validation(d[0], tc.val_percent)]
    val_docs = [d for d in docs if is_validation(d[0], tc.val_percent)]
    log(
        f"data: {root} {len(docs)} files ({len(train_docs)} train, {len(val_docs)} val), "
        f"{sum(len(t) for _, t in docs) / 1e6:.2f} M chars, sha256 {data_fingerprint(docs)}"
    )
    tok = train_tokenizer([t for _, t in train_docs], mc.vocab_size)
    train_stream = encode_stream(tok, [t for _, t in train_docs])
    val_stream = encode_stream(tok, [t for _, t in val_docs])
    chars = sum(len(t) for _, t in train_docs)
    log(
        f"tokens: {len(train_stream)} train, {len(val_stream)} val, "
        f"{chars / len(train_stream):.2f} chars/token ({time.monotonic() - t_start:.0f}s)"
    )

    model = LlamaForCausalLM(mc)
    model.init_weights(torch.Generator().manual_seed(tc.seed))
    n_params = count_params(model)
    if n_params * 4 > args.max_weight_bytes:
        raise SystemExit(
            f"model: {n_params} parameters = {n_params * 4} bytes in float32 > "
            f"--max-weight-bytes {args.max_weight_bytes}; shrink the model"
        )
    log(f"params: {n_params} ({n_params * 4 / 1e6:.2f} MB float32)")

    result = train(model, train_stream, val_stream, tc)
    full_val = evaluate(model, fixed_val_batches(val_stream, tc, 10**6))
    log(
        f"final: steps {result['steps']} train_loss_ema {result['train_loss_ema']:.4f} "
        f"val_loss {full_val:.4f} (all {len(val_stream)} val tokens) "
        f"train {result['train_seconds']:.0f}s"
    )
    save_checkpoint(args.out, model, tok, mc)
    log(
        f"wrote {args.out}: "
        + ", ".join(f"{p.name} {p.stat().st_size}" for p in sorted(args.out.iterdir()))
    )

    sample_gen = torch.Generator().manual_seed(tc.seed + 2)
    for prompt in ("def ", "import ", "class ", "    for i in range("):
        for temperature in (0.0, 0.7):
            text = generate(model, tok, prompt, args.sample_tokens, temperature, sample_gen)
            log(f"--- sample prompt={prompt!r} temperature={temperature}\n{text}\n---")

    if args.check_hf:
        check_against_transformers(args.out, model)
    log(
        f"reproduce: {reproduce_command(sys.argv[1:], result)}  "
        f"(this run: {time.monotonic() - t_start:.0f}s in all)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
