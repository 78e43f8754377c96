"""The shard's engine: loads the model, chooses once what computes its steps (attention
backend, per-op kernels, model runner: `cadence.shard.backends`), sizes and allocates the
KV cache (Warmup), and runs one Step: apply the diff, one forward over every scheduled
token, sample (under a constrained request's allowed-token mask, when the step has one).
A step with speculative rows has the draft model propose first (when asked), takes the
logits at every proposal's position and verifies them (`cadence.speculative.verify`)."""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from loguru import logger

from cadence.attention_backends.base import Workspace
from cadence.config import ShardConfig
from cadence.heartbeat import HEARTBEAT, wedge_if_asked
from cadence.kernels import cpu as cpu_kernels
from cadence.kernels.cpu import isa as cpu_isa
from cadence.kv_cache import KVCache, bytes_per_block
from cadence.kv_format import KVFormat, kv_format
from cadence.kv_scales import (
    CALIBRATION_TOKENS,
    check_kv_cache_choice,
    estimate_scales,
    read_scales_file,
)
from cadence.layers import kernel_ops
from cadence.layers.packed import pack_linear_weights
from cadence.lora.pool import PoolShape
from cadence.models import load_model, read_config, to_dtype
from cadence.pb import shard_pb2
from cadence.quant.crossover import rows_text
from cadence.quant.setup import QuantizeConfig
from cadence.sampling import DO_SAMPLE, TOP_N, SampleOutput, SamplingBatch, sample
from cadence.shard import backends
from cadence.shard.adapters import ShardAdapters
from cadence.shard.flat_rows import step_layout
from cadence.shard.kernel_report import kernel_paths, log_line
from cadence.shard.kv_budget import CudaBudget, cpu_kv_budget, default_fraction
from cadence.shard.memory import PeakMeter, available_bytes, cuda_reading
from cadence.shard.state import BatchState, ForwardBatch, StepPlan
from cadence.speculative.threshold import speculative_threshold
from cadence.speculative.verify import Verified, expand, verify

if TYPE_CHECKING:
    from cadence.speculative.draft import DraftModel, DraftProposals

MiB = 1 << 20


class NotReadyError(RuntimeError):
    """A Step before Warmup allocated the KV cache."""


def init_distributed(cfg: ShardConfig) -> None:
    """Joins the tensor-parallel group when there is more than one rank."""
    if cfg.world_size > 1 and not dist.is_initialized():
        backend = "nccl" if cfg.device.startswith("cuda") else "gloo"
        dist.init_process_group(
            backend,
            init_method=f"tcp://{cfg.master_addr}:{cfg.master_port}",
            rank=cfg.rank,
            world_size=cfg.world_size,
        )


def _eos_ids(model_dir: str, config: dict) -> list[int]:
    ids: list[int] = []
    sources = [config]
    gen = Path(model_dir) / "generation_config.json"
    if gen.exists():
        import json

        sources.append(json.loads(gen.read_text()))
    for src in sources:
        eos = src.get("eos_token_id")
        for i in eos if isinstance(eos, list) else [eos]:
            if isinstance(i, int) and i not in ids:
                ids.append(i)
    return ids


class Engine:
    def __init__(self, cfg: ShardConfig) -> None:
        self.cfg = cfg
        self.device = torch.device(cfg.device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", cfg.rank % torch.cuda.device_count())
        cpu = backends.CpuKernels(False, "not on a CPU device")
        if self.device.type == "cpu" and cfg.cpu_threads > 0:
            torch.set_num_threads(cfg.cpu_threads)  # on the thread every forward runs on
        if self.device.type == "cpu":
            # once, before the model is built: every CPU kernel call runs this choice
            try:
                cpu_kernels.select(cfg.cpu_isa)
                cpu = backends.CpuKernels(cfg.cpu_kernels, "turned off (--no-cpu-kernels)")
            except cpu_kernels.KernelBuildError as err:
                logger.warning(f"C++ CPU kernels unavailable, serving through torch: {err}")
                cpu = backends.CpuKernels(False, str(err))
        if cfg.dtype == "auto":
            isa = cpu_kernels.selected_isa() or "scalar"
            self.cfg = cfg = replace(cfg, dtype=cpu_isa.default_dtype(cfg.device, isa))
        self.dtype = to_dtype(cfg.dtype)
        self.kv_format = kv_format(cfg.kv_cache_dtype or cfg.dtype)
        self.config = read_config(cfg.model_dir)
        # before the weights: what is already in use is not this shard's to spend
        self.memory_at_start = cuda_reading(self.device) if self.device.type == "cuda" else None
        started = time.perf_counter()
        quantize = QuantizeConfig(cfg.quantize, cfg.quantize_group_size, cfg.quantize_keep_float)
        self.model = load_model(cfg.model_dir, self.dtype, self.device, quantize)
        # what is quantized: source, formats, crossover, float kept ({} for none)
        self.quantization: dict[str, Any] = self.model.quantization
        self.attention = self.model.attention_layers()
        unique = {p.data_ptr(): p for p in self.model.parameters()}.values()
        self.weight_bytes = sum(p.numel() * p.element_size() for p in unique)
        self.weight_bytes += self.quantization.get("quantized_bytes", 0)
        self.checkpoint_bytes_read: int = getattr(self.model, "checkpoint_bytes_read", 0)
        # on CPU: a second copy of each linear weight in oneDNN's blocked layout
        self.packed_bytes = pack_linear_weights(self.model, enabled=cfg.cpu_kernels)
        self.weight_bytes += self.packed_bytes
        self.block_size = cfg.block_size
        first = self.attention[0]
        self.bytes_per_block = bytes_per_block(
            len(self.attention), cfg.block_size, first.num_kv_heads, first.head_dim,
            self.kv_format,
        )  # fmt: skip
        # an fp8 cache's [layers, 2] key and value scales: the file's, else warm-up's
        self.kv_layer_scales: torch.Tensor | None = None
        if cfg.kv_cache_scales:
            check_kv_cache_choice(self.kv_format.name, cfg.kv_cache_scales)
            self.kv_layer_scales = read_scales_file(cfg.kv_cache_scales, len(self.attention))
        self.attention_backend = backends.attention_backend(
            cfg.attention_backend, self.device, cpu, Workspace()
        )
        self.ops = backends.layer_ops(self.device, self.attention_backend, cpu)
        kernel_ops.bind(self.model, self.ops)
        self.runner = backends.model_runner(self.model, self.attention_backend)
        # LoRA adapters, paged into the KV pool's blocks (the target model's layers only)
        slab = cfg.block_size * first.num_kv_heads * first.head_dim
        slab_bytes = slab * self.kv_format.storage.itemsize
        self.adapters = ShardAdapters(
            self.model, self.dtype, PoolShape(len(self.attention), 0, slab_bytes), cpu.on,
            triton=self.attention_backend.name == "triton",
        )  # fmt: skip
        self.kv: KVCache | None = None
        self.state: BatchState | None = None
        # proposes for ContinuingRequest.num_draft_tokens; its KV blocks ride on the target's
        self.draft: DraftModel | None = self._load_draft(cfg)
        if self.draft is not None:
            self.bytes_per_block += self.draft.bytes_per_block
        # Cumulative counts of what the forward passes computed (HealthResponse).
        self.computed_tokens_total = 0
        self.steps_run = 0  # steps with rows since warm-up
        self.prompt_tokens_computed_total = 0
        logger.info(
            f"loaded {self.config.get('model_type')} from {cfg.model_dir} "
            f"({self.weight_bytes / MiB:.1f} MiB {cfg.dtype} on {self.device}, rank "
            f"{cfg.rank}/{cfg.world_size}, {self.checkpoint_bytes_read / MiB:.1f} MiB read, "
            f"{self.attention_backend.name} attention"
            + (f", {self.packed_bytes / MiB:.1f} MiB prepacked" if self.packed_bytes else "")
            + (f", quantized: {self.quantization['source']}" if self.quantization else "")
            + ") "
            f"in {time.perf_counter() - started:.1f}s"
        )
        self.kernels = kernel_paths(
            self.device, self.dtype, self.attention_backend, self.ops, self.runner,
            self.packed_bytes, self.quantization,
        )  # fmt: skip
        logger.info(log_line(self.kernels))

    # -- RPCs ----------------------------------------------------------------------

    @property
    def ready(self) -> bool:
        return self.state is not None

    def info(self) -> shard_pb2.InfoResponse:
        c, m = self.config, self.model.config
        max_step_tokens, source = speculative_threshold(
            self.device,
            isa=self.cfg.cpu_isa if self.device.type == "cpu" else self.device.type,
            dtype=self.cfg.dtype,
            model=Path(self.cfg.model_dir).name,
        )
        return shard_pb2.InfoResponse(
            model_id=self.cfg.model_id or self.cfg.model_dir,
            model_type=c.get("model_type", ""),
            dtype=self.cfg.dtype,
            device=str(self.device),
            block_size=self.block_size,
            rank=self.cfg.rank,
            world_size=self.cfg.world_size,
            max_position_embeddings=m.max_position_embeddings,
            vocab_size=m.vocab_size,
            eos_token_ids=_eos_ids(self.cfg.model_dir, c),
            kernels=self.kernels,
            quantization=self.quantization_fields(),
            draft_model=self.draft.name if self.draft is not None else "",
            speculative_max_step_tokens=max_step_tokens,
            speculative_threshold_source=source,
        )

    def quantization_fields(self) -> dict[str, str]:
        """How weights and KV cache are stored (InfoResponse.quantization, flat strings):
        `weights` is the float dtype unless linears are quantized."""
        fields = {
            "weights": self.cfg.dtype,
            "kv_cache_dtype": self.cfg.kv_cache_dtype or self.cfg.dtype,
        }
        q = self.quantization
        if q:
            fields["weights"] = ", ".join(sorted(q["formats"]))
            fields["source"] = q["source"]
            fields["float_copy"] = "kept" if q["float_kept"] else "none"
            fields["quantized_max_rows"] = ", ".join(
                f"{fmt}: {rows_text(c['rows'])} ({c['from']})"
                for fmt, c in sorted(q["crossover"].items())
            )
        return fields

    def warmup(
        self,
        max_batch_tokens: int,
        max_batch_size: int,
        kv_cache_bytes: int = 0,
        memory_fraction: float = 0.0,
        replicas: int = 1,
    ) -> shard_pb2.WarmupResponse:
        """Profiles the largest step, sizes the KV cache (`kv_cache_bytes`, else from
        `memory_fraction`, whose meaning and default depend on the device: see
        `cadence.shard.kv_budget`; 0 means the default) and allocates it."""
        max_batch_size = max(1, min(max_batch_size, max_batch_tokens))
        if self.kv_format.scales == "layer" and self.kv_layer_scales is None:
            self.kv_layer_scales = self._estimate_kv_scales(max_batch_tokens)
        activation, torch_peak = self._profile(max_batch_tokens, max_batch_size)
        problem = None
        if kv_cache_bytes > 0:
            budget = kv_cache_bytes
        else:
            fraction = memory_fraction
            if not 0 < fraction <= 1:
                fraction = default_fraction(self.device.type)
            fraction /= max(1, replicas)  # the replicas sharing the machine split it
            if self.memory_at_start is not None:  # CUDA
                after = cuda_reading(self.device)
                cuda = CudaBudget.measure(fraction, self.memory_at_start, after, torch_peak)
                logger.info(cuda.summary())
                budget, problem = cuda.kv_bytes, cuda.problem(self.bytes_per_block)
            else:
                available = available_bytes(self.device)
                budget = cpu_kv_budget(available, fraction, activation, self.cfg.world_size)
        num_blocks = 0 if problem else max(0, budget // self.bytes_per_block)
        if dist.is_initialized():  # every rank must hold the same block ids
            n = torch.tensor([num_blocks], device=self.device)
            dist.all_reduce(n, op=dist.ReduceOp.MIN)
            num_blocks = int(n.item())
        if num_blocks < 1:
            raise RuntimeError(
                problem
                or f"no memory left for the KV cache on this rank or another (budget "
                f"{budget / MiB:.0f} MiB, weights {self.weight_bytes / MiB:.0f} MiB, "
                f"activations {activation / MiB:.0f} MiB): raise --memory-fraction or set "
                f"--kv-cache-memory"
            )
        self._allocate(num_blocks, max_batch_size)
        assert self.kv is not None
        tokens = num_blocks * self.block_size
        logger.info(
            f"KV cache: {num_blocks} blocks of {self.block_size} tokens "
            f"({self.kv.nbytes / MiB:.1f} MiB, {tokens} tokens)"
        )
        if tokens < max_batch_tokens:
            logger.warning(
                f"the KV cache holds fewer tokens than max_batch_tokens={max_batch_tokens}"
            )
        return shard_pb2.WarmupResponse(
            num_blocks=num_blocks,
            block_size=self.block_size,
            bytes_per_block=self.bytes_per_block,
            weight_bytes=self.weight_bytes,
            activation_bytes=activation,
            kv_cache_bytes=self.kv.nbytes,
        )

    def clear_cache(self) -> None:
        if self.state is not None:
            self.state.clear()
        self.adapters.clear()

    def step(self, req: shard_pb2.StepRequest) -> shard_pb2.StepResponse:
        if self.state is None or self.kv is None:
            raise NotReadyError("Step before Warmup: the KV cache is not allocated")
        with torch.inference_mode():
            return self._step(req, self.state, self.kv)

    # -- internals -----------------------------------------------------------------

    def _step(
        self, req: shard_pb2.StepRequest, state: BatchState, kv: KVCache
    ) -> shard_pb2.StepResponse:
        plan = self.apply(req, state, kv)
        if not plan.rows:
            return shard_pb2.StepResponse()
        self.steps_run += 1
        wedge_if_asked(self.steps_run)
        started = time.perf_counter_ns()
        drafted = self._propose(plan, state) if plan.drafts else None
        batch = state.prepare(plan.rows)
        hidden = self.forward(batch)
        if state.prompt_logprobs:
            self._prompt_logprobs(batch, state, hidden)
        HEARTBEAT.beat()
        self.computed_tokens_total += batch.num_tokens
        self.prompt_tokens_computed_total += batch.num_prompt_tokens
        generations: list[shard_pb2.Generation] = []
        if batch.num_proposed is not None:
            generations = self._verify(batch, plan, state, hidden, drafted)
            if state.prompt_logprobs:
                self._attach_prompt_logprobs(batch, state, generations)
        elif batch.sample_rows.numel():
            logits = self.model.compute_logits(hidden[batch.sample_tokens.to(self.device)])
            sb = self._on_device(state.sampling_batch(batch, plan))
            out = sample(logits, sb, self.ops.greedy)
            ids = out.ids.cpu()
            state.commit(batch, ids)
            generations = self._generations(batch, sb, ids, out)
            if state.prompt_logprobs:
                self._attach_prompt_logprobs(batch, state, generations)
        else:
            state.commit(batch, torch.empty(0, dtype=torch.long))
        return shard_pb2.StepResponse(
            generations=generations,
            forward_ns=time.perf_counter_ns() - started,
            computed_tokens=batch.num_tokens,
        )

    def apply(self, req: shard_pb2.StepRequest, state: BatchState, kv: KVCache) -> StepPlan:
        """Validates the diff, then applies it in the contract's order: drop `removed`,
        swap-out, swap-in, block copies, LoRA adapters out of and into the pool, add
        `joined`, extend `continuing` tables and append their forced tokens and the
        router's proposals. The plan keeps the step's allowed-token masks for sampling and
        the requests the draft model proposes for."""
        plan = state.validate(
            req, host_blocks_limit=4 * kv.num_blocks, draft_model=self.draft is not None
        )
        self.adapters.check(req, state)
        state.remove(plan.removed)
        # Swap-out first: the router may hand the blocks it frees to this very step.
        kv.swap_out([c.src for c in req.swap_out], [c.dst for c in req.swap_out])
        kv.swap_in([c.src for c in req.swap_in], [c.dst for c in req.swap_in])
        kv.copy_blocks([c.src for c in req.copies], [c.dst for c in req.copies])
        self.adapters.page(req.adapters_out, req.adapters_in)
        state.join(plan.joined)
        if self.draft is not None and plan.joined:  # a reused slot's draft KV is stale
            self.draft.forget([state.slot_of[r.id] for r in plan.joined])
        state.extend_blocks(list(req.continuing))
        state.append_forced(list(req.continuing))
        state.append_proposed(plan.proposals)
        return plan

    def _propose(self, plan: StepPlan, state: BatchState) -> DraftProposals:
        """The draft model's proposals for the plan's draft rows, appended to their tokens."""
        assert self.draft is not None
        rows = [(state.slot_of[i], k) for i, k in plan.drafts]
        sampling = self._on_device(state.sampling_rows(torch.tensor([s for s, _ in rows])))
        drafted = self.draft.propose(state, rows, sampling)
        assert [len(t) for t in drafted.tokens] == [k for _, k in plan.drafts]
        state.append_proposed({i: t for (i, _), t in zip(plan.drafts, drafted.tokens, strict=True)})
        return drafted

    def _verify(
        self,
        batch: ForwardBatch,
        plan: StepPlan,
        state: BatchState,
        hidden: torch.Tensor,
        drafted: DraftProposals | None,
    ) -> list[shard_pb2.Generation]:
        """Verifies a speculative step's sampling rows, commits what they keep and answers
        them. Router proposals are sampled and matched (or accepted at the set rate, for
        benchmarks); draft proposals too in greedy rows, and rejection-sampled against the
        draft's distributions in sampling rows."""
        assert batch.num_proposed is not None and batch.verify_tokens is not None
        k = batch.num_proposed
        logits = self.model.compute_logits(hidden[batch.verify_tokens.to(self.device)])
        sb = state.sampling_batch(batch, plan)
        top_n = sb.params[:, TOP_N].long().tolist()
        ids = [batch.ids[r] for r in batch.sample_rows.tolist()]
        synthetic = torch.tensor([i in plan.proposals for i in ids], dtype=torch.bool)
        if self.cfg.speculative_acceptance <= 0:
            synthetic[:] = False
        rejection = torch.zeros(len(ids), dtype=torch.bool)
        q = None
        if drafted is not None and drafted.q_logprobs is not None:
            # each draft row's q rows, found by request id (propose saw the plan's order)
            starts, at = 0, {}
            for i, n in plan.drafts:
                at[i] = torch.arange(starts, starts + n)
                starts += n
            rejection = torch.tensor([i in at for i in ids]) & sb.params[:, DO_SAMPLE].bool()
            picked = [at[i] for i, r in zip(ids, rejection.tolist(), strict=True) if r]
            if picked:
                q = drafted.q_logprobs[torch.cat(picked).to(drafted.q_logprobs.device)]
        v = verify(
            logits, self._on_device(expand(sb, k)), k, state.proposals_of(batch), synthetic,
            self.cfg.speculative_acceptance, rejection, q, self.ops.greedy,
            synthetic_keys=torch.tensor(ids, dtype=torch.long),
        )  # fmt: skip
        state.commit_verified(batch, v.tokens, v.accepted)
        if self.draft is not None and plan.drafts:
            slots = [state.slot_of[i] for i, _ in plan.drafts]
            self.draft.accepted(slots, state.computed[slots].tolist())
        return self._verified_generations(ids, k, v, top_n)

    @staticmethod
    def _verified_generations(
        ids: list[int], num_proposed: torch.Tensor, v: Verified, top_n: list[int]
    ) -> list[shard_pb2.Generation]:
        """One Generation per sampling row: its 1 + accepted tokens, their logprobs and top
        alternatives, and the proposal counts."""
        tokens, logprobs = v.tokens.tolist(), v.logprobs.tolist()
        top_ids = top_lps = None
        if v.top_ids is not None and v.top_logprobs is not None:
            top_ids, top_lps = v.top_ids.tolist(), v.top_logprobs.tolist()
        gens, start = [], 0
        for i, k, a, n in zip(ids, num_proposed.tolist(), v.accepted.tolist(), top_n, strict=True):
            end = start + 1 + a
            g = shard_pb2.Generation(
                id=i,
                token_ids=tokens[start:end],
                logprobs=logprobs[start:end],
                num_proposed=k,
                num_accepted=a,
            )
            if top_ids is not None and top_lps is not None and n > 0:
                g.top_tokens.extend(
                    shard_pb2.TopTokens(ids=top_ids[t][:n], logprobs=top_lps[t][:n])
                    for t in range(start, end)
                )
            gens.append(g)
            start = end
        return gens

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """One forward over the flat batch -> hidden states [T, hidden], each request's
        rows through its LoRA adapter when it has one."""
        d = self.device
        layout = step_layout(batch, self.block_size, d)
        assert self.state is not None
        with self.adapters.step(batch, self.state):
            return self.runner.forward(layout, batch.input_ids.to(d), batch.positions.to(d))

    def _on_device(self, b: SamplingBatch) -> SamplingBatch:
        if self.device.type == "cpu":
            return b
        names = ("params", "seeds", "positions", "history", "seq_lens", "prompt_lens")
        extras = ("bias_rows", "bias_ids", "bias_values", "allowed_rows", "allowed_words")
        for name in (*names, *extras):
            t = getattr(b, name)
            if t is not None:
                setattr(b, name, t.to(self.device, non_blocking=True))
        return b

    def _generations(
        self,
        batch: ForwardBatch,
        sb: SamplingBatch,
        ids: torch.Tensor,
        out: SampleOutput,
    ) -> list[shard_pb2.Generation]:
        rows = batch.sample_rows.tolist()
        tokens = ids.tolist()
        logprobs = out.logprobs.tolist()
        top_n = sb.params[:, TOP_N].long().tolist()
        top_ids = top_lps = None
        if out.top_ids is not None:
            top_ids = out.top_ids.tolist()
            top_lps = out.top_logprobs.tolist()
        gens = []
        for i, row in enumerate(rows):
            g = shard_pb2.Generation(
                id=batch.ids[row], token_ids=[tokens[i]], logprobs=[logprobs[i]]
            )
            if top_ids is not None and top_n[i] > 0:
                n = top_n[i]
                g.top_tokens.append(
                    shard_pb2.TopTokens(ids=top_ids[i][:n], logprobs=top_lps[i][:n])
                )
            gens.append(g)
        return gens

    def _prompt_logprobs(
        self, batch: ForwardBatch, state: BatchState, hidden: torch.Tensor
    ) -> None:
        """Logprobs of the prompt tokens this step's chunk predicts, for the requests that
        asked: the raw model distribution (no penalties, bias or warpers)."""
        starts = batch.query_start.tolist()
        ends = batch.context_lens.tolist()
        for row, slot in enumerate(batch.slots.tolist()):
            acc = state.prompt_logprobs.get(slot)
            if acc is None or acc.sent:
                continue
            n = starts[row + 1] - starts[row]
            first = ends[row] - n  # position of the chunk's first token
            prompt_len = int(state.prompt_lens[slot])
            count = min(n, prompt_len - 1 - first)  # positions whose next token is prompt
            if count <= 0:
                continue
            flat = hidden[starts[row] : starts[row] + count]
            logprobs = self.model.compute_logits(flat).float().log_softmax(dim=-1)
            targets = state.tokens[slot, first + 1 : first + 1 + count].to(logprobs.device)
            acc.logprobs += logprobs.gather(1, targets.unsqueeze(1)).squeeze(1).tolist()
            top_n = int(state.params[slot, TOP_N])
            if top_n > 0:
                values, ids = logprobs.topk(min(top_n, logprobs.shape[1]), dim=-1)
                acc.top_ids += ids.tolist()
                acc.top_logprobs += values.tolist()

    @staticmethod
    def _attach_prompt_logprobs(
        batch: ForwardBatch, state: BatchState, generations: list[shard_pb2.Generation]
    ) -> None:
        """Sends each request's prompt logprobs once, with its first sampled token."""
        for g in generations:
            acc = state.prompt_logprobs.get(state.slot_of[g.id])
            if acc is None or acc.sent:
                continue
            g.prompt_logprobs.extend(acc.logprobs)
            for ids, lps in zip(acc.top_ids, acc.top_logprobs, strict=True):
                g.prompt_top_tokens.append(shard_pb2.TopTokens(ids=ids, logprobs=lps))
            acc.sent = True
            acc.logprobs, acc.top_ids, acc.top_logprobs = [], [], []

    def _allocate(self, num_blocks: int, max_batch_size: int, fmt: KVFormat | None = None) -> None:
        first = self.attention[0]
        self.kv = None
        self.kv = KVCache(
            len(self.attention),
            num_blocks,
            self.block_size,
            first.num_kv_heads,
            first.head_dim,
            fmt or self.kv_format,
            self.device,
            layer_scales=self.kv_layer_scales,
        )
        for i, layer in enumerate(self.attention):
            layer.k_cache, layer.v_cache = self.kv.layer(i)
            layer.k_scale, layer.v_scale = self.kv.scales(i)
        self.adapters.attach(self.kv)
        if self.draft is not None:
            self.draft.allocate(num_blocks)
        vocab = self.model.config.vocab_size
        self.state = BatchState(
            self.block_size, num_blocks, vocab, capacity=max(16, max_batch_size)
        )

    def _load_draft(self, cfg: ShardConfig) -> DraftModel | None:
        """The draft model of `--draft-model-id` on this device, with the target's kernels,
        attention backend, block size and KV format (None without one)."""
        if not cfg.draft_model_id:
            return None
        from cadence.speculative.draft import DraftModel

        keep_float = cfg.quantize_keep_float
        quantize = QuantizeConfig(cfg.draft_quantize, cfg.quantize_group_size, keep_float)
        draft = DraftModel(
            cfg.draft_model_id, self.dtype, self.device, quantize, self.ops,
            self.attention_backend, target_vocab_size=self.model.config.vocab_size,
            block_size=cfg.block_size, kv_format=self.kv_format, pack_weights=cfg.cpu_kernels,
        )  # fmt: skip
        logger.info(
            f"draft model {draft.name}: {draft.bytes_per_block} KV bytes per block"
            + (f", {cfg.draft_quantize}" if cfg.draft_quantize else "")
        )
        return draft

    def _release_cache(self) -> None:
        if self.draft is not None:
            self.draft.release()
        self.kv, self.state = None, None
        self.adapters.attach(None)
        for layer in self.attention:
            layer.k_cache = layer.v_cache = torch.empty(0)
            layer.k_scale = layer.v_scale = None

    def _estimate_kv_scales(self, max_batch_tokens: int) -> torch.Tensor:
        """An fp8 cache's per-layer scales (`cadence.kv_scales`): one prefill of a fixed
        pseudo-random prompt into a cache of the activations' dtype, then the largest
        |key| and |value| each layer wrote there."""
        n = min(CALIBRATION_TOKENS, max_batch_tokens, self.model.config.max_position_embeddings - 1)
        blocks = -(-n // self.block_size)
        vocab = self.model.config.vocab_size
        tokens = torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(0))
        prompt = shard_pb2.NewRequest(
            id=0, token_ids=tokens.tolist(), prompt_len=n, num_compute=n,
            block_table=list(range(blocks)), sampling=shard_pb2.SamplingParams(),
        )  # fmt: skip
        self._allocate(blocks, 1, fmt=kv_format(str(self.dtype).removeprefix("torch.")))
        assert self.kv is not None and self.state is not None
        try:
            with torch.inference_mode():
                self._step(shard_pb2.StepRequest(joined=[prompt]), self.state, self.kv)
            scales = estimate_scales(self.kv.blocks, blocks, self.kv_format.max)
        finally:
            self._release_cache()
        logger.info(
            f"{self.kv_format.name} KV cache scales from a {n}-token warm-up prompt: keys "
            f"{scales[:, 0].min():.3g}..{scales[:, 0].max():.3g}, values "
            f"{scales[:, 1].min():.3g}..{scales[:, 1].max():.3g}"
        )
        return scales

    def _profile(self, max_batch_tokens: int, max_batch_size: int) -> tuple[int, int]:
        """Runs the largest step the router may send (one long prefill next to
        max_batch_size - 1 single-token rows, every row sampling with filters on under an
        allowed-token mask) on a scratch cache. Returns its peak activation bytes, and on
        CUDA the most torch reserved meanwhile without the scratch cache (weights and
        activations; 0 on CPU)."""
        bs = self.block_size
        long = max_batch_tokens - (max_batch_size - 1)
        # no sequence is longer than the model's position table (OPT's is a lookup)
        long = max(1, min(long, self.model.config.max_position_embeddings - 1))
        blocks_long = -(-long // bs)
        scratch_blocks = blocks_long + max_batch_size - 1
        params = shard_pb2.SamplingParams(
            do_sample=True, temperature=0.7, top_k=50, top_p=0.9, repetition_penalty=1.1
        )
        joined = [
            shard_pb2.NewRequest(
                id=0,
                token_ids=[1] * long,
                prompt_len=long,
                num_compute=long,
                block_table=list(range(blocks_long)),
                sampling=params,
                top_n_tokens=5,
            )
        ]
        for i in range(1, max_batch_size):
            joined.append(
                shard_pb2.NewRequest(
                    id=i,
                    token_ids=[1],
                    prompt_len=1,
                    num_compute=1,
                    block_table=[blocks_long + i - 1],
                    sampling=params,
                    top_n_tokens=5,
                )
            )
        everything = b"\xff" * 4 * -(-self.model.config.vocab_size // 32)
        allowed = [shard_pb2.AllowedTokens(id=r.id, words=everything) for r in joined]
        self._allocate(scratch_blocks, max_batch_size)
        assert self.kv is not None and self.state is not None
        scratch = self.kv.nbytes
        if self.draft is not None:
            scratch += scratch_blocks * self.draft.bytes_per_block
        try:
            with PeakMeter(self.device) as meter, torch.inference_mode():
                step = shard_pb2.StepRequest(joined=joined, allowed=allowed)
                self._step(step, self.state, self.kv)
            peak = meter.peak()
            torch_peak = max(0, meter.torch_reserved_peak() - scratch)
        finally:
            self._release_cache()
        if peak is None:  # no peak counter: a generous estimate from the shapes
            m = self.model.config
            hidden, inter, heads = m.hidden_size, m.intermediate_size, m.num_heads
            vocab = m.vocab_size
            item = self.dtype.itemsize
            peak = max_batch_tokens * (6 * hidden + 3 * inter) * item
            # the sampler's float copies of the logits, and the masks' unpacked bits
            peak += heads * long * long * 4 + 9 * max_batch_size * vocab * 4
        return max(0, peak - scratch), torch_peak
