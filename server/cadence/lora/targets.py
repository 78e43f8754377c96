"""Where a PEFT module of a Hugging Face checkpoint lands in a cadence model.

PEFT names the modules it adapts by their path in the transformers model
(`model.layers.3.self_attn.q_proj`). cadence builds the same families with fused layers:
q/k/v in one `qkv_proj` (GPT-2's `c_attn` is fused in the checkpoint too), gate/up in one
`gate_up_proj`. A `ModuleTarget` says which of the model's `LinearBase` layers a PEFT
module adapts, which part(s) of it its B's rows fill, and the module's whole shape
(before any tensor-parallel split), so the parser can check and slice the tensors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from cadence.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from cadence.layers.linear import LinearBase
from cadence.models.gpt2 import GPT2LMHeadModel
from cadence.models.llama import LlamaForCausalLM
from cadence.models.opt import OPTForCausalLM

# The order of a fused layer's parts in its output (and in the stacked A rows)
_PART_ORDER: dict[Any, int] = {None: 0, "q": 0, "k": 1, "v": 2, 0: 0, 1: 1}


@dataclass(frozen=True, slots=True)
class Slot:
    """Rows of a PEFT module's B that fill one part of a cadence layer."""

    shard_id: Any  # the layer's part ("q", "k", "v", 0, 1), None for an unfused layer
    first_row: int  # first row of the module's B for this part (c_attn stacks q, k, v)
    rows: int


@dataclass(frozen=True, slots=True)
class ModuleSpec:
    """A module of one decoder layer (or of the model, outside the layers)."""

    layer: str  # the cadence layer's name relative to the same parent path
    in_features: int
    slots: tuple[Slot, ...]


@dataclass(frozen=True, slots=True)
class ModuleTarget:
    """A PEFT module resolved against the model built on this rank."""

    module: str  # PEFT's (transformers') module path
    layer_name: str  # qualified name of the cadence layer, as `named_modules()` gives it
    layer: LinearBase
    in_features: int  # A's columns: the module's whole input
    slots: tuple[Slot, ...]

    @property
    def out_features(self) -> int:
        """B's rows: the module's whole output."""
        return sum(s.rows for s in self.slots)

    @property
    def order(self) -> int:
        """Its position among the modules fused into the same layer."""
        return _PART_ORDER[self.slots[0].shard_id]


def _one(layer: str, in_features: int, out_features: int, shard_id: Any = None) -> ModuleSpec:
    return ModuleSpec(layer, in_features, (Slot(shard_id, 0, out_features),))


class ModuleMap:
    """The PEFT modules a family's model can take LoRA on, and where each goes."""

    def __init__(
        self,
        model: nn.Module,
        layer_prefix: str,
        num_layers: int,
        per_layer: dict[str, ModuleSpec],
        outside: dict[str, ModuleSpec] | None = None,
    ) -> None:
        self.family = type(model).__name__
        self.modules = dict(model.named_modules())
        self.layer_prefix = layer_prefix  # "model.layers." ; the layer index follows
        self.num_layers = num_layers
        self.per_layer = per_layer  # "self_attn.q_proj" -> spec
        # modules outside the decoder layers (OPT's project_in/out), when the model has them
        self.outside = {k: v for k, v in (outside or {}).items() if v.layer in self.modules}

    def names(self) -> list[str]:
        """Every module path LoRA can target in this model."""
        inner = [
            f"{self.layer_prefix}{i}.{suffix}"
            for i in range(self.num_layers)
            for suffix in self.per_layer
        ]
        return inner + list(self.outside)

    def supported(self) -> str:
        return ", ".join([*self.per_layer, *self.outside])

    def target(self, module: str) -> ModuleTarget:
        """Where `module` goes; ValueError saying why when it goes nowhere."""
        spec, layer_name = self._spec(module)
        layer = self.modules.get(layer_name)
        if not isinstance(layer, LinearBase):
            raise ValueError(f"{module}: the model has no linear layer {layer_name}")
        return ModuleTarget(module, layer_name, layer, spec.in_features, spec.slots)

    def _spec(self, module: str) -> tuple[ModuleSpec, str]:
        if module in self.outside:
            spec = self.outside[module]
            return spec, spec.layer
        if module.startswith(self.layer_prefix):
            index, _, suffix = module[len(self.layer_prefix) :].partition(".")
            spec = self.per_layer.get(suffix)
            if spec is not None and index.isdigit() and int(index) < self.num_layers:
                return spec, f"{self.layer_prefix}{index}.{spec.layer}"
        ours = self.modules.get(module)
        if isinstance(ours, ParallelLMHead) or module.split(".")[-1] == "lm_head":
            why = "is the LM head"
        elif isinstance(ours, VocabParallelEmbedding | nn.Embedding):
            why = "is an embedding"
        else:
            why = f"is not a layer of {self.family}"
        raise ValueError(f"{module} {why}; LoRA applies to {self.supported()} (per decoder layer)")


def module_map(model: nn.Module) -> ModuleMap:
    """The PEFT module map of a cadence model; ValueError for a family without one."""
    if isinstance(model, LlamaForCausalLM):
        return _llama(model)
    if isinstance(model, OPTForCausalLM):
        return _opt(model)
    if isinstance(model, GPT2LMHeadModel):
        return _gpt2(model)
    raise ValueError(f"LoRA adapters are not supported for {type(model).__name__}")


def _llama(model: LlamaForCausalLM) -> ModuleMap:
    c = model.config
    hidden, inter = c.hidden_size, c.intermediate_size
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    return ModuleMap(
        model,
        "model.layers.",
        c.num_layers,
        {
            "self_attn.q_proj": _one("self_attn.qkv_proj", hidden, q, "q"),
            "self_attn.k_proj": _one("self_attn.qkv_proj", hidden, kv, "k"),
            "self_attn.v_proj": _one("self_attn.qkv_proj", hidden, kv, "v"),
            "self_attn.o_proj": _one("self_attn.o_proj", q, hidden),
            "mlp.gate_proj": _one("mlp.gate_up_proj", hidden, inter, 0),
            "mlp.up_proj": _one("mlp.gate_up_proj", hidden, inter, 1),
            "mlp.down_proj": _one("mlp.down_proj", inter, hidden),
        },
    )


def _opt(model: OPTForCausalLM) -> ModuleMap:
    c = model.config
    hidden, inter, embed = c.hidden_size, c.intermediate_size, c.word_embed_proj_dim
    return ModuleMap(
        model,
        "model.decoder.layers.",
        c.num_layers,
        {
            "self_attn.q_proj": _one("self_attn.qkv_proj", hidden, hidden, "q"),
            "self_attn.k_proj": _one("self_attn.qkv_proj", hidden, hidden, "k"),
            "self_attn.v_proj": _one("self_attn.qkv_proj", hidden, hidden, "v"),
            "self_attn.out_proj": _one("self_attn.out_proj", hidden, hidden),
            "fc1": _one("fc1", hidden, inter),
            "fc2": _one("fc2", inter, hidden),
        },
        {
            "model.decoder.project_in": _one("model.decoder.project_in", embed, hidden),
            "model.decoder.project_out": _one("model.decoder.project_out", hidden, embed),
        },
    )


def _gpt2(model: GPT2LMHeadModel) -> ModuleMap:
    c = model.config
    hidden, inter = c.hidden_size, c.intermediate_size
    # c_attn is one Conv1D whose outputs are q, k and v: one A, B's rows split in three
    qkv = tuple(Slot(part, i * hidden, hidden) for i, part in enumerate(("q", "k", "v")))
    return ModuleMap(
        model,
        "transformer.h.",
        c.num_layers,
        {
            "attn.c_attn": ModuleSpec("attn.c_attn", hidden, qkv),
            "attn.c_proj": _one("attn.c_proj", hidden, hidden),
            "mlp.c_fc": _one("mlp.c_fc", hidden, inter),
            "mlp.c_proj": _one("mlp.c_proj", inter, hidden),
        },
    )
