"""The shard's LoRA adapters: parsed ones in host memory (LoadAdapter / DropAdapter, off
the forward thread), the ones paged into the KV pool (the Step's `adapters_out` /
`adapters_in`), and each step's tables for the layers' hooks.

A request names its adapter when it joins (`NewRequest.adapter_id`, kept on its slot in
`BatchState.adapter_of`); the adapter must be paged in by then and stays so while a held
request uses it. An adapter paged out has its blocks zeroed: the blocks go back to the
KV cache, and its weights' bytes read as keys or values could be NaN.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

from cadence.kv_cache import KVCache
from cadence.lora import cpu_rows
from cadence.lora.apply import LoraContext, install
from cadence.lora.batch import build_step
from cadence.lora.peft_adapter import load_peft_adapter
from cadence.lora.peft_config import AdapterError
from cadence.lora.pool import AdapterFitError, PoolRows, PoolShape, blocks_needed, page_in
from cadence.lora.resident import ResidentAdapters
from cadence.lora.torch_ops import SEGMENT_MIN_ROWS
from cadence.lora.weights import AdapterWeights
from cadence.pb import shard_pb2
from cadence.shard.forward_batch import ForwardBatch
from cadence.shard.state import BatchState
from cadence.shard.step_checks import StepError


class AdapterRefused(ValueError):
    """LoadAdapter refused: the message says which adapter and why (INVALID_ARGUMENT)."""


class ShardAdapters:
    def __init__(
        self,
        model: nn.Module,
        dtype: torch.dtype,
        shape: PoolShape,
        cpu_kernels: bool = False,
        triton: bool = False,
        row_by_row: bool = False,
    ) -> None:
        """`shape`: the KV pool's slabs (its block count is taken from the cache once
        allocated); `cpu_kernels`: whether the C++ CPU kernels serve this shard; `triton`:
        whether its products run through the Triton kernels (with the triton attention
        backend: on CUDA, or on CPU under the interpreter); `row_by_row`: every adapter row
        through the C++ row kernels, however many rows share an adapter (batch-invariant
        serving: a matrix product for long runs would give a row other bits)."""
        self.row_by_row = row_by_row and cpu_kernels
        self.model = model
        self.dtype = dtype
        self.shape = shape
        self.context = LoraContext(cpu_kernels=cpu_kernels, triton=triton)
        self.sites = install(model, self.context)
        self.resident = ResidentAdapters(self.sites)
        self.host: dict[str, AdapterWeights] = {}
        self._host_lock = threading.Lock()  # LoadAdapter / DropAdapter beside the steps

    # -- host memory (any thread) ---------------------------------------------------

    def load(self, name: str, path: str) -> shard_pb2.LoadAdapterResponse:
        """Parses the adapter folder at `path` and keeps it as `name`."""
        if not name:
            raise AdapterRefused("an adapter needs a name")
        if not Path(path).is_dir():
            raise AdapterRefused(f"adapter {name}: no adapter folder at {path}")
        try:
            with torch.inference_mode():
                weights = load_peft_adapter(name, path, self.model, self.dtype)
        except OSError as e:
            raise AdapterRefused(f"adapter {name}: cannot read {path}: {e}") from e
        except AdapterError as e:
            raise AdapterRefused(str(e)) from e
        return self.keep(weights)

    def keep(self, weights: AdapterWeights) -> shard_pb2.LoadAdapterResponse:
        """Keeps parsed weights in host memory, once checked against the model and the
        pool; answers what LoadAdapter answers."""
        unknown = sorted(set(weights.layers) - set(self.sites))
        if unknown:
            raise AdapterRefused(f"adapter {weights.name}: no linear layer {unknown[0]}")
        try:
            num_blocks = blocks_needed(weights, self.shape, self.dtype)
        except AdapterFitError as e:
            raise AdapterRefused(f"adapter {weights.name}: {e}") from e
        with self._host_lock:
            self.host[weights.name] = weights
        return shard_pb2.LoadAdapterResponse(
            num_blocks=num_blocks,
            max_rank=weights.max_rank,
            target_modules=list(weights.target_modules),
            bytes=weights.nbytes,
        )

    def drop(self, name: str) -> None:
        with self._host_lock:
            self.host.pop(name, None)

    # -- the pool (forward thread) ------------------------------------------------------

    def attach(self, cache: KVCache | None) -> None:
        """A new KV cache (or none): nothing is paged in it."""
        self.resident.clear()
        self.context.pool = None if cache is None else PoolRows(cache, self.dtype)
        self.resident.device = cache.blocks.device if cache is not None else torch.device("cpu")

    def clear(self) -> None:
        """A new Steps session: the router has forgotten what it paged in."""
        self.resident.clear()

    def check(self, req: shard_pb2.StepRequest, state: BatchState) -> None:
        """The step's adapter changes and its joined requests' adapters, checked against
        what is paged in and held; changes nothing."""
        pool = self.context.pool
        if not (req.adapters_out or req.adapters_in or any(r.adapter_id for r in req.joined)):
            return
        assert pool is not None
        removed = {state.slot_of[i] for i in req.removed if i in state.slot_of}
        in_use = {a for slot, a in state.adapter_of.items() if slot not in removed}
        out = set(req.adapters_out)
        for name in req.adapters_out:
            if name not in self.resident:
                raise StepError(f"adapters_out: adapter {name} is not paged in")
            if name in in_use:
                raise StepError(f"adapters_out: adapter {name} is used by a held request")
        paged = set(self.resident.adapters) - out
        nb = pool.shape.num_blocks
        for pages in req.adapters_in:
            name = pages.name
            weights = self.host.get(name)
            if weights is None:
                raise StepError(f"adapters_in: adapter {name} is not loaded (LoadAdapter)")
            if name in paged:
                raise StepError(f"adapters_in: adapter {name} is already paged in")
            if pages.blocks and max(pages.blocks) >= nb:
                raise StepError(f"adapters_in: adapter {name}: block {max(pages.blocks)} >= {nb}")
            need = blocks_needed(weights, self.shape, self.dtype)
            if len(pages.blocks) < need:
                raise StepError(
                    f"adapters_in: adapter {name} needs {need} blocks, given {len(pages.blocks)}"
                )
            paged.add(name)
        for r in req.joined:
            if r.adapter_id and r.adapter_id not in paged:
                raise StepError(
                    f"request {r.id}: adapter {r.adapter_id} is not paged in",
                    request_id=r.request_id,
                )

    def page(self, out: Sequence[str], pages: Sequence[shard_pb2.AdapterPages]) -> None:
        """Pages `out` out of the pool (their blocks zeroed), then `pages` in."""
        pool = self.context.pool
        for name in out:
            assert pool is not None
            blocks = torch.tensor(self.resident.remove(name).blocks, dtype=torch.long)
            pool.cache.blocks[:, :, blocks.to(pool.cache.blocks.device)] = 0
        for p in pages:
            assert pool is not None
            self.resident.add(page_in(self.host[p.name], list(p.blocks), pool))

    # -- a step ---------------------------------------------------------------------

    @contextmanager
    def step(self, batch: ForwardBatch, state: BatchState) -> Iterator[None]:
        """The hooks see this batch's adapters (none when no request has one) while the
        forward runs."""
        adapters = state.adapter_of
        names = [adapters.get(s) for s in batch.slots.tolist()] if adapters else []
        if not any(names):
            yield
            return
        counts = (batch.query_start[1:] - batch.query_start[:-1]).tolist()
        min_rows = cpu_rows.SEGMENT_MIN_ROWS if self.context.cpu_kernels else SEGMENT_MIN_ROWS
        if self.row_by_row:
            min_rows = sum(counts) + 1  # no run of rows is long enough for a matrix product
        self.context.step = build_step(
            names, counts, self.resident, min_rows, triton=self.context.triton
        )
        try:
            yield
        finally:
            self.context.step = None
