"""Where speculative decoding stops paying on this machine: the most tokens a step may
hold while proposals still speed it up.

Builds the shard's engine in process for the served model (by default the embedded model
as `cadence launch` serves it: the same dtype and kernels), prefills `--context`-token
requests, then times real steps: B requests each decoding one token (k = 0), and B
requests each verifying k proposed tokens (B * (1 + k) tokens; random proposals, so
nearly all are rejected, which costs what accepted ones do). Configurations are
interleaved over `--rounds` so a burst of load elsewhere hits them alike; the fastest
step of each counts. Speculating B requests with k proposals each pays when the tokens it
is expected to yield, B * E(k) with E(k) = (1 - a^(k+1)) / (1 - a) at a reference
acceptance rate a (`--acceptance`, 0.7), outrun its cost: gain = E(k) * t(B, 0) / t(B, k).
The threshold is the largest step, B * (1 + k) tokens, whose gain is at least `--min-gain`
(1.1); past it the step is compute-bound and proposals cost more than they bring.
`--write` stores it with the table in `<cache dir>/speculative.json`, which shards read at
start (`speculative_threshold`, InfoResponse.speculative_max_step_tokens) and the router's
load switch applies.

    PYTHONPATH=server python benchmarks/kernels/spec_threshold_bench.py [--model-id DIR] [--write]
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from cadence import cpu_isa as isa
from cadence.config import ShardConfig
from cadence.launcher import resolve_cpu_choices
from cadence.model_source import resolve_model
from cadence.pb import shard_pb2 as pb
from cadence.shard.engine import Engine
from cadence.speculative.threshold import table_path

BATCHES = (1, 2, 4, 8, 16)
PROPOSALS = (0, 1, 2, 3, 4, 6, 8)
GREEDY = pb.SamplingParams(top_p=1.0, typical_p=1.0, repetition_penalty=1.0)


@dataclass(slots=True)
class Request:
    computed: int  # tokens whose KV is written; the last sampled token sits at this index
    blocks: list[int] = field(default_factory=list)


class DecodingRequests:
    """Requests the benchmark keeps decoding, with the router's share of the bookkeeping:
    each step's blocks handed out before it, and the trailing blocks of rejected proposals
    taken back after (the shard cuts its table the same way)."""

    def __init__(
        self, engine: Engine, count: int, context: int, step_tokens: int, seed: int = 0
    ) -> None:
        """`count` requests of `context` tokens, prefilled in steps of at most
        `step_tokens` tokens (the warm-up's largest step)."""
        assert engine.kv is not None and engine.state is not None
        self.engine = engine
        self.bs = engine.block_size
        self.free = list(range(engine.kv.num_blocks))
        self.rng = np.random.default_rng(seed)
        self.vocab = engine.state.vocab_size
        self.requests: dict[int, Request] = {}
        per_step = max(1, step_tokens // context)
        for first in range(0, count, per_step):
            ids = range(first, min(count, first + per_step))
            self.engine.step(pb.StepRequest(joined=[self._join(i, context) for i in ids]))

    def _take(self, r: Request, end: int) -> list[int]:
        """Blocks so that `r` covers `end` tokens; the new ones."""
        new = [self.free.pop() for _ in range(max(0, -(-end // self.bs) - len(r.blocks)))]
        r.blocks += new
        return new

    def _join(self, rid: int, context: int) -> pb.NewRequest:
        r = Request(computed=context)
        self.requests[rid] = r
        tokens = self.rng.integers(3, self.vocab, size=context).tolist()
        return pb.NewRequest(
            id=rid,
            token_ids=tokens,
            prompt_len=context,
            num_compute=context,
            block_table=self._take(r, context),
            sampling=GREEDY,
        )

    def step(self, batch: int, k: int) -> float:
        """One step of requests 0..batch-1, each verifying k proposals (plain decodes at
        k = 0); its wall time in seconds."""
        continuing = []
        for rid in range(batch):
            r = self.requests[rid]
            new = self._take(r, r.computed + 1 + k)
            proposed = self.rng.integers(3, self.vocab, size=k).tolist()
            continuing.append(
                pb.ContinuingRequest(
                    id=rid, num_compute=1 + k, new_blocks=new, proposed_tokens=proposed
                )
            )
        started = time.perf_counter()
        answer = self.engine.step(pb.StepRequest(continuing=continuing))
        elapsed = time.perf_counter() - started
        for g in answer.generations:
            if g.num_proposed != k:  # timing a step that verified nothing would mislead
                raise RuntimeError(f"request {g.id}: {g.num_proposed} proposals verified, not {k}")
            r = self.requests[g.id]
            r.computed += 1 + g.num_accepted
            keep = -(-r.computed // self.bs)
            self.free += r.blocks[keep:]
            del r.blocks[keep:]
        return elapsed


def configurations(
    batches: Sequence[int], proposals: Sequence[int], max_tokens: int
) -> list[tuple[int, int]]:
    """(B, k) pairs whose steps hold at most `max_tokens` tokens, by token count."""
    pairs = [(b, k) for b in batches for k in proposals if b * (1 + k) <= max_tokens]
    return sorted(pairs, key=lambda p: (p[0] * (1 + p[1]), p))


def time_steps(
    requests: DecodingRequests, pairs: list[tuple[int, int]], rounds: int, steps: int
) -> dict[tuple[int, int], float]:
    """The fastest step of each (B, k) in milliseconds, the pairs interleaved per round."""
    best = {p: float("inf") for p in pairs}
    for _ in range(rounds):
        for b, k in pairs:
            requests.step(b, k)  # the first step of a new shape pays for its workspace
            for _ in range(steps):
                best[(b, k)] = min(best[(b, k)], requests.step(b, k) * 1e3)
    return best


def expected_tokens(acceptance: float, k: int) -> float:
    """Tokens one verification of k proposals yields when each is accepted with
    probability `acceptance` (given the ones before it were): 1 + a + ... + a^k."""
    return sum(acceptance**j for j in range(k + 1))


def threshold(
    times: dict[tuple[int, int], float], acceptance: float = 0.7, min_gain: float = 1.1
) -> int:
    """The most tokens, B * (1 + k), of a measured step whose proposals still pay: its
    expected speed-up E(k) * t(B, 0) / t(B, k) over the B plain decodes is at least
    `min_gain`; at least 1 (no speculation) when none does."""
    found = 1
    for (b, k), ms in times.items():
        plain = times.get((b, 0))
        if k > 0 and plain is not None and expected_tokens(acceptance, k) * plain / ms >= min_gain:
            found = max(found, b * (1 + k))
    return found


def step_ms_by_tokens(times: dict[tuple[int, int], float]) -> dict[int, float]:
    """Per token count, the slowest configuration holding that many (the bound a step of
    that size may cost)."""
    out: dict[int, float] = {}
    for (b, k), ms in times.items():
        t = b * (1 + k)
        out[t] = max(out.get(t, 0.0), ms)
    return dict(sorted(out.items()))


def build_engine(model_id: str | None, dtype: str, cpu_isa: str) -> Engine:
    """The shard's engine for the model as `cadence launch` would serve it."""
    cfg = ShardConfig(model_dir=resolve_model(model_id), uds_path="", dtype=dtype, cpu_isa=cpu_isa)
    return Engine(resolve_cpu_choices(cfg))


def print_table(times: dict[tuple[int, int], float]) -> None:
    base = times[(1, 0)]
    print(f"{'B':>3} {'k':>2} {'tokens':>6} {'step ms':>8} {'x 1-token':>9} {'x B plain':>9}")
    for (b, k), ms in times.items():
        plain = times.get((b, 0))
        vs_plain = f"{ms / plain:9.2f}" if plain else f"{'-':>9}"
        print(f"{b:>3} {k:>2} {b * (1 + k):>6} {ms:8.2f} {ms / base:9.2f} {vs_plain}")


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-id", help="model folder or .gguf (default: the embedded model)")
    p.add_argument("--dtype", default="auto", help="as `cadence launch --dtype`")
    p.add_argument("--cpu-isa", default="auto", help="as `cadence launch --cpu-isa`")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--batches", default=",".join(map(str, BATCHES)))
    p.add_argument("--proposals", default=",".join(map(str, PROPOSALS)), help="k values")
    p.add_argument("--max-tokens", type=int, default=64, help="largest step measured")
    p.add_argument("--context", type=int, default=128, help="prompt tokens per request")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=4, help="timed steps per pair and round")
    p.add_argument("--acceptance", type=float, default=0.7, help="reference acceptance rate")
    p.add_argument("--min-gain", type=float, default=1.1, help="least expected speed-up")
    p.add_argument("--write", action="store_true", help="store the threshold in the cache")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    a = parse(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    batches = [int(b) for b in a.batches.split(",")]
    pairs = configurations(batches, [int(k) for k in a.proposals.split(",")], a.max_tokens)
    if (1, 0) not in pairs:
        raise SystemExit("the batches and proposals must include B = 1, k = 0 (the baseline)")
    engine = build_engine(a.model_id, a.dtype, a.cpu_isa)
    count = max(b for b, _ in pairs)
    # every request may grow by (1 + k) tokens a step if its proposals were all accepted
    growth = a.rounds * len(pairs) * (a.steps + 1) * max(1 + k for _, k in pairs)
    blocks = count * (-(-(a.context + growth) // engine.block_size) + 1)
    step_tokens = max(a.context, a.max_tokens)
    engine.warmup(step_tokens, count, blocks * engine.bytes_per_block)
    requests = DecodingRequests(engine, count, a.context, step_tokens)
    isa_name = engine.cfg.cpu_isa if engine.device.type == "cpu" else engine.device.type
    print(
        f"{engine.cfg.model_dir}: {engine.cfg.dtype} on {engine.device.type} "
        f"({isa.cpu_model() if engine.device.type == 'cpu' else ''} {isa_name}), "
        f"{torch.get_num_threads()} threads, context {a.context}"
    )
    times = time_steps(requests, pairs, a.rounds, a.steps)
    print_table(times)
    found = threshold(times, a.acceptance, a.min_gain)
    print(
        f"largest step whose proposals gain >= {a.min_gain}x at acceptance {a.acceptance}: "
        f"{found} tokens"
    )
    result = {
        "max_step_tokens": found,
        "acceptance": a.acceptance,
        "min_gain": a.min_gain,
        "step_ms": {str(t): round(ms, 3) for t, ms in step_ms_by_tokens(times).items()},
        "device": engine.device.type,
        "isa": isa_name,
        "dtype": engine.cfg.dtype,
        "model": Path(engine.cfg.model_dir).name,  # the folder's name, as the shard compares
        "cpu": isa.cpu_model(),
        "context": a.context,
        "configurations": [
            {"batch": b, "k": k, "tokens": b * (1 + k), "ms": round(ms, 3)}
            for (b, k), ms in times.items()
        ],
    }
    if a.write:
        path = table_path()
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {path}")
    return result


if __name__ == "__main__":
    main()
