"""A miniature router for the shard tests: allocates blocks, keeps each request's
known tokens, and writes StepRequest diffs the way the real scheduler does."""

from __future__ import annotations

import array
import os
import random
import subprocess
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from cadence.pb import shard_pb2
from cadence.shard.engine import Engine
from cadence.shard.forward_batch import ForwardBatch

if TYPE_CHECKING:  # transformers is slow to import; tensor-parallel ranks do without it
    from transformers import PreTrainedModel


@dataclass
class Req:
    tokens: list[int]
    prompt_len: int
    computed: int = 0
    blocks: list[int] = field(default_factory=list)


class MiniRouter:
    def __init__(
        self,
        engine: Engine | None = None,
        seed: int = 0,
        *,
        num_blocks: int = 0,
        block_size: int = 16,
        step_fn: Callable[[shard_pb2.StepRequest], shard_pb2.StepResponse] | None = None,
    ) -> None:
        """Drives an in-process `engine`, or any `step_fn` (a gRPC client) given the
        cache's `num_blocks`."""
        if engine is not None:
            assert engine.kv is not None
            num_blocks, block_size, step_fn = engine.kv.num_blocks, engine.block_size, engine.step
        assert step_fn is not None
        self.engine = engine
        self.step_fn = step_fn
        self.bs = block_size
        self.free = list(range(num_blocks))
        self.last_batch: ForwardBatch | None = None  # the latest logits_step batch
        random.Random(seed).shuffle(self.free)  # non-contiguous block tables
        self.reqs: dict[int, Req] = {}

    def _blocks_for(self, r: Req, end: int) -> list[int]:
        need = -(-end // self.bs) - len(r.blocks)
        new = [self.free.pop() for _ in range(max(0, need))]
        r.blocks += new
        return new

    def join(
        self,
        rid: int,
        tokens: list[int],
        num_compute: int | None = None,
        prompt_len: int | None = None,
        sampling: shard_pb2.SamplingParams | None = None,
        top_n: int = 0,
    ) -> shard_pb2.NewRequest:
        r = Req(list(tokens), prompt_len if prompt_len is not None else len(tokens))
        self.reqs[rid] = r
        n = len(tokens) if num_compute is None else num_compute
        self._blocks_for(r, n)
        r.computed = n
        return shard_pb2.NewRequest(
            id=rid,
            token_ids=tokens,
            prompt_len=r.prompt_len,
            num_cached=0,
            num_compute=n,
            block_table=r.blocks,
            sampling=sampling or shard_pb2.SamplingParams(),
            top_n_tokens=top_n,
        )

    def cont(
        self, rid: int, num_compute: int | None = None, forced: Sequence[int] = ()
    ) -> shard_pb2.ContinuingRequest:
        """Next chunk of a prefill (`num_compute`), or the decode of the last token; with
        `forced` tokens appended first (a grammar's fast-forward), every known token."""
        r = self.reqs[rid]
        r.tokens += forced
        n = len(r.tokens) - r.computed if num_compute is None else num_compute
        new = self._blocks_for(r, r.computed + n)
        r.computed += n
        return shard_pb2.ContinuingRequest(
            id=rid, num_compute=n, new_blocks=new, forced_tokens=forced
        )

    def remove(self, rid: int) -> int:
        r = self.reqs.pop(rid)
        self.free += r.blocks
        return rid

    def step(
        self,
        joined: Sequence[shard_pb2.NewRequest] = (),
        continuing: Sequence[shard_pb2.ContinuingRequest] = (),
        removed: Sequence[int] = (),
        allowed: Sequence[shard_pb2.AllowedTokens] = (),
    ) -> shard_pb2.StepResponse:
        req = shard_pb2.StepRequest(
            joined=joined, continuing=continuing, removed=removed, allowed=allowed
        )
        resp = self.step_fn(req)
        for g in resp.generations:
            self.reqs[g.id].tokens += list(g.token_ids)
        return resp

    def logits_step(
        self,
        joined=(),
        continuing=(),
        forced: dict[int, int] | None = None,
    ) -> dict[int, torch.Tensor]:
        """Runs one step through the engine's own pieces and returns the logits of every
        computed token, per request; sampling is replaced by the `forced` next tokens."""
        e = self.engine
        assert e is not None and e.state is not None and e.kv is not None
        req = shard_pb2.StepRequest(joined=joined, continuing=continuing)
        with torch.inference_mode():
            plan = e.apply(req, e.state, e.kv)
            batch = e.state.prepare(plan.rows)
            self.last_batch = batch
            logits = e.model.compute_logits(e.forward(batch)).float()
            forced = forced or {}
            sampled = [forced[batch.ids[i]] for i in batch.sample_rows.tolist()]
            e.state.commit(batch, torch.tensor(sampled, dtype=torch.long))
        starts = batch.layout.query_start.tolist()
        out = {rid: logits[starts[i] : starts[i + 1]] for i, rid in enumerate(batch.ids)}
        for i in batch.sample_rows.tolist():
            self.reqs[batch.ids[i]].tokens.append(forced[batch.ids[i]])
        return out


def prefill_then_decode_logits(engine: Engine, tokens: list[int], prompt_len: int) -> torch.Tensor:
    """Logits of tokens[:-1]: a prefill of `prompt_len`, then one decode per token."""
    router = MiniRouter(engine)
    first = router.join(1, tokens[:prompt_len])
    got = [router.logits_step(joined=[first], forced={1: tokens[prompt_len]})[1]]
    for t in tokens[prompt_len + 1 :]:
        got.append(router.logits_step(continuing=[router.cont(1)], forced={1: t})[1])
    return torch.cat(got)


def allowed_tokens(
    rid: int, tokens: Iterable[int], vocab: int, words: int | None = None
) -> shard_pb2.AllowedTokens:
    """The mask allowing `tokens` of a `vocab`-token vocabulary, packed the contract's way
    (bit t % 32 of word t // 32), in ceil(vocab / 32) words or `words`."""
    packed = [0] * (-(-vocab // 32) if words is None else words)
    for t in tokens:
        packed[t // 32] |= 1 << (t % 32)
    return mask_of_words(rid, packed)


def mask_of_words(rid: int, words: Sequence[int]) -> shard_pb2.AllowedTokens:
    """The AllowedTokens message holding these 32-bit words (little-endian bytes)."""
    return shard_pb2.AllowedTokens(id=rid, words=array.array("I", words).tobytes())


def words_of(mask: shard_pb2.AllowedTokens) -> list[int]:
    return list(array.array("I", mask.words))


def hf_logits(hf: PreTrainedModel, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0].float()


SERVER = Path(__file__).resolve().parents[1]


def spawn_shard(model_dir: Path, uds: Path) -> subprocess.Popen[bytes]:
    """A real shard process (`cadence.shard.server.serve`, float32) on `uds`, running this
    checkout's code."""
    code = (
        "from cadence.config import ShardConfig; from cadence.shard.server import serve; "
        f"serve(ShardConfig(model_dir={str(model_dir)!r}, uds_path={str(uds)!r}, "
        "dtype='float32'))"
    )
    env = {**os.environ, "PYTHONPATH": f"{SERVER}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    return subprocess.Popen([sys.executable, "-c", code], env=env)
