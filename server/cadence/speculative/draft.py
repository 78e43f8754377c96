"""The shard's draft model: a second, usually smaller, model on the same device that
proposes the next tokens of the requests the router asks it to (`num_draft_tokens`),
for the target to verify in its own forward (`cadence.speculative.verify`).

Its KV cache has its own shape (its layers, KV heads, head dim) in the target's format
and the target's block count: a request's draft keys and values live in the same block
ids as its target ones, read and written through the target's block tables, so the
router's block accounting covers both. Per slot it keeps how many of the request's
tokens its own cache holds; each `propose` first catches up from there to the last
known token, then drafts one token per forward."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from cadence.attention_backends import AttentionBackend
from cadence.kv_cache import KVCache, bytes_per_block
from cadence.kv_format import KVFormat
from cadence.layers import kernel_ops
from cadence.layers.kernel_ops import LayerOps
from cadence.layers.packed import pack_linear_weights
from cadence.models import load_model
from cadence.quant.setup import QuantizeConfig
from cadence.sampling import DO_SAMPLE, SamplingBatch, processed_logprobs
from cadence.shard import backends
from cadence.shard.state import BatchState
from cadence.speculative.draft_batch import draft_batch
from cadence.speculative.draft_sampling import draft_tokens, step_sampling


@dataclass(slots=True)
class DraftProposals:
    tokens: list[list[int]]  # k per row, in the order of `propose`'s rows
    # [sum k, vocab] float32: the processed log-probs each proposal was drawn from, row
    # by row; None when every row is greedy
    q_logprobs: torch.Tensor | None


class DraftModel:
    """A second model whose KV cache lives in the target's block ids (a second cache
    tensor per layer, indexed by the target's block tables)."""

    def __init__(
        self,
        model_dir: str,
        dtype: torch.dtype,
        device: torch.device,
        quantize: QuantizeConfig,
        ops: LayerOps,
        attention_backend: AttentionBackend[Any],
        *,
        target_vocab_size: int,
        block_size: int,
        kv_format: KVFormat,
        pack_weights: bool = False,
    ) -> None:
        """`target_vocab_size`: the target's vocabulary, which the draft's must equal (a
        proposal is a token id of both); `block_size`, `kv_format`: the target's cache's;
        `pack_weights`: give the linears their prepacked CPU copies, as the target's."""
        self.model = load_model(model_dir, dtype, device, quantize)
        vocab = self.model.config.vocab_size
        if vocab != target_vocab_size:
            raise ValueError(
                f"the draft model {model_dir} has a vocabulary of {vocab} tokens and the "
                f"target model one of {target_vocab_size}: a draft model must share the "
                "target's tokenizer"
            )
        pack_linear_weights(self.model, enabled=pack_weights)
        kernel_ops.bind(self.model, ops)
        self.runner = backends.model_runner(self.model, attention_backend)
        self.name = model_dir
        self.device = device
        self.block_size = block_size
        self.kv_format = kv_format
        self.attention = self.model.attention_layers()
        first = self.attention[0]
        self.bytes_per_block = bytes_per_block(
            len(self.attention), block_size, first.num_kv_heads, first.head_dim, kv_format
        )
        self.kv: KVCache | None = None
        # per slot: how many of its request's tokens, from the first, the draft cache holds
        self.computed = torch.zeros(0, dtype=torch.long)

    def allocate(self, num_blocks: int) -> None:
        """The draft cache, as many blocks as the target's. An fp8 cache keeps the scale
        1.0 per layer: a draft's rounding only changes which tokens it proposes."""
        first = self.attention[0]
        self.kv = None
        self.kv = KVCache(
            len(self.attention), num_blocks, self.block_size, first.num_kv_heads,
            first.head_dim, self.kv_format, self.device,
        )  # fmt: skip
        for i, layer in enumerate(self.attention):
            layer.k_cache, layer.v_cache = self.kv.layer(i)
            layer.k_scale, layer.v_scale = self.kv.scales(i)
        # a fresh tensor: the old one may be an inference tensor (grown inside a step)
        self.computed = torch.zeros_like(self.computed)

    def release(self) -> None:
        self.kv = None
        for layer in self.attention:
            layer.k_cache = layer.v_cache = torch.empty(0)
            layer.k_scale = layer.v_scale = None
        self.computed = torch.zeros_like(self.computed)

    def forget(self, slots: list[int]) -> None:
        """The slots hold new requests: nothing of theirs is in the draft cache."""
        if slots:
            self._reserve(max(slots) + 1)
            self.computed[slots] = 0

    def accepted(self, slots: list[int], computed: list[int]) -> None:
        """After verification: each slot's target computed count. The draft cache stays
        valid up to it (its rejected proposals' keys and values are overwritten later)."""
        if slots:
            self._reserve(max(slots) + 1)
            self.computed[slots] = torch.minimum(self.computed[slots], torch.tensor(computed))

    def propose(
        self, state: BatchState, rows: list[tuple[int, int]], sampling: SamplingBatch
    ) -> DraftProposals:
        """`rows`: (slot, k) per request, before its proposals are appended: its last
        known token (position p = seq_len - 1) is not computed by the target yet, and its
        block table covers p + k. `sampling`: one row per entry of `rows`, sampling the
        token at p + 1. One catch-up forward over every row's tokens the draft cache lacks
        up to p, then k - 1 single-token forwards over the rows still drafting."""
        if not rows:
            return DraftProposals([], None)
        assert self.kv is not None, "propose before allocate"
        slots = [s for s, _ in rows]
        ks = torch.tensor([k for _, k in rows])
        if int(ks.min()) < 1:
            raise ValueError("a draft row asks for no proposal")
        self._reserve(max(slots) + 1)
        last = state.seq_lens[slots] - 1  # p: the last known token's position
        first = torch.minimum(self.computed[slots], last)  # the first the cache lacks
        starts, counts = first.tolist(), (last + 1 - first).tolist()
        seqs = [state.tokens[s, a : a + n] for s, a, n in zip(slots, starts, counts, strict=True)]
        batch = draft_batch(state.block_tables, self.block_size, slots, starts, counts, self.device)
        input_ids = torch.cat([seqs[i] for i in batch.order.tolist()]).to(self.device)
        with torch.inference_mode():
            hidden = self.runner.forward(batch.layout, input_ids, batch.positions)
            logits = self.model.compute_logits(hidden[batch.last])
            drafted, q = self._draft(state, slots, last, ks, logits, sampling)
        self.computed[slots] = last + ks
        tokens = [row[:k] for row, k in zip(drafted.tolist(), ks.tolist(), strict=True)]
        return DraftProposals(tokens, q)

    def _draft(
        self,
        state: BatchState,
        slots: list[int],
        last: torch.Tensor,
        ks: torch.Tensor,
        logits: torch.Tensor,
        sampling: SamplingBatch,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The proposals [R, max k] (each row's first k valid) and, when a row samples,
        the log-probs they were drawn from, row by row ([sum k, vocab])."""
        device = sampling.params.device
        num_rows, most = len(slots), int(ks.max())
        drafted = torch.zeros(num_rows, most, dtype=torch.long, device=device)
        keep_q = bool(sampling.params[:, DO_SAMPLE].any())
        q_steps: list[torch.Tensor] = []  # per draft step j: [rows drafting, vocab]
        active = torch.arange(num_rows)
        for j in range(most):
            rows = active.to(device)
            if j > 0:  # one forward of each active row's latest proposal, at p + j
                batch = draft_batch(
                    state.block_tables, self.block_size,
                    [slots[i] for i in active.tolist()], (last[active] + j).tolist(),
                    [1] * len(active), self.device,
                )  # fmt: skip
                input_ids = drafted[rows, j - 1].to(self.device)
                hidden = self.runner.forward(batch.layout, input_ids, batch.positions)
                logits = self.model.compute_logits(hidden)
            b = step_sampling(sampling, rows, drafted[rows, :j])
            logprobs = processed_logprobs(logits, b)
            drafted[rows, j] = draft_tokens(logprobs, b)
            if keep_q:
                q_steps.append(logprobs)
            active = active[ks[active] > j + 1]
        if not keep_q:
            return drafted, None
        # step-major (each step's active rows) to row-major (each row's k steps)
        step_of = torch.arange(most).repeat_interleave(torch.tensor([len(q) for q in q_steps]))
        row_of = torch.cat([torch.nonzero(ks > j).squeeze(1) for j in range(most)])
        order = torch.argsort(row_of * most + step_of)
        return drafted, torch.cat(q_steps)[order.to(q_steps[0].device)]

    def _reserve(self, slots: int) -> None:
        if slots > self.computed.shape[0]:
            grown = torch.zeros(max(slots, 2 * self.computed.shape[0]), dtype=torch.long)
            grown[: self.computed.shape[0]] = self.computed
            self.computed = grown
