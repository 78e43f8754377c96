"""Small GGUF files written the way llama.cpp's converter writes them, from tiny random
transformers models: llama.cpp tensor names, llama's q/k rows permuted, each linear in a
chosen GGUF type, and a small byte-level BPE tokenizer in SmolLM2's style."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFWriter, TokenType
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedModel, Qwen2Config

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1 (bos), 2 (eos, pad)
MERGES = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _byte_chars() -> list[str]:
    """GPT-2's printable stand-ins for the 256 byte values, in byte order."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    extra = [b for b in range(256) if b not in printable]
    chars = {b: chr(b) for b in printable} | {b: chr(256 + i) for i, b in enumerate(extra)}
    return [chars[b] for b in range(256)]


TOKENS = [*SPECIAL, *_byte_chars(), *(m.replace(" ", "") for m in MERGES)]
VOCAB = len(TOKENS)
TINY = dict(
    hidden_size=64,
    intermediate_size=256,  # ffn_down's input: a whole 256-value K-quant block
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=VOCAB,
    max_position_embeddings=512,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=2,
)

# Each test model's GGUF types by Hugging Face name (every other tensor F32), mixing both
# int4 types, Q8_0 and a K-quant, F16 and BF16, as llama.cpp's mixes do; llama's layer 0
# q/k/v and qwen2's layer 1 gate/up mix int4 with other types in one fused layer.
LLAMA_TYPES = {
    "model.embed_tokens.weight": Q.Q8_0,
    "model.layers.0.self_attn.q_proj.weight": Q.Q4_1,
    "model.layers.0.self_attn.k_proj.weight": Q.Q4_0,
    "model.layers.0.self_attn.v_proj.weight": Q.Q8_0,
    "model.layers.0.self_attn.o_proj.weight": Q.Q4_1,
    "model.layers.0.mlp.gate_proj.weight": Q.Q4_0,
    "model.layers.0.mlp.up_proj.weight": Q.Q4_1,
    "model.layers.0.mlp.down_proj.weight": Q.Q6_K,
    "model.layers.1.self_attn.q_proj.weight": Q.Q4_1,
    "model.layers.1.self_attn.k_proj.weight": Q.Q4_0,
    "model.layers.1.self_attn.v_proj.weight": Q.Q4_1,
    "model.layers.1.self_attn.o_proj.weight": Q.BF16,
    "model.layers.1.mlp.gate_proj.weight": Q.Q4_1,
    "model.layers.1.mlp.up_proj.weight": Q.Q4_0,
    "model.layers.1.mlp.down_proj.weight": Q.Q4_1,
}
QWEN2_TYPES = {
    "model.embed_tokens.weight": Q.F16,
    "model.layers.0.self_attn.q_proj.weight": Q.Q4_0,
    "model.layers.0.self_attn.k_proj.weight": Q.Q4_1,
    "model.layers.0.self_attn.v_proj.weight": Q.Q4_1,
    "model.layers.0.self_attn.o_proj.weight": Q.Q8_0,
    "model.layers.0.mlp.gate_proj.weight": Q.Q4_1,
    "model.layers.0.mlp.up_proj.weight": Q.Q4_1,
    "model.layers.0.mlp.down_proj.weight": Q.Q4_0,
    "model.layers.1.self_attn.q_proj.weight": Q.Q4_1,
    "model.layers.1.self_attn.k_proj.weight": Q.Q4_0,
    "model.layers.1.self_attn.v_proj.weight": Q.Q4_1,
    "model.layers.1.self_attn.o_proj.weight": Q.Q4_1,
    "model.layers.1.mlp.gate_proj.weight": Q.Q4_0,
    "model.layers.1.mlp.up_proj.weight": Q.F16,
    "model.layers.1.mlp.down_proj.weight": Q.Q4_1,
    "lm_head.weight": Q.Q4_0,
}
ARCHS = {"llama": LLAMA_TYPES, "qwen2": QWEN2_TYPES}
# The int4 tensors served as float: their fused layer has parts of other types.
DEMOTED = {
    "llama": {
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.k_proj.weight",
    },
    "qwen2": {"model.layers.1.mlp.gate_proj.weight"},
}


def tiny_model(arch: str) -> PreTrainedModel:
    """A random tiny Llama (tied LM head, like SmolLM2) or Qwen2 (q/k/v biases, its own
    LM head)."""
    torch.manual_seed(0)
    if arch == "llama":
        config = LlamaConfig(**TINY, rms_norm_eps=1e-5, tie_word_embeddings=True)
    else:
        config = Qwen2Config(**TINY, rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # Larger weights than the default init, as the other model tests use: attention that
    # is far from uniform, so q/k rows out of place change the logits.
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.15 if p.dim() > 1 else 0.5).add_(1.0 if p.dim() == 1 else 0.0)
    return model.eval()


def permute_rotary(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's converter (LlamaModel.permute): each head's rows (half, i) -> (i, half)."""
    shape = weight.shape
    return (
        weight.reshape(n_heads, 2, shape[0] // n_heads // 2, *shape[1:])
        .swapaxes(1, 2)
        .reshape(shape)
    )


def gguf_rotary_heads(arch: str, hf_name: str, model: PreTrainedModel) -> int | None:
    """Heads llama.cpp permutes in this tensor: llama's q and k, nothing of Qwen2's."""
    if arch != "llama":
        return None
    if ".q_proj." in hf_name:
        return model.config.num_attention_heads
    if ".k_proj." in hf_name:
        return model.config.num_key_value_heads
    return None


def k_quant_bytes(rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random Q6_K blocks (gguf can read K-quants but not write them): random 6-bit values
    and int8 sub-block scales, and a float16 block scale (the last 2 of 210 bytes) small
    enough for weights of a usual size."""
    blocks = rng.integers(0, 256, size=(rows, cols // 256, 210), dtype=np.uint8)
    d = np.full((rows, cols // 256, 1), 2e-4, dtype=np.float16).view(np.uint8)
    blocks[..., 208:] = d
    return blocks.reshape(rows, -1)


def _add_tokenizer(writer: GGUFWriter) -> None:
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(TOKENS)
    types = [TokenType.CONTROL] * len(SPECIAL) + [TokenType.NORMAL] * (VOCAB - len(SPECIAL))
    writer.add_token_types(types)
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)


def write_gguf(arch: str, model: PreTrainedModel, path: Path) -> dict[str, np.ndarray]:
    """Writes `model` as llama.cpp would; returns what each tensor was written as
    ({HF name: GGUF-layout values before quantizing}) for the tests to compare with."""
    c = model.config
    writer = GGUFWriter(path, arch)
    writer.add_block_count(c.num_hidden_layers)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_rope_freq_base(c.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_rope_dimension_count(c.hidden_size // c.num_attention_heads)
    writer.add_vocab_size(c.vocab_size)
    _add_tokenizer(writer)

    types = ARCHS[arch]
    arch_id = {name: key for key, name in gguf.MODEL_ARCH_NAMES.items()}[arch]
    names = gguf.get_tensor_name_map(arch_id, c.num_hidden_layers)
    rng = np.random.default_rng(0)
    written: dict[str, np.ndarray] = {}
    for hf_name, param in model.state_dict().items():
        if hf_name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        values = param.numpy()
        if (heads := gguf_rotary_heads(arch, hf_name, model)) is not None:
            values = permute_rotary(values, heads)
        qtype = types.get(hf_name, Q.F32)
        if qtype == Q.Q6_K:
            data = k_quant_bytes(*values.shape, rng)
        else:
            data = gguf.quants.quantize(values, qtype)
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        writer.add_tensor(name, data, raw_dtype=qtype if data.dtype == np.uint8 else None)
        written[hf_name] = values
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return written
