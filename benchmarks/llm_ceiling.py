"""The LLM tier's ceiling on a GPU without vLLM: the Orpheus 3B architecture's decode step in plain PyTorch.

vLLM 0.33 needs torch 2.14 and the GPU machines at hand run torch 2.11, so the backbone's ceiling is measured
the way gpt-fast measures one: the architecture of `llm_server/engine/orpheus-3b-config.json` (Llama 3.2 3B,
tied embeddings, 156,940 ids) with random weights, a static KV cache per (batch, context) in which every row
sits at the same position, one decode step (embedding, 28 layers of RMSNorm, fused QKV, RoPE, cache write,
grouped-query SDPA, MLP, the LM head and an fp32 argmax over its logits) captured in a CUDA Graph and
replayed. For each batch and context it reports the step time, the pace a stream gets (1.0: 82.03 tokens a
second, real time), and the bytes the step must read (weights, the head's rows, the KV cache) over its time:
the GB/s a memory-bound decode achieves, the figure vLLM's timings (`megapod doctor`) are read against.

Two heads: the full vocabulary (what vLLM computes today) and the audio ids only (issue 44's audio head: 28,672
ids). Two weight formats: bf16, and FP8 (e4m3, a per-tensor scale for weights and for each step's
activations, through torch._scaled_mm) for the linear layers; the KV cache and attention stay bf16.

    python benchmarks/llm_ceiling.py --out OUT.json                 # a GPU: the grid below, about a minute
    python benchmarks/llm_ceiling.py --device cpu --out OUT.json    # the dry run: a tiny model, eager

On CPU it is a dry run: the same code on a tiny model of the same layout (no CUDA Graphs), and every figure of
the GPU grid named and marked `not measured: cpu`.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks.provenance import record, write_result
from llm_server.capacity import REALTIME_TOKENS_PER_S
from llm_server.engine.audio_tokens import AUDIO_TOKEN_BASE, CODEBOOK_SIZE, CODES_PER_FRAME
from llm_server.engine.model_source import ORPHEUS_3B_CONFIG

AUDIO_IDS = CODES_PER_FRAME * CODEBOOK_SIZE  # the audio head's rows, from AUDIO_TOKEN_BASE on
NOT_ON_CPU = "not measured: cpu"
BATCHES = (1, 8, 32, 64, 128, 256, 384, 512)
CONTEXTS = (300, 600, 1200)  # a sentence's prompt plus its audio so far
FORMATS = ("bf16", "fp8")
HEADS = ("full", "audio")
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
REPLAYS = 10


@dataclass(frozen=True)
class Arch:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    audio_ids: int
    audio_base: int  # the first audio id
    eps: float = 1e-5
    rope_theta: float = 500000.0

    @classmethod
    def orpheus_3b(cls) -> Arch:
        c = json.loads(ORPHEUS_3B_CONFIG.read_text())
        return cls(c["num_hidden_layers"], c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"],
                   c["head_dim"], c["intermediate_size"], c["vocab_size"], AUDIO_IDS, AUDIO_TOKEN_BASE,
                   c["rms_norm_eps"], c["rope_theta"])

    @classmethod
    def tiny(cls) -> Arch:
        """The same layout at a CPU's size (the dry run)."""
        return cls(layers=2, hidden=128, heads=4, kv_heads=2, head_dim=32, intermediate=256, vocab=2054, audio_ids=512,
                   audio_base=1540)

    def kv_bytes_per_token(self, element: int = 2) -> int:
        return self.layers * 2 * self.kv_heads * self.head_dim * element


class Linear:
    """y = x @ W.T in bf16, or in FP8 with per-tensor scales (the weight's fixed, the activation's each step).
    cuBLASLt's FP8 GEMM wants every dimension a multiple of 16: FP8 rows and outputs are padded to one (the full
    head's 156,940 ids are not)."""

    def __init__(self, weight: torch.Tensor, fp8: bool) -> None:
        self.fp8, self.out = fp8, weight.shape[0]
        if fp8:
            scale = weight.abs().amax().float().clamp(min=1e-12) / FP8_MAX
            weight = F.pad(weight, (0, 0, 0, -self.out % 16))
            self.weight = (weight.float() / scale).to(FP8)  # (out, in), row-major: its .t() is the column-major B
            self.scale = scale.reshape(())
        else:
            self.weight = weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if not self.fp8:
            return x @ self.weight.t()
        rows = x.shape[0]
        x = F.pad(x, (0, 0, 0, -rows % 16))
        scale = x.abs().amax().float().clamp(min=1e-12) / FP8_MAX
        y = torch._scaled_mm((x.float() / scale).to(FP8), self.weight.t(), scale_a=scale, scale_b=self.scale,
                             out_dtype=torch.bfloat16)
        return y[:rows, : self.out]

    def nbytes(self) -> int:
        return self.weight.numel() * self.weight.element_size()


class Weights:
    """The backbone's weights in one format, random (the cost does not depend on their values), and both heads."""

    def __init__(self, arch: Arch, fp8: bool, device: torch.device) -> None:
        g = torch.Generator(device=device).manual_seed(0)

        def w(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=g, device=device, dtype=torch.bfloat16) / math.sqrt(shape[-1])

        a = arch
        self.arch = a
        self.embed = w(a.vocab, a.hidden)
        self.layers = [dict(qkv=Linear(w((a.heads + 2 * a.kv_heads) * a.head_dim, a.hidden), fp8),
                            o=Linear(w(a.hidden, a.heads * a.head_dim), fp8),
                            up=Linear(w(2 * a.intermediate, a.hidden), fp8), down=Linear(w(a.hidden, a.intermediate), fp8),
                            norm1=torch.ones(a.hidden, device=device, dtype=torch.bfloat16),
                            norm2=torch.ones(a.hidden, device=device, dtype=torch.bfloat16)) for _ in range(a.layers)]
        self.norm = torch.ones(a.hidden, device=device, dtype=torch.bfloat16)
        # Tied embeddings: the head is the embedding's rows (all of them, or the audio ids' contiguous block).
        self.heads = {"full": Linear(self.embed, fp8),
                      "audio": Linear(self.embed[a.audio_base : a.audio_base + a.audio_ids], fp8)}

    def nbytes(self, head: str) -> int:
        """What a step reads of the weights: every linear layer and the head's rows."""
        linears = [lin for layer in self.layers for lin in (layer["qkv"], layer["o"], layer["up"], layer["down"])]
        return sum(lin.nbytes() for lin in linears) + self.heads[head].nbytes()


class DecodeStep:
    """One decode step of `batch` rows at position `context - 1` over a static cache of `context` tokens."""

    def __init__(self, weights: Weights, head: str, batch: int, context: int) -> None:
        a, device = weights.arch, weights.embed.device
        self.weights, self.head, self.arch, self.pos = weights, weights.heads[head], a, context - 1
        shape = (batch, a.kv_heads, context, a.head_dim)
        self.k = [torch.zeros(shape, device=device, dtype=torch.bfloat16) for _ in range(a.layers)]
        self.v = [torch.zeros(shape, device=device, dtype=torch.bfloat16) for _ in range(a.layers)]
        inv = 1.0 / (a.rope_theta ** (torch.arange(0, a.head_dim, 2, dtype=torch.float32) / a.head_dim))
        angle = self.pos * inv
        self.cos = angle.cos().to(device=device, dtype=torch.bfloat16)
        self.sin = angle.sin().to(device=device, dtype=torch.bfloat16)

    def _rope(self, x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat([x1 * self.cos - x2 * self.sin, x2 * self.cos + x1 * self.sin], dim=-1)

    @torch.no_grad()
    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        a, b, w = self.arch, tokens.shape[0], self.weights
        x = w.embed[tokens]
        for layer, k_cache, v_cache in zip(w.layers, self.k, self.v):
            h = F.rms_norm(x, (a.hidden,), layer["norm1"], a.eps)
            q, k, v = layer["qkv"](h).split([a.heads * a.head_dim, a.kv_heads * a.head_dim, a.kv_heads * a.head_dim], -1)
            q = self._rope(q.view(b, a.heads, 1, a.head_dim))
            k_cache[:, :, self.pos] = self._rope(k.view(b, a.kv_heads, a.head_dim))
            v_cache[:, :, self.pos] = v.view(b, a.kv_heads, a.head_dim)
            attn = F.scaled_dot_product_attention(q, k_cache, v_cache, enable_gqa=True)
            x = x + layer["o"](attn.reshape(b, a.heads * a.head_dim))
            h = F.rms_norm(x, (a.hidden,), layer["norm2"], a.eps)
            gate, up = layer["up"](h).chunk(2, dim=-1)
            x = x + layer["down"](F.silu(gate) * up)
        logits = self.head(F.rms_norm(x, (a.hidden,), w.norm, a.eps))
        return logits.float().argmax(dim=-1)  # vLLM's sampler works on fp32 logits

    def cache_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)


def time_step(step: DecodeStep, batch: int, device: torch.device, graphs: bool, replays: int) -> float:
    """Milliseconds a step, replayed from a CUDA Graph on a GPU (eager on CPU)."""
    tokens = torch.randint(0, step.arch.vocab, (batch,), device=device)
    if device.type != "cuda" or not graphs:
        step(tokens)
        started = time.perf_counter()
        for _ in range(replays):
            step(tokens)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return (time.perf_counter() - started) / replays * 1000
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(3):
            step(tokens)
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(tokens)
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / replays


def measure(weights: Weights, head: str, batch: int, context: int, graphs: bool, replays: int) -> dict[str, Any]:
    device = weights.embed.device
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        # The cache, the logits (bf16 and their fp32 copy) and a GiB for the activations and the graph's pool.
        need = batch * context * weights.arch.kv_bytes_per_token() + batch * weights.arch.vocab * 6 + 2**30
        if need > free:
            return {"skipped": f"does not fit: needs {need / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free of {total / 2**30:.1f}"}
    step = None
    try:
        step = DecodeStep(weights, head, batch, context)
        ms = time_step(step, batch, device, graphs, replays)
        read = weights.nbytes(head) + step.cache_bytes()
    except Exception as exc:  # one configuration's failure (an FP8 GEMM the build lacks) is its figure
        return {"error": f"{type(exc).__name__}: {exc}"[:400]}
    finally:
        del step
        if device.type == "cuda":
            torch.cuda.empty_cache()
    pace = 1000.0 / ms / REALTIME_TOKENS_PER_S
    return {"step_ms": round(ms, 3), "pace": round(pace, 2), "tokens_per_s": round(batch * 1000.0 / ms),
            "realtime_streams": batch if pace >= 1.0 else 0, "bytes_read_gb": round(read / 1e9, 3),
            "gb_per_s": round(read / 1e9 / (ms / 1000), 1)}


def measure_grid(arch: Arch, device: torch.device, batches: Sequence[int], contexts: Sequence[int], graphs: bool,
                 replays: int, measured: Callable[[dict[str, Any]], None] = lambda figures: None) -> dict[str, Any]:
    """figures[format][head][context][batch]; each format's weights built once, `measured` called after each."""
    figures: dict[str, Any] = {}
    for fmt in FORMATS:
        try:
            weights = Weights(arch, fmt == "fp8", device)
        except Exception as exc:
            figures[fmt] = {"error": f"{type(exc).__name__}: {exc}"[:400]}
            continue
        figures[fmt] = {head: {str(c): {str(b): measure(weights, head, b, c, graphs, replays) for b in batches}
                               for c in contexts} for head in HEADS}
        measured(figures)
        del weights
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return figures


def summarize(figures: dict[str, Any]) -> dict[str, Any]:
    """Per format, head and context: the largest batch that kept every stream at real time (0: none did; where
    nothing was measured, why; a format whose weights could not be built, its error)."""
    best: dict[str, Any] = {}
    for fmt, heads in figures.items():
        if "error" in heads:
            best[fmt] = heads["error"]
            continue
        for head, contexts in heads.items():
            for context, batches in contexts.items():
                kept = [int(b) for b, f in batches.items() if isinstance(f, dict) and f.get("realtime_streams")]
                reasons = {f if isinstance(f, str) else None for f in batches.values()}  # None: a figure
                unmeasured = len(reasons) == 1 and None not in reasons
                best[f"{fmt}/{head}/{context}"] = max(kept) if kept else (reasons.pop() if unmeasured else 0)
    return best


def not_measured(batches: Sequence[int], contexts: Sequence[int], why: str) -> dict[str, Any]:
    return {fmt: {head: {str(c): {str(b): why for b in batches} for c in contexts} for head in HEADS} for fmt in FORMATS}


def run(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device(args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    on_gpu = device.type == "cuda"
    batches = [int(x) for x in args.batches.split(",")]
    contexts = [int(x) for x in args.contexts.split(",")]
    started = time.perf_counter()
    figures = not_measured(batches, contexts, "not measured: the run ended first" if on_gpu else NOT_ON_CPU)
    result: dict[str, Any] = {
        "benchmark": "llm_ceiling", "device": torch.cuda.get_device_name(device) if on_gpu else "cpu",
        "torch": torch.__version__, "arch": asdict(Arch.orpheus_3b()), "cuda_graphs": args.cuda_graphs and on_gpu,
        "figures": figures, "largest_realtime_batch": summarize(figures),
        "definitions": {
            "pace": "tokens a second each row gets over 82.03 (real time); >= 1.0 keeps every row at real time",
            "gb_per_s": "weights + head rows + the whole KV cache, read once a step, over the step's time",
            "audio head": f"the LM head over the {AUDIO_IDS} audio ids only (tied embeddings: the embedding's rows "
                          f"{AUDIO_TOKEN_BASE}-{AUDIO_TOKEN_BASE + AUDIO_IDS - 1})",
            "fp8": "linear layers and the head in e4m3 with per-tensor scales (torch._scaled_mm); KV cache and attention bf16",
        },
        "provenance": record(("torch",), args.argv),
    }

    def measured(grid: dict[str, Any]) -> None:  # each format as it is measured: a cut run keeps what it found
        result["figures"], result["largest_realtime_batch"] = {**figures, **grid}, summarize({**figures, **grid})
        result["seconds"] = round(time.perf_counter() - started, 1)
        write_result(args.out, result)

    if on_gpu:
        measure_grid(Arch.orpheus_3b(), device, batches, contexts, args.cuda_graphs, args.replays, measured)
    else:  # the dry run: the same code on the tiny layout, eager, so that it cannot rot
        tiny = Arch.tiny()
        result["dry_run"] = {"arch": asdict(tiny), "figures": measure_grid(tiny, device, (1, 3), (8,), False, 2)}
    result["seconds"] = round(time.perf_counter() - started, 1)
    write_result(args.out, result)
    return result


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="auto", help="auto, cuda, cuda:N or cpu (a dry run)")
    p.add_argument("--batches", default=",".join(map(str, BATCHES)))
    p.add_argument("--contexts", default=",".join(map(str, CONTEXTS)))
    p.add_argument("--replays", type=int, default=REPLAYS)
    p.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_false")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    args.argv = argv
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    result = run(args)
    print(json.dumps(result["largest_realtime_batch"]))
    print(f"wrote {args.out} ({result['seconds']} s)")
    return result


if __name__ == "__main__":
    main()
