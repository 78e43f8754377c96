"""The shard's engine: loads the model, chooses once what computes its steps (attention
backend, per-op kernels, model runner: `cadence.shard.backends`), answers Info, and sizes
and allocates the KV cache (Warmup: a profiling step on a scratch cache, then the budget).
The steps themselves run in `cadence.shard.step` (`StepRunner`)."""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from loguru import logger

from cadence import cpu_isa as cpu_isa
from cadence.config import ShardConfig
from cadence.huge_pages import place_packed_weights
from cadence.kernels import cpu as cpu_kernels
from cadence.kv_cache import KVCache, bytes_per_block
from cadence.kv_dtypes import check_kv_cache_choice
from cadence.kv_format import KVFormat, kv_format
from cadence.kv_scales import CALIBRATION_TOKENS, estimate_scales, read_scales_file
from cadence.layers import kernel_ops
from cadence.layers.packed import pack_linear_weights
from cadence.lora.pool import PoolShape
from cadence.models import load_model, read_config, to_dtype
from cadence.pb import shard_pb2
from cadence.quant.crossover import rows_text
from cadence.quant.product import ProductKernels
from cadence.quant.setup import (
    QuantizeConfig,
    measured_kv_cache,
    use_measured_attention_tiles,
    use_measured_bf16_product,
    use_measured_float_product,
)
from cadence.runners import ModelRunner
from cadence.sampling import SamplingBatch
from cadence.shard import backends, determinism
from cadence.shard.adapters import ShardAdapters
from cadence.shard.forward_batch import ForwardBatch
from cadence.shard.kernel_report import kernel_paths, log_line
from cadence.shard.kv_budget import CudaBudget, cpu_kv_budget, default_fraction
from cadence.shard.memory import PeakMeter, available_bytes, cuda_reading
from cadence.shard.state import BatchState
from cadence.shard.step import StepRunner
from cadence.shard.step_checks import StepPlan
from cadence.speculative.threshold import speculative_threshold

if TYPE_CHECKING:
    from cadence.speculative.draft import DraftModel

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
        if self.device.type == "cpu" and cfg.cpu_threads > 0:
            torch.set_num_threads(cfg.cpu_threads)  # on the thread every forward runs on
        cpu = backends.cpu_kernels_for(cfg, self.device)
        products = backends.product_kernels(self.device)
        if cfg.dtype == "auto":
            isa = cpu_kernels.selected_isa() or "scalar"
            self.cfg = cfg = replace(cfg, dtype=cpu_isa.default_dtype(cfg.device, isa))
        self.dtype = to_dtype(cfg.dtype)
        self.kv_format = kv_format(cfg.kv_cache_dtype or cfg.dtype)
        self.config = read_config(cfg.model_dir)
        # before the weights: what is already in use is not this shard's to spend
        self.memory_at_start = cuda_reading(self.device) if self.device.type == "cuda" else None
        started = time.perf_counter()
        quantize = QuantizeConfig(
            cfg.quantize, cfg.quantize_group_size, cfg.quantize_keep_float, products,
            one_kernel=cfg.deterministic and cfg.quantize_keep_float != "on",
            kernel_table=cfg.kernel_table,
        )  # fmt: skip
        # before the weights are packed: where float32 products go, as measured here
        float32_table = cfg.kernel_table if self.dtype == torch.float32 else ""
        self.float_product_measured = use_measured_float_product(float32_table, self.device)
        bf16_table = cfg.kernel_table if self.dtype == torch.bfloat16 else ""
        self.bf16_product_measured = use_measured_bf16_product(bf16_table, self.device)
        # an int8 cache's attention on AMX tiles where measured faster (the same bits)
        self.attention_tiles_measured = (
            use_measured_attention_tiles(
                cfg.kernel_table, self.device, cfg.dtype, self.kv_format.name
            )
            if cfg.cpu_kernels
            else ""
        )
        self.model = load_model(cfg.model_dir, self.dtype, self.device, quantize)
        # what is quantized: source, formats, crossover, float kept ({} for none)
        self.quantization: dict[str, Any] = self.model.quantization
        self.attention = self.model.attention_layers()
        unique = {p.data_ptr(): p for p in self.model.parameters()}.values()
        self.weight_bytes = sum(p.numel() * p.element_size() for p in unique)
        self.weight_bytes += self.quantization.get("quantized_bytes", 0)
        self.checkpoint_bytes_read: int = getattr(self.model, "checkpoint_bytes_read", 0)
        # on CPU: a second copy of each linear weight in oneDNN's blocked layout
        self.packed_bytes = pack_linear_weights(
            self.model, enabled=cfg.cpu_kernels, every_row_count=cfg.deterministic
        )
        self.weight_bytes += self.packed_bytes
        # 2 MB pages: fewer TLB misses in every step (the KV cache's too, in _allocate)
        self.packed_on_huge_pages = (
            place_packed_weights(self.model) if cfg.huge_pages and self.device.type == "cpu" else 0
        )
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
        kernels = backends.choose(
            cfg.attention_backend, self.device, cpu, products, self.model, cfg.deterministic
        )
        self.attention_backend = kernels.attention
        self.ops = kernels.ops
        kernel_ops.bind(self.model, self.ops)
        # LoRA adapters, paged into the KV pool's blocks (the target model's layers only)
        slab = cfg.block_size * first.num_kv_heads * first.head_dim
        slab_bytes = slab * self.kv_format.storage.itemsize
        self.adapters = ShardAdapters(
            self.model, self.dtype, PoolShape(len(self.attention), 0, slab_bytes),
            cpu_kernels=kernels.lora.cpu_rows, triton=kernels.lora.triton,
            row_by_row=cfg.deterministic,
        )  # fmt: skip
        self.kv: KVCache | None = None
        self.state: BatchState | None = None
        # proposes for ContinuingRequest.num_draft_tokens; its KV blocks ride on the target's
        draft = self._load_draft(cfg, products)
        if draft is not None:
            self.bytes_per_block += draft.bytes_per_block
        self.steps = StepRunner(
            self.model, kernels.runner, self.ops, self.adapters, draft, self.device,
            cfg.speculative_acceptance,
        )  # fmt: skip
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
            self.packed_bytes, self.quantization, packed_every_row=cfg.deterministic,
            float_measured=self.float_product_measured or self.bf16_product_measured,
        )  # fmt: skip
        self.determinism = determinism.decide(
            cfg, self.device, self.attention_backend, self.model, self.dtype
        )
        self.kernels["determinism"] = self.determinism.describe()
        logger.info(log_line(self.kernels))

    @property
    def runner(self) -> ModelRunner:
        """The model's forward (`StepRunner.runner`)."""
        return self.steps.runner

    @runner.setter
    def runner(self, runner: ModelRunner) -> None:
        self.steps.runner = runner

    @property
    def draft(self) -> DraftModel | None:
        """The draft model the steps propose with (`StepRunner.draft`), if any."""
        return self.steps.draft

    @draft.setter
    def draft(self, draft: DraftModel | None) -> None:
        self.steps.draft = draft

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
        if self.attention_tiles_measured:
            fields["kv_cache_attention"] = self.attention_tiles_measured
        q = self.quantization
        if q:
            fields["weights"] = ", ".join(sorted(q["formats"]))
            fields["source"] = q["source"]
            fields["float_copy"] = "kept" if q["float_kept"] else "none"
            fields["quantized_max_rows"] = ", ".join(
                f"{fmt}: {rows_text(c['rows'])} ({c['from']})"
                for fmt, c in sorted(q["crossover"].items())
            )
            dtype_name = str(self.dtype).removeprefix("torch.")
            measured = measured_kv_cache(self.cfg.kernel_table, self.device, dtype_name)
            if measured:  # the launcher takes its choice unless --kv-cache-dtype is given
                fields["kv_cache_measured"] = measured
        return fields

    def warmup(
        self,
        max_batch_tokens: int,
        max_batch_size: int,
        kv_cache_bytes: int = 0,
        memory_fraction: float = 0.0,
        replicas: int = 1,
        swap_blocks: int = 0,
    ) -> shard_pb2.WarmupResponse:
        """Profiles the largest step, sizes the KV cache (`kv_cache_bytes`, else from
        `memory_fraction`, whose meaning and default depend on the device: see
        `cadence.shard.kv_budget`; 0 means the default) and allocates it. `swap_blocks`:
        the host pool for swap preemption asked for (WarmupRequest.swap_blocks; 0: the
        default), answered as WarmupResponse.host_blocks, the bound of the steps' host
        block ids."""
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
        host_blocks = host_pool_blocks(swap_blocks, num_blocks)
        self._allocate(num_blocks, max_batch_size)
        assert self.kv is not None
        self.steps.host_blocks = host_blocks
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
            host_blocks=host_blocks,
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
            return self.steps.run(req, self.state, self.kv)

    def apply(self, req: shard_pb2.StepRequest, state: BatchState, kv: KVCache) -> StepPlan:
        """A step's diff checked and applied, without its forward (`StepRunner.apply`)."""
        return self.steps.apply(req, state, kv)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """One forward over a prepared batch of the held requests (`StepRunner.forward`)."""
        assert self.state is not None
        return self.steps.forward(batch, self.state)

    def _on_device(self, b: SamplingBatch) -> SamplingBatch:
        return self.steps.on_device(b)

    # -- sizing the KV cache ----------------------------------------------------------

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
            on_huge_pages=self.cfg.huge_pages,
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

    def _load_draft(self, cfg: ShardConfig, products: ProductKernels) -> DraftModel | None:
        """The draft model of `--draft-model-id` on this device, with the target's kernels,
        attention backend, block size and KV format (None without one)."""
        if not cfg.draft_model_id:
            return None
        from cadence.speculative.draft import DraftModel

        keep_float = cfg.quantize_keep_float
        quantize = QuantizeConfig(cfg.draft_quantize, cfg.quantize_group_size, keep_float, products)
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
                self.steps.run(shard_pb2.StepRequest(joined=[prompt]), self.state, self.kv)
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
                self.steps.run(step, self.state, self.kv)
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


# The host pool for swap preemption is at most this many times the KV cache's blocks:
# host memory is not measured, so the pool is bounded by what the cache's size implies.
HOST_POOL_PER_BLOCK = 4


def host_pool_blocks(asked: int, num_blocks: int) -> int:
    """The host pool for swap preemption, in blocks: `asked` (`--swap-blocks`), or the most
    allowed when it is 0."""
    most = HOST_POOL_PER_BLOCK * num_blocks
    if asked > most:
        raise ValueError(
            f"--swap-blocks ({asked}) may be at most {HOST_POOL_PER_BLOCK} × the KV cache's "
            f"blocks ({most})"
        )
    return asked or most
