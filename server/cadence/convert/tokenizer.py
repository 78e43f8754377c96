"""Writes tokenizer.json and tokenizer_config.json from a GGUF's tokenizer metadata.

The byte-level BPE itself is built by transformers' GGUF tokenizer conversion; this module
fixes its pre-tokenizer to match llama.cpp's, adds what the router needs to
tokenizer_config.json (chat template, special tokens) and checks the result against the
GGUF vocabulary token by token.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from cadence.convert.gguf import GGUFModel

_BYTE_LEVEL = {
    "type": "ByteLevel",
    "add_prefix_space": False,
    "trim_offsets": True,
    "use_regex": True,
}

# llama.cpp's pre-tokenizer names (tokenizer.ggml.pre) whose regexes transformers does not
# reproduce, as `tokenizers` pre-tokenizers. "smollm" splits every digit, then GPT-2's regex.
_PRE_TOKENIZERS: dict[str, dict[str, Any]] = {
    "smollm": {
        "type": "Sequence",
        "pretokenizers": [{"type": "Digits", "individual_digits": True}, _BYTE_LEVEL],
    },
}
_CONTROL = 3  # llama.cpp token type of special (control) tokens


class TokenizerMismatch(RuntimeError):
    """The converted tokenizer.json disagrees with the GGUF vocabulary."""


def write_tokenizer(model: GGUFModel, out: Path) -> None:
    """Writes tokenizer.json and tokenizer_config.json for `model` into `out`."""
    if model.field("tokenizer.ggml.model") != "gpt2":
        kind = model.field("tokenizer.ggml.model")
        raise ValueError(f"tokenizer model {kind!r} is not supported (gpt2 byte-level BPE)")
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(model.path.parent), gguf_file=model.path.name)
    tokenizer = json.loads(hf.backend_tokenizer.to_str())
    if pre := _PRE_TOKENIZERS.get(model.field("tokenizer.ggml.pre")):
        tokenizer["pre_tokenizer"] = pre
    check_vocabulary(tokenizer, model)
    (out / "tokenizer.json").write_text(json.dumps(tokenizer, ensure_ascii=False, indent=1))
    config = tokenizer_config(model)
    (out / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False, indent=2))


def tokenizer_config(model: GGUFModel) -> dict[str, Any]:
    tokens: list[str] = model.field("tokenizer.ggml.tokens")

    def token(key: str) -> str | None:
        index = model.field(f"tokenizer.ggml.{key}_token_id")
        return None if index is None else tokens[index]

    types: list[int] = model.field("tokenizer.ggml.token_type")
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token("bos"),
        "eos_token": token("eos"),
        "pad_token": token("padding"),
        "unk_token": token("unknown"),
        "add_bos_token": bool(model.field("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(model.field("tokenizer.ggml.add_eos_token", False)),
        "additional_special_tokens": [
            t for t, kind in zip(tokens, types, strict=True) if kind == _CONTROL
        ],
        "clean_up_tokenization_spaces": False,
        "model_max_length": model.arch_field("context_length"),
        "chat_template": model.field("tokenizer.chat_template"),
    }


def check_vocabulary(tokenizer: dict[str, Any], model: GGUFModel) -> None:
    """Every id maps to the GGUF's token, the merges are the GGUF's, control tokens are special."""
    tokens: list[str] = model.field("tokenizer.ggml.tokens")
    vocab: dict[str, int] = tokenizer["model"]["vocab"]
    if len(vocab) != len(tokens) or any(vocab.get(t) != i for i, t in enumerate(tokens)):
        raise TokenizerMismatch("tokenizer.json's vocabulary differs from the GGUF's tokens")
    merges = [m if isinstance(m, str) else " ".join(m) for m in tokenizer["model"]["merges"]]
    if merges != model.field("tokenizer.ggml.merges"):
        raise TokenizerMismatch("tokenizer.json's merges differ from the GGUF's")
    types: list[int] = model.field("tokenizer.ggml.token_type")
    control = {i for i, kind in enumerate(types) if kind == _CONTROL}
    special = {t["id"] for t in tokenizer["added_tokens"] if t["special"]}
    if control != special:
        raise TokenizerMismatch(f"special ids {sorted(special)} != GGUF control {sorted(control)}")
