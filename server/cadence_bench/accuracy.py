"""`cadence bench accuracy`: what a storage format costs in accuracy, against float32.

Each variant (a weight format, a KV cache dtype) is served by an in-process shard engine
and compared with transformers running the same weights in float32 (the reference):

- teacher-forced over a fixed English text (the benchmark's corpus): the share of
  positions whose top-1 token agrees with the reference's, the largest and mean |Δ logit|,
  and the perplexity of the text;
- greedy decoding from several prompts cut from the same text: how many tokens each
  variant produces before its first divergence from the reference's greedy tokens.

The engine is driven through its own step pieces (apply, prepare, forward, commit), so
every variant runs the kernels it serves with (paged KV cache, quantized products).
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from cadence.config import ShardConfig
from cadence.pb import shard_pb2
from cadence.shard.engine import Engine

CORPUS = Path(__file__).with_name("corpus.txt")
CHUNK = 256  # prefill tokens per step
BLOCK = 16


@dataclass(slots=True)
class Variant:
    """A storage format to measure: `shard` holds the ShardConfig fields it sets."""

    name: str
    shard: dict[str, Any] = field(default_factory=dict)
    # serve the folder asked for (a GGUF file's, kept quantized) rather than its float copy
    as_given: bool = False


class _Driver:
    """One request at a time through an engine: teacher-forced logits and greedy tokens."""

    def __init__(self, engine: Engine) -> None:
        assert engine.kv is not None
        self.engine = engine
        self.next_block = 0
        self.rid = 0

    def _blocks(self, have: int, end: int) -> list[int]:
        need = -(-end // BLOCK) - have
        blocks = list(range(self.next_block, self.next_block + need))
        self.next_block += need
        return blocks

    def _step(self, req: shard_pb2.StepRequest, forced: list[int] | None) -> torch.Tensor:
        """Runs one step; returns the logits of every computed token (float32). The
        sampled token is replaced by `forced` (teacher forcing) or the argmax."""
        e = self.engine
        assert e.state is not None and e.kv is not None
        with torch.inference_mode():
            plan = e.apply(req, e.state, e.kv)
            batch = e.state.prepare(plan.rows)
            logits = e.model.compute_logits(e.forward(batch)).float()
            rows = batch.sample_rows.tolist()  # request rows whose last token samples
            ends = batch.query_start.tolist()[1:]
            chosen = forced or [int(logits[ends[r] - 1].argmax()) for r in rows]
            e.state.commit(batch, torch.tensor(chosen[: len(rows)], dtype=torch.long))
        return logits

    def run(self, tokens: list[int], generate: int = 0) -> tuple[torch.Tensor, list[int]]:
        """Teacher-forced logits at every position of `tokens`, then `generate` greedy
        tokens; the request is removed and its blocks reused afterwards."""
        self.rid += 1
        self.next_block = 0
        rid, done, blocks = self.rid, 0, 0
        out: list[torch.Tensor] = []
        greedy: list[int] = []
        while done < len(tokens):
            n = min(CHUNK, len(tokens) - done)
            new = self._blocks(blocks, done + n)
            blocks += len(new)
            last = done + n == len(tokens)
            forced = None if (last and generate) else [0]
            if done == 0:
                req = shard_pb2.StepRequest(
                    joined=[
                        shard_pb2.NewRequest(
                            id=rid,
                            token_ids=tokens,
                            prompt_len=len(tokens),
                            num_cached=0,
                            num_compute=n,
                            block_table=new,
                            sampling=shard_pb2.SamplingParams(),
                        )
                    ]
                )
            else:
                req = shard_pb2.StepRequest(
                    continuing=[shard_pb2.ContinuingRequest(id=rid, num_compute=n, new_blocks=new)]
                )
            logits = self._step(req, forced)
            out.append(logits)
            done += n
        if generate:
            greedy.append(int(out[-1][-1].argmax()))
        while len(greedy) < generate:
            new = self._blocks(blocks, len(tokens) + len(greedy))
            blocks += len(new)
            req = shard_pb2.StepRequest(
                continuing=[shard_pb2.ContinuingRequest(id=rid, num_compute=1, new_blocks=new)]
            )
            greedy.append(int(self._step(req, None)[-1].argmax()))
        with torch.inference_mode():  # the removal alone: no rows to compute
            self.engine.apply(
                shard_pb2.StepRequest(removed=[rid]), self.engine.state, self.engine.kv
            )
        return torch.cat(out), greedy


def reference(model_dir: Path, tokens: list[int], prompts: list[list[int]], generate: int):
    """transformers in float32: logits over `tokens` and greedy tokens per prompt."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(torch.tensor([tokens])).logits[0].float()
        greedy = []
        for p in prompts:
            ids = hf.generate(
                torch.tensor([p]), max_new_tokens=generate, do_sample=False, min_new_tokens=generate
            )
            greedy.append(ids[0, len(p) :].tolist())
    return logits, greedy


def compare(ref: torch.Tensor, got: torch.Tensor, tokens: list[int]) -> dict[str, float]:
    """Top-1 agreement, |Δ logit| and perplexity of `got` against `ref` (both [n, vocab],
    the logits predicting tokens[1:] at rows [:-1])."""
    delta = (got - ref).abs()
    targets = torch.tensor(tokens[1:])
    nll = torch.nn.functional.cross_entropy(got[:-1], targets)
    return {
        "top1_agreement": float((got.argmax(-1) == ref.argmax(-1)).float().mean()),
        "max_abs_delta_logit": float(delta.max()),
        "mean_abs_delta_logit": float(delta.mean()),
        "perplexity": math.exp(float(nll)),
    }


def divergence(ref: list[int], got: list[int]) -> int:
    """Tokens produced before the first one that differs from the reference's."""
    for i, (a, b) in enumerate(zip(ref, got, strict=False)):
        if a != b:
            return i
    return min(len(ref), len(got))


def measure(
    model_dir: Path,
    given_dir: Path,
    reference_dir: Path,
    variants: list[Variant],
    tokens: list[int],
    prompts: list[list[int]],
    generate: int,
) -> list[dict[str, Any]]:
    ref_logits, ref_greedy = reference(reference_dir, tokens, prompts, generate)
    ref_nll = torch.nn.functional.cross_entropy(ref_logits[:-1], torch.tensor(tokens[1:]))
    rows: list[dict[str, Any]] = [
        {"variant": "reference (transformers, float32)", "perplexity": math.exp(float(ref_nll))}
    ]
    num_blocks = -(-(max(len(tokens), max(map(len, prompts)) + generate)) // BLOCK) + 2
    for v in variants:
        # keep-float off: every product of a quantized layer through its quantized
        # weight, so the teacher-forced (prefill-sized) rows measure the format too
        fields = {"dtype": "float32", "cpu_kernels": True, "quantize_keep_float": "off"}
        fields |= v.shard
        served = given_dir if v.as_given else model_dir
        engine = Engine(ShardConfig(model_dir=str(served), uds_path="", **fields))
        engine.warmup(
            max_batch_tokens=CHUNK,
            max_batch_size=1,
            kv_cache_bytes=num_blocks * engine.bytes_per_block,
        )
        driver = _Driver(engine)
        logits, _ = driver.run(tokens)
        row: dict[str, Any] = {"variant": v.name} | compare(ref_logits, logits, tokens)
        lengths = [
            divergence(ref, driver.run(prompt, generate)[1])
            for prompt, ref in zip(prompts, ref_greedy, strict=True)
        ]
        row["greedy_identical_tokens_mean"] = sum(lengths) / len(lengths)
        row["greedy_identical_tokens_min"] = min(lengths)
        row["greedy_tokens"] = generate
        rows.append(row)
        del engine, driver
    return rows


def markdown(rows: list[dict[str, Any]]) -> str:
    head = (
        "| variant | top-1 agreement | max \\|Δ logit\\| | mean \\|Δ logit\\| | perplexity "
        "| greedy tokens before divergence (mean / min of N) |\n|---|---|---|---|---|---|\n"
    )
    lines = []
    for r in rows:
        if "top1_agreement" not in r:
            lines.append(f"| {r['variant']} | 1 | 0 | 0 | {r['perplexity']:.3f} | all |")
            continue
        lines.append(
            f"| {r['variant']} | {r['top1_agreement']:.4f} | {r['max_abs_delta_logit']:.3f} "
            f"| {r['mean_abs_delta_logit']:.4f} | {r['perplexity']:.3f} "
            f"| {r['greedy_identical_tokens_mean']:.1f} / {r['greedy_identical_tokens_min']} "
            f"of {r['greedy_tokens']} |"
        )
    return head + "\n".join(lines) + "\n"


VARIANTS = {
    "served": Variant("the model as served (float32 compute)", {}),
    "gguf": Variant("the GGUF file as it is (float32 compute)", {}, as_given=True),
    "gguf-bfloat16": Variant(
        "the GGUF file as it is, bfloat16 (the default here)", {"dtype": "bfloat16"}, as_given=True
    ),
    "gguf-bfloat16-kv-int8": Variant(
        "the GGUF file as it is, bfloat16, int8 KV cache (the default where it is measured faster)",
        {"dtype": "bfloat16", "kv_cache_dtype": "int8"},
        as_given=True,
    ),
    "bfloat16": Variant("bfloat16 weights", {"dtype": "bfloat16"}),
    "int8": Variant("int8 weights (--quantize int8)", {"quantize": "int8"}),
    "int4": Variant("int4 weights g32 (--quantize int4)", {"quantize": "int4"}),
    "int4-g128": Variant(
        "int4 weights g128 (--quantize int4 --quantize-group-size 128)",
        {"quantize": "int4", "quantize_group_size": 128},
    ),
    "kv-bfloat16": Variant("bfloat16 KV cache", {"kv_cache_dtype": "bfloat16"}),
    "kv-int8": Variant("int8 KV cache", {"kv_cache_dtype": "int8"}),
    "kv-fp8_e4m3": Variant("fp8 e4m3 KV cache", {"kv_cache_dtype": "fp8_e4m3"}),
    "kv-fp8_e5m2": Variant("fp8 e5m2 KV cache", {"kv_cache_dtype": "fp8_e5m2"}),
}


def run_accuracy_command(args: argparse.Namespace) -> int:
    from cadence.convert import convert_gguf
    from cadence.model_source import resolve_model
    from cadence.quant.checkpoints import GGUF_WEIGHTS
    from transformers import AutoTokenizer

    model_dir = given_dir = Path(resolve_model(args.model_id))
    if (model_dir / GGUF_WEIGHTS).exists():
        # The variants quantize float weights, which transformers reads too: the GGUF's
        # float32 copy, made once beside the folder that serves it.
        copy = model_dir.with_name(f"{model_dir.name}-float32")
        model_dir = convert_gguf(model_dir / GGUF_WEIGHTS, copy)
    reference_dir = Path(args.reference_dir) if args.reference_dir else model_dir
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    text = CORPUS.read_text()
    tokens = tokenizer(text)["input_ids"][: args.tokens]
    step = max(1, (len(tokens) - 32) // max(1, args.prompts))
    prompts = [tokens[i * step : i * step + 32] for i in range(args.prompts)]
    unknown = [n for n in args.variants.split(",") if n and n not in VARIANTS]
    if unknown:
        raise SystemExit(f"--variants: unknown {unknown} (known: {', '.join(VARIANTS)})")
    variants = [VARIANTS[name] for name in args.variants.split(",") if name]
    rows = measure(model_dir, given_dir, reference_dir, variants, tokens, prompts, args.generate)
    print(markdown(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")
    return 0
