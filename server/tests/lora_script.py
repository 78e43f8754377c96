"""A scripted run of requests with different LoRA adapters (and none) mixed in the same
steps -- prefills of different lengths, then decodes while another request joins -- with
the adapters paged in through the Step. Shared by the engine tests and the
tensor-parallel ranks (no transformers imports)."""

from __future__ import annotations

import torch
from cadence.lora.pool import blocks_needed
from cadence.lora.weights import AdapterWeights
from cadence.pb import shard_pb2
from lora_random import random_adapter, ranks_by_part
from shard_helpers import MiniRouter

# adapter -> rank per part, for every family's names (a part a model lacks is ignored):
# q/k/v of the fused attention input, 0/1 the gate/up halves, then the single layers
ADAPTERS: dict[str, dict[str, int]] = {
    "x": {"q": 4, "v": 4},
    "y": {
        **{p: 8 for p in ("q", "k", "v", "0", "1")},
        **{n: 8 for n in ("o_proj", "down_proj", "out_proj", "fc1", "fc2", "c_proj", "c_fc")},
    },
    "z": {"0": 2, "down_proj": 2, "fc1": 2, "c_fc": 2},
    "w": {"k": 6, "o_proj": 3, "out_proj": 3, "c_proj": 3},
}
# request -> (adapter, prompt length); request 6 joins at the second step
REQUESTS = {1: ("", 9), 2: ("x", 20), 3: ("y", 13), 4: ("z", 5), 5: ("w", 11), 6: ("x", 6)}
DECODES = 3


def keep_adapters(engine: object) -> dict[str, AdapterWeights]:
    """The script's adapters for the engine's model, host-loaded on it."""
    model, dtype = engine.model, engine.dtype  # type: ignore[attr-defined]
    made = {n: random_adapter(model, n, ranks_by_part(r), dtype) for n, r in ADAPTERS.items()}
    for weights in made.values():
        engine.adapters.keep(weights)  # type: ignore[attr-defined]
    return made


def page_in(engine: object, router: MiniRouter, names: list[str]) -> dict[str, list[int]]:
    """Pages the host-loaded adapters `names` in, on blocks taken from the router's pool;
    returns each one's blocks."""
    adapters = engine.adapters  # type: ignore[attr-defined]
    blocks = {}
    for name in names:
        n = blocks_needed(adapters.host[name], adapters.shape, adapters.dtype)
        blocks[name] = [router.free.pop() for _ in range(n)]
    pages = [shard_pb2.AdapterPages(name=n, blocks=b) for n, b in blocks.items()]
    engine.step(shard_pb2.StepRequest(adapters_in=pages))  # type: ignore[attr-defined]
    return blocks


def mixed_run(
    engine: object, with_adapters: bool, seed: int = 0
) -> tuple[dict[int, torch.Tensor], MiniRouter]:
    """Every computed token's logits per request; the requests name their adapters when
    `with_adapters` (host-loaded and paged in first), else all run on the engine's own
    weights."""
    g = torch.Generator().manual_seed(seed)

    def draw(n: int) -> list[int]:
        return torch.randint(3, 250, (n,), generator=g).tolist()

    prompts = {r: draw(n) for r, (_, n) in REQUESTS.items()}
    forced = {r: draw(DECODES + 1) for r in REQUESTS}
    router = MiniRouter(engine, seed=seed)  # type: ignore[arg-type]
    if with_adapters:
        keep_adapters(engine)
        page_in(engine, router, list(ADAPTERS))

    def join(rid: int) -> shard_pb2.NewRequest:
        new = router.join(rid, prompts[rid])
        new.adapter_id = REQUESTS[rid][0] if with_adapters else ""
        return new

    first, late = [1, 2, 3, 4, 5], [6]
    plan = [(first, []), (late, first)] + [([], first + late)] * (DECODES - 1)
    got: dict[int, list[torch.Tensor]] = {r: [] for r in REQUESTS}
    for joined, continuing in plan:
        cont = [router.cont(r) for r in continuing]
        new = [join(r) for r in joined]
        step = {r: forced[r][len(got[r])] for r in joined + continuing}
        for r, logits in router.logits_step(joined=new, continuing=cont, forced=step).items():
            got[r].append(logits)
    return {r: torch.cat(parts) for r, parts in got.items()}, router
