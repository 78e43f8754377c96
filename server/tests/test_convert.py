"""The embedded GGUF read as Hugging Face weights is exact, whether served as it is or
written out as a float copy: same weights and logits as transformers' own GGUF loader, and
a tokenizer that encodes like the GGUF's vocabulary and merges."""

from __future__ import annotations

import functools
import json
import math
import time
from pathlib import Path

import pytest
import regex
import torch
from cadence.convert import convert_gguf, is_converted
from cadence.convert.gguf import GGUFModel, GGUFSource, unpermute_rotary
from cadence.convert.gguf_blocks import BLOCK
from cadence.model_source import embedded_gguf
from safetensors.torch import load_file
from tokenizers import Tokenizer

PROBES = [
    "Hello, world! It's a test; we'll see.",
    "Café, déjà vu, naïve façade, Ærøskøbing, straße",
    "emoji 🦀🚀👩‍👩‍👧 and CJK 你好，世界",
    "numbers 12345 + 6.78 = 12351.78",
    "  leading spaces,\ttabs\n\nnew lines   trailing   ",
    "<|im_start|>user\nhi there<|im_end|>\n",
]


@pytest.fixture(scope="module")
def gguf_path() -> Path:
    return embedded_gguf()


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory, gguf_path: Path) -> Path:
    return convert_gguf(gguf_path, tmp_path_factory.mktemp("convert") / "SmolLM2")


@pytest.fixture(scope="module")
def reference(gguf_path: Path) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """transformers' own GGUF path: its config parser, dequantizer and q/k un-permutation.

    (`from_pretrained(gguf_file=...)` wraps exactly these calls but insists on accelerate.)
    """
    import gguf
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    with pytest.MonkeyPatch.context() as patch:
        # transformers parses the file twice (for the config, then the tensors: 5 s each,
        # most of it the tokenizer's 98,000 strings) and builds gguf's tensor-name map once
        # per module (397 times, 6 s). Both are pure functions of their arguments, so each
        # is computed once here: the reference's values are the same, 11 s sooner.
        patch.setattr(gguf, "GGUFReader", functools.cache(gguf.GGUFReader))
        patch.setattr(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map))
        path = str(gguf_path)
        config = AutoConfig.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        tensors = load_gguf_checkpoint(path, return_tensors=True, model_to_load=model)
    state = tensors["tensors"]
    incompatible = model.load_state_dict(state, strict=False)
    assert incompatible.unexpected_keys == []
    assert set(incompatible.missing_keys) <= {"lm_head.weight"}  # tied to embed_tokens
    return model.eval(), state


def test_tensor_names_map_llama_cpp_to_hugging_face(gguf_path: Path) -> None:
    names = GGUFModel(gguf_path).hf_names
    assert names["token_embd.weight"] == "model.embed_tokens.weight"
    assert names["blk.7.attn_output.weight"] == "model.layers.7.self_attn.o_proj.weight"
    assert names["blk.0.ffn_norm.weight"] == "model.layers.0.post_attention_layernorm.weight"
    assert names["blk.29.ffn_down.weight"] == "model.layers.29.mlp.down_proj.weight"
    assert names["output.weight"] == "lm_head.weight"  # absent from this (tied) file
    assert "rope_freqs.weight" not in names


def test_unpermute_rotary_inverts_llama_cpp_permutation() -> None:
    heads, head_dim, hidden = 3, 8, 5
    weight = torch.randn(heads * head_dim, hidden)
    # llama.cpp convert_hf_to_gguf.py: reshape(n_head, 2, dim // n_head // 2, ...).swapaxes(1, 2)
    permuted = weight.reshape(heads, 2, head_dim // 2, hidden).transpose(1, 2).reshape(weight.shape)
    assert torch.equal(unpermute_rotary(permuted, heads), weight)


def test_config_matches_transformers_gguf_parse(converted: Path, reference) -> None:
    ours = json.loads((converted / "config.json").read_text())
    theirs = reference[0].config
    for key in (
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "intermediate_size",
        "max_position_embeddings",
        "vocab_size",
        "bos_token_id",
        "eos_token_id",
        "tie_word_embeddings",
    ):
        assert ours[key] == getattr(theirs, key), key
    assert ours["rope_theta"] == theirs.rope_parameters["rope_theta"]
    assert math.isclose(ours["rms_norm_eps"], theirs.rms_norm_eps, rel_tol=1e-6)
    assert ours["model_type"] == "llama" and ours["architectures"] == ["LlamaForCausalLM"]
    assert ours["tie_word_embeddings"] is True  # this GGUF has no output.weight


def test_weights_equal_transformers_gguf_dequantization(converted: Path, reference) -> None:
    ours = load_file(str(converted / "model.safetensors"))
    theirs = reference[1]
    assert set(ours) == set(theirs)
    for name, tensor in ours.items():
        assert tensor.dtype == torch.float32
        assert tensor.shape == theirs[name].shape, name
        assert torch.equal(tensor, theirs[name]), name


def test_served_weights_equal_transformers_gguf_dequantization(gguf_path: Path, reference) -> None:
    """Served as it is: Q4_1 linears as int4 (q/k rows unpermuted with their scales), the
    Q8_0 embedding and F32 norms as float; dequantized, every value equals transformers'."""
    source = GGUFSource(gguf_path)
    assert source.description == "gguf Q4_1"
    theirs = reference[1]
    linears = dict(source.quantized_linears())
    floats = dict(source.float_tensors())
    assert len(linears) == 30 * 7 and set(floats) == {
        "model.embed_tokens.weight",
        "model.norm.weight",
        *(f"model.layers.{i}.{n}.weight" for i in range(30) for n in _NORMS),
    }
    assert set(linears) | set(floats) == set(theirs)
    for name, weight in linears.items():
        assert weight.group_size == BLOCK and weight.perm is None
        assert torch.equal(weight.dequantize(), theirs[name]), name
    for name, tensor in floats.items():
        assert torch.equal(tensor, theirs[name]), name


_NORMS = ("input_layernorm", "post_attention_layernorm")


def test_logits_equal_transformers_running_the_gguf(converted: Path, reference) -> None:
    from transformers import AutoModelForCausalLM

    ours = AutoModelForCausalLM.from_pretrained(str(converted), dtype=torch.float32).eval()
    ids = Tokenizer.from_file(str(converted / "tokenizer.json")).encode(PROBES[0]).ids
    with torch.no_grad():
        expected = reference[0](torch.tensor([ids])).logits
        got = ours(torch.tensor([ids])).logits
    assert (got - expected).abs().max().item() <= 1e-5


def test_converted_model_answers_sensibly(converted: Path) -> None:
    """Both loaders could share a q/k layout bug; a coherent answer rules that out."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(converted))
    model = AutoModelForCausalLM.from_pretrained(str(converted), dtype=torch.float32).eval()
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=12, do_sample=False)
    assert "Paris" in tokenizer.decode(out[0, ids.shape[1] :])


def _bytes_to_unicode() -> dict[int, str]:
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    extra = [b for b in range(256) if b not in printable]
    return {b: chr(b) for b in printable} | {b: chr(256 + i) for i, b in enumerate(extra)}


class GGUFReferenceTokenizer:
    """llama.cpp's byte-level BPE for pre-tokenizer "smollm", from the GGUF metadata alone."""

    # llama.cpp llama-vocab.cpp, LLAMA_VOCAB_PRE_TYPE_SMOLLM: digits alone, then GPT-2's regex.
    DIGITS = regex.compile(r"\p{N}")
    GPT2 = regex.compile(
        r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
    )

    def __init__(self, model: GGUFModel) -> None:
        assert model.field("tokenizer.ggml.pre") == "smollm"
        tokens = model.field("tokenizer.ggml.tokens")
        self.vocab = {t: i for i, t in enumerate(tokens)}
        self.tokens = tokens
        merges = [tuple(m.split(" ")) for m in model.field("tokenizer.ggml.merges")]
        self.ranks = {pair: rank for rank, pair in enumerate(merges)}
        types = model.field("tokenizer.ggml.token_type")
        special = [t for t, kind in zip(tokens, types, strict=True) if kind == 3]
        self.special = regex.compile("(" + "|".join(map(regex.escape, special)) + ")")
        self.byte_chars = _bytes_to_unicode()

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        for i, segment in enumerate(self.special.split(text)):
            if i % 2:
                ids.append(self.vocab[segment])
                continue
            for chunk in _split_keep(self.DIGITS, segment):
                for word in self.GPT2.findall(chunk):
                    mapped = "".join(self.byte_chars[b] for b in word.encode("utf-8"))
                    ids.extend(self.vocab[p] for p in self._bpe(mapped))
        return ids

    def _bpe(self, word: str) -> list[str]:
        parts = list(word)
        while len(parts) > 1:
            rank, i = min(
                (self.ranks.get(pair, math.inf), i)
                for i, pair in enumerate(zip(parts[:-1], parts[1:], strict=True))
            )
            if rank == math.inf:
                break
            parts[i : i + 2] = [parts[i] + parts[i + 1]]
        return parts


def _split_keep(pattern: regex.Pattern, text: str) -> list[str]:
    pieces, last = [], 0
    for match in pattern.finditer(text):
        pieces += [text[last : match.start()], match.group()]
        last = match.end()
    return [p for p in [*pieces, text[last:]] if p]


def test_tokenizer_encodes_like_the_gguf_vocabulary(converted: Path, gguf_path: Path) -> None:
    from transformers import AutoTokenizer

    reference = GGUFReferenceTokenizer(GGUFModel(gguf_path))
    fast = Tokenizer.from_file(str(converted / "tokenizer.json"))  # what the Rust router loads
    hf = AutoTokenizer.from_pretrained(str(converted))
    chat = hf.apply_chat_template(
        [{"role": "user", "content": "Bonjour ! Ça va ? 🙂"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert chat.startswith("<|im_start|>system\n") and chat.endswith("<|im_start|>assistant\n")
    for text in [*PROBES, chat]:
        ids = fast.encode(text, add_special_tokens=False).ids
        assert ids == reference.encode(text), text
        assert fast.decode(ids, skip_special_tokens=False) == text
        assert hf.encode(text, add_special_tokens=False) == ids


def test_tokenizer_config_carries_template_and_special_tokens(
    converted: Path, gguf_path: Path
) -> None:
    config = json.loads((converted / "tokenizer_config.json").read_text())
    model = GGUFModel(gguf_path)
    assert config["chat_template"] == model.field("tokenizer.chat_template")
    assert (config["bos_token"], config["eos_token"]) == ("<|im_start|>", "<|im_end|>")
    assert config["pad_token"] == "<|im_end|>"
    generation = json.loads((converted / "generation_config.json").read_text())
    assert generation["eos_token_id"] == 2


def test_second_conversion_returns_the_finished_folder_at_once(
    converted: Path, gguf_path: Path
) -> None:
    assert is_converted(converted)
    before = (converted / "model.safetensors").stat().st_mtime_ns
    started = time.perf_counter()
    assert convert_gguf(gguf_path, converted) == converted
    assert time.perf_counter() - started < 1.0
    assert (converted / "model.safetensors").stat().st_mtime_ns == before
    leftovers = [p for p in converted.parent.iterdir() if p.name.endswith(".tmp")]
    assert leftovers == []


def test_losing_a_conversion_race_keeps_the_winners_folder(tmp_path: Path) -> None:
    from cadence.convert.folder import REQUIRED_FILES, _publish

    winner, loser = tmp_path / "model", tmp_path / ".model.x.tmp"
    for folder, text in ((winner, "winner"), (loser, "loser")):
        folder.mkdir()
        for name in REQUIRED_FILES:
            (folder / name).write_text(text)
    _publish(loser, winner, is_converted)  # rename fails: the target is a finished folder
    assert (winner / "config.json").read_text() == "winner"


def test_an_unfinished_output_folder_is_replaced(tmp_path: Path) -> None:
    from cadence.convert.folder import REQUIRED_FILES, _publish

    output, tmp = tmp_path / "model", tmp_path / ".model.x.tmp"
    output.mkdir()
    (output / "config.json").write_text("half")
    tmp.mkdir()
    for name in REQUIRED_FILES:
        (tmp / name).write_text("whole")
    _publish(tmp, output, is_converted)
    assert is_converted(output) and not tmp.exists()
