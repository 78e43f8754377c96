"""How far a quantized KV cache moves a real model's logits: the embedded SmolLM2-135M
(float32 weights) over a fixed English text, its first --prefill tokens as one prefill
and every later token teacher-forced as a decode step (so most positions attend through
the decode kernel over the quantized cache), each --kv-dtype against a float32 cache:
top-1 agreement and the largest |logit difference| over every position.

    PYTHONPATH=server python benchmarks/kernels/kv_cache_accuracy.py [--kv-dtype int8 fp8_e4m3 ...]
"""

from __future__ import annotations

import argparse

import torch
from cadence.config import ShardConfig
from cadence.model_source import resolve_model
from cadence.pb import shard_pb2
from cadence.shard.engine import Engine
from transformers import AutoTokenizer

TEXT = (
    "The history of the printing press begins long before Gutenberg. In China, woodblock "
    "printing was used to reproduce texts and images on paper and cloth as early as the "
    "seventh century, and movable type made of fired clay was described by the scholar Shen "
    "Kuo in the eleventh century. Korean printers later cast type in bronze, and a Buddhist "
    "anthology printed with metal type in 1377 survives to this day. What changed in Mainz "
    "around 1450 was the combination of several inventions: a hand mould that cast large "
    "numbers of identical letters from a durable alloy of lead, tin and antimony; an "
    "oil-based ink that clung to metal; and a screw press adapted from the presses used to "
    "make wine and olive oil. Together they allowed a small workshop to produce hundreds of "
    "copies of a book in the time a scribe needed for one. Within fifty years, presses were "
    "operating in more than two hundred cities across Europe, and historians estimate that "
    "some twenty million volumes had been printed by 1500. The consequences reached far "
    "beyond the book trade. Standardized texts made it possible for scholars in distant "
    "cities to argue about the same page, the same table of numbers, the same diagram. "
    "Pamphlets spread religious and political arguments faster than any authority could "
    "answer them, and vernacular languages gained fixed spellings as printers chose one "
    "form over another. Scientists such as Copernicus and Vesalius relied on accurate "
    "printed illustrations to communicate observations that words alone could not carry. "
    "At the same time, printing created new problems: errors were multiplied instead of "
    "corrected, pirated editions undercut honest publishers, and rulers soon discovered "
    "that licensing and censorship were necessary if they wished to control what their "
    "subjects read. The debates that followed, about authorship, copying and the freedom "
    "of the press, are still with us."
)


def run(engine: Engine, tokens: list[int], prefill: int) -> torch.Tensor:
    """Logits [len(tokens) - 1, vocab] of every position but the last."""
    assert engine.state is not None and engine.kv is not None
    bs = engine.block_size
    blocks = list(range(-(-len(tokens) // bs)))
    out = []

    def step(req: shard_pb2.StepRequest, next_token: int) -> None:
        e = engine
        assert e.state is not None and e.kv is not None
        with torch.inference_mode():
            plan = e.apply(req, e.state, e.kv)
            batch = e.state.prepare(plan.rows)
            out.append(e.model.compute_logits(e.forward(batch)).float())
            e.state.commit(batch, torch.tensor([next_token]))

    joined = shard_pb2.NewRequest(
        id=0, token_ids=tokens[:prefill], prompt_len=prefill, num_compute=prefill,
        block_table=blocks, sampling=shard_pb2.SamplingParams(),
    )  # fmt: skip
    step(shard_pb2.StepRequest(joined=[joined]), tokens[prefill])
    for i in range(prefill + 1, len(tokens)):
        cont = shard_pb2.ContinuingRequest(id=0, num_compute=1)
        step(shard_pb2.StepRequest(continuing=[cont]), tokens[i])
    return torch.cat(out)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--kv-dtype", nargs="+", default=["bfloat16", "int8", "fp8_e4m3", "fp8_e5m2"])
    p.add_argument("--prefill", type=int, default=32)
    p.add_argument("--tokens", type=int, default=320)
    a = p.parse_args()
    model_dir = resolve_model(None)
    tokens = AutoTokenizer.from_pretrained(model_dir)(TEXT)["input_ids"][: a.tokens]
    logits = {}
    for kv in ["float32", *a.kv_dtype]:
        engine = Engine(
            ShardConfig(model_dir=model_dir, uds_path="", dtype="float32", kv_cache_dtype=kv)
        )
        engine.warmup(512, 4, kv_cache_bytes=64 * engine.bytes_per_block)
        logits[kv] = run(engine, tokens, a.prefill)
    ref = logits.pop("float32")
    print(
        f"SmolLM2-135M float32 weights, {ref.shape[0]} positions ({a.prefill} prefill, "
        f"the rest decode steps), against a float32 KV cache (logits span "
        f"{ref.min():.1f}..{ref.max():.1f}):"
    )
    for kv, got in logits.items():
        top1 = (got.argmax(-1) == ref.argmax(-1)).float().mean()
        diff = (got - ref).abs()
        print(
            f"{kv:9} top-1 agreement {100 * top1:5.1f}%  max |dlogit| {diff.max():.3f}  "
            f"mean |dlogit| {diff.mean():.4f}"
        )


if __name__ == "__main__":
    main()
