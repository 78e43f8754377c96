"""One tensor-parallel rank of the shard tests, run in its own process (spawned): joins
a gloo group, loads each model's slice into an Engine, and records the logits of a
scripted run (a prefill, decodes, a second request joining mid-way) to a file -- or,
with the "constrained" script, the generations of steps under allowed-token masks and
forced tokens; with "lora", the logits of requests of mixed LoRA adapters.

Kept free of transformers imports so a spawned rank starts fast."""

from __future__ import annotations

import socket
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

PROMPT_LEN, DECODES, LATE_LEN = 21, 10, 18


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def script_tokens(seed: int = 1) -> tuple[list[int], list[int], list[int], list[int]]:
    """Prompt and forced continuation of request 1, then of request 2 (joins later)."""
    g = torch.Generator().manual_seed(seed)

    def draw(n: int) -> list[int]:
        return torch.randint(3, 256, (n,), generator=g).tolist()

    return draw(PROMPT_LEN), draw(DECODES), draw(LATE_LEN), draw(DECODES)


def scripted_logits(engine: object) -> dict[int, torch.Tensor]:
    """Request 1 prefills then decodes DECODES tokens; request 2 joins at decode 3 and
    decodes alongside. Returns every computed token's logits per request."""
    from shard_helpers import MiniRouter

    router = MiniRouter(engine, seed=5)  # type: ignore[arg-type]
    p1, f1, p2, f2 = script_tokens()
    got: dict[int, list[torch.Tensor]] = {1: [], 2: []}
    out = router.logits_step(joined=[router.join(1, p1)], forced={1: f1[0]})
    got[1].append(out[1])
    n2 = 0
    for i in range(1, DECODES):
        joined, forced = [], {1: f1[i]}
        continuing = [router.cont(1)]
        if i == 3:
            joined = [router.join(2, p2)]
        elif i > 3:
            continuing.append(router.cont(2))
        if i >= 3:
            forced[2] = f2[n2]
            n2 += 1
        out = router.logits_step(joined=joined, continuing=continuing, forced=forced)
        for rid, logits in out.items():
            got[rid].append(logits)
    return {rid: torch.cat(parts) for rid, parts in got.items()}


def constrained_generations(engine: object) -> list[tuple[int, int, float]]:
    """(request, token, logprob) of every generation of a scripted run under masks:
    request 1 (greedy) samples under a mask, then continues with two forced tokens under
    another mask while request 2 (seeded sampling) joins under a third."""
    from cadence.pb import shard_pb2
    from shard_helpers import MiniRouter, allowed_tokens

    router = MiniRouter(engine, seed=3)  # type: ignore[arg-type]
    vocab = engine.model.config.vocab_size  # type: ignore[attr-defined]
    p1, f1, p2, _ = script_tokens()
    masks = [[t for t in range(vocab) if t % k == 1] for k in (3, 5, 7)]
    seeded = shard_pb2.SamplingParams(do_sample=True, temperature=1.2, seed=11)
    steps = [
        router.step(joined=[router.join(1, p1)], allowed=[allowed_tokens(1, masks[0], vocab)]),
        router.step(
            joined=[router.join(2, p2, sampling=seeded)],
            continuing=[router.cont(1, forced=f1[:2])],
            allowed=[allowed_tokens(1, masks[1], vocab), allowed_tokens(2, masks[2], vocab)],
        ),
    ]
    return [(g.id, g.token_ids[0], g.logprobs[0]) for s in steps for g in s.generations]


def speculative_generations(engine: object) -> list[tuple[int, list[int], list[float], int]]:
    """(request, tokens, logprobs, accepted) of every generation of a scripted run with
    proposals: request 1 (greedy) and request 2 (seeded sampling with a repetition
    penalty) decode with 3 proposals a step, the first two of them what a run without
    proposals generated there (recorded first), the third wrong."""
    from cadence.pb import shard_pb2
    from shard_helpers import MiniRouter

    p1, _, p2, _ = script_tokens()
    prompts = {1: p1, 2: p2}
    seeded = shard_pb2.SamplingParams(
        do_sample=True, temperature=1.1, repetition_penalty=1.3, seed=5
    )
    samplings = {1: shard_pb2.SamplingParams(), 2: seeded}

    def start() -> MiniRouter:
        engine.clear_cache()  # type: ignore[attr-defined]
        router = MiniRouter(engine, seed=4)  # type: ignore[arg-type]
        router.step(joined=[router.join(r, p, sampling=samplings[r]) for r, p in prompts.items()])
        return router

    plain = start()
    for _ in range(DECODES):
        plain.step(continuing=[plain.cont(1), plain.cont(2)])
    truth = {r: plain.reqs[r].tokens[len(p) :] for r, p in prompts.items()}
    router = start()
    got = []
    for _ in range(3):
        conts = []
        for r, p in prompts.items():
            req = router.reqs[r]
            n = len(req.tokens) - len(p)
            proposals = truth[r][n : n + 2] + [(truth[r][n + 2] + 1) % 256]
            new = router._blocks_for(req, req.computed + 4)
            conts.append(
                shard_pb2.ContinuingRequest(
                    id=r, num_compute=4, new_blocks=new, proposed_tokens=proposals
                )
            )
        for g in router.step(continuing=conts).generations:
            req = router.reqs[g.id]  # the router keeps what was verified, and its blocks
            req.computed += 1 + g.num_accepted
            keep = -(-req.computed // router.bs)
            router.free += req.blocks[keep:]
            del req.blocks[keep:]
            got.append((g.id, list(g.token_ids), list(g.logprobs), g.num_accepted))
    return got


def lora_logits(engine: object) -> dict[int, torch.Tensor]:
    """Every computed token's logits per request of `lora_script`'s run: requests of four
    LoRA adapters (this rank's slices) and of none mixed in prefill and decode steps."""
    from lora_script import mixed_run

    return mixed_run(engine, with_adapters=True)[0]


SCRIPTS = {
    "logits": scripted_logits,
    "constrained": constrained_generations,
    "speculative": speculative_generations,
    "lora": lora_logits,
}


def run_rank(
    rank: int,
    world_size: int,
    port: int,
    model_dirs: list[str],
    out_dir: str,
    dtype: str,
    script: str = "logits",
) -> None:
    from cadence.config import ShardConfig
    from cadence.shard.engine import Engine, init_distributed

    torch.set_num_threads(1)
    cfg = ShardConfig(
        model_dir="", uds_path="", dtype=dtype, rank=rank, world_size=world_size, master_port=port
    )
    init_distributed(cfg)
    results = {}
    try:
        for model_dir in model_dirs:
            cfg.model_dir = model_dir
            engine = Engine(cfg)
            engine.warmup(max_batch_tokens=64, max_batch_size=8, kv_cache_bytes=1 << 20)
            results[Path(model_dir).name] = {
                script: SCRIPTS[script](engine),
                "weight_bytes": engine.weight_bytes - engine.packed_bytes,  # the slices alone
                "checkpoint_bytes_read": engine.checkpoint_bytes_read,
                "kv_heads": engine.attention[0].num_kv_heads,
            }
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_group(
    world_size: int, model_dirs: list[str], out_dir: Path, dtype: str, script: str = "logits"
) -> list[dict]:
    """Runs every rank in its own spawned process; returns each rank's results (under the
    name of the script run: "logits" or "constrained")."""
    import torch.multiprocessing as mp

    port = free_port()
    mp.start_processes(
        _entry,
        args=(world_size, port, model_dirs, str(out_dir), dtype, script),
        nprocs=world_size,
        start_method="spawn",
    )
    return [torch.load(out_dir / f"rank{r}.pt") for r in range(world_size)]


def _entry(rank: int, *args: object) -> None:
    run_rank(rank, *args)  # type: ignore[arg-type]


def run_cases(
    per_case: Callable[[Any, int, int, int], object],
    world_size: int,
    cases: Sequence[tuple],
    out_dir: Path,
) -> list[dict]:
    """Runs `per_case(case, rank, world_size, port)` for every case on every rank of a gloo
    group, each rank in its own spawned process (`per_case` a module-level function, so
    it pickles); returns each rank's {case name (case[0]): result}."""
    import torch.multiprocessing as mp

    mp.start_processes(
        _case_rank,
        args=(per_case, world_size, free_port(), list(cases), str(out_dir)),
        nprocs=world_size,
        start_method="spawn",
    )
    return [torch.load(out_dir / f"rank{r}.pt") for r in range(world_size)]


def _case_rank(
    rank: int,
    per_case: Callable[[Any, int, int, int], object],
    world_size: int,
    port: int,
    cases: list[tuple],
    out_dir: str,
) -> None:
    from cadence.config import ShardConfig
    from cadence.shard.engine import init_distributed

    torch.set_num_threads(1)
    init_distributed(
        ShardConfig(model_dir="", uds_path="", rank=rank, world_size=world_size, master_port=port)
    )
    try:
        results = {case[0]: per_case(case, rank, world_size, port) for case in cases}
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
