"""`cadence bench make-adapters` and `merge-adapter` against PEFT itself: the written
folders have exactly the keys and shapes PEFT saves for the same model, PEFT loads them
and its outputs move away from the base model's, and the merged copy equals PEFT's
`merge_and_unload` weight for weight and serves the same logits through transformers."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from cadence_bench.adapter_maker import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    DEFAULT_RELATIVE_SCALE,
    find_targets,
    make_adapters,
)
from cadence_bench.adapter_merge import MERGED_WEIGHTS, merge_adapter
from peft import LoraConfig, PeftModel, get_peft_model
from peft.utils import load_peft_weights, set_peft_model_state_dict
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

TARGETS = ("q_proj", "v_proj")
IDS = torch.tensor([[5, 17, 99, 3, 42, 7, 250, 11]])


def _base(model_dir: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def llama(model_dirs: Callable[[str], Path]) -> Path:
    return model_dirs("llama_gqa")


@pytest.fixture(scope="module")
def adapters(llama: Path, tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    out = tmp_path_factory.mktemp("adapters")
    return make_adapters(llama, 3, out, rank=8, targets=TARGETS, seed=3, dtype="float32")


def test_keys_and_shapes_are_the_ones_peft_saves(llama: Path, adapters: list[Path], tmp_path):
    peft_model = get_peft_model(
        _base(llama), LoraConfig(r=8, lora_alpha=16, target_modules=list(TARGETS))
    )
    peft_model.save_pretrained(tmp_path / "by-peft")
    theirs = load_file(str(tmp_path / "by-peft" / ADAPTER_WEIGHTS))
    ours = load_file(str(adapters[0] / ADAPTER_WEIGHTS))
    assert {k: v.shape for k, v in ours.items()} == {k: v.shape for k, v in theirs.items()}
    assert "base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight" in ours
    assert [p.name for p in adapters] == ["adapter-0000", "adapter-0001", "adapter-0002"]


def test_peft_loads_every_tensor_and_the_outputs_move(llama: Path, adapters: list[Path]):
    model = PeftModel.from_pretrained(_base(llama), str(adapters[1])).eval()
    # Loaded again by hand to see what PEFT made of each key: all of them used, none missing.
    weights = load_peft_weights(str(adapters[1]))
    result = set_peft_model_state_dict(model, weights)
    assert result.unexpected_keys == []
    assert not [k for k in result.missing_keys if "lora_" in k]
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.default.weight"
    written = weights["base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"]
    assert torch.equal(model.state_dict()[key], written)
    with torch.no_grad():
        adapted = model(input_ids=IDS).logits
        base = _base(llama)(input_ids=IDS).logits
    change = (adapted - base).norm() / base.norm()
    assert change > 1e-3, change  # the adapter is not a no-op...
    assert change < 0.5, change  # ...nor a different model


def test_the_update_has_the_asked_share_of_the_base_weight(llama: Path, adapters: list[Path]):
    norms = {t.path: t.weight_norm for t in find_targets(llama, TARGETS)}
    config = json.loads((adapters[0] / ADAPTER_CONFIG).read_text())
    scaling = config["lora_alpha"] / config["r"]
    shares = []
    for folder in adapters:
        w = load_file(str(folder / ADAPTER_WEIGHTS))
        for path, norm in norms.items():
            a = w[f"base_model.model.{path}.lora_A.weight"]
            b = w[f"base_model.model.{path}.lora_B.weight"]
            shares.append(float((scaling * b @ a).norm()) / norm)
    mean = sum(shares) / len(shares)
    assert abs(mean - DEFAULT_RELATIVE_SCALE) < 0.15 * DEFAULT_RELATIVE_SCALE, shares


def test_adapters_are_reproducible_one_by_one_and_distinct(llama: Path, adapters, tmp_path):
    again = make_adapters(llama, 2, tmp_path, rank=8, targets=TARGETS, seed=3, dtype="float32")
    for mine, theirs in zip(adapters, again, strict=False):
        assert (mine / ADAPTER_WEIGHTS).read_bytes() == (theirs / ADAPTER_WEIGHTS).read_bytes()
    first, second = (load_file(str(f / ADAPTER_WEIGHTS)) for f in adapters[:2])
    assert all(not torch.equal(first[k], second[k]) for k in first)
    other = make_adapters(llama, 1, tmp_path / "s4", targets=TARGETS, seed=4, dtype="float32")
    third = load_file(str(other[0] / ADAPTER_WEIGHTS))
    assert all(not torch.equal(first[k], third[k]) for k in first)


def test_bfloat16_adapters_and_missing_targets(llama: Path, tmp_path):
    (folder,) = make_adapters(llama, 1, tmp_path, targets=("o_proj",), dtype="bfloat16")
    tensors = load_file(str(folder / ADAPTER_WEIGHTS))
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}
    assert all(".o_proj." in k for k in tensors)
    with pytest.raises(ValueError, match="no linear layer named nope"):
        make_adapters(llama, 1, tmp_path, targets=("q_proj", "nope"))


def test_conv1d_models_are_refused(model_dirs: Callable[[str], Path], tmp_path):
    with pytest.raises(ValueError, match="Conv1D"):
        make_adapters(model_dirs("gpt2"), 1, tmp_path, targets=("c_attn",))


@pytest.mark.parametrize("variant", ["llama_gqa", "llama_mha_tied"])
@pytest.mark.parametrize("rslora", [False, True])
def test_merge_equals_peft_merge_and_unload(
    model_dirs: Callable[[str], Path], variant: str, rslora: bool, tmp_path
):
    model_dir = model_dirs(variant)
    (adapter,) = make_adapters(model_dir, 1, tmp_path / "a", targets=TARGETS, dtype="float32")
    if rslora:  # scaling alpha/sqrt(r) instead of alpha/r
        config = json.loads((adapter / ADAPTER_CONFIG).read_text())
        (adapter / ADAPTER_CONFIG).write_text(json.dumps({**config, "use_rslora": True}))
    out = merge_adapter(model_dir, adapter, tmp_path / "merged")
    peft_model = PeftModel.from_pretrained(_base(model_dir), str(adapter)).eval()
    with torch.no_grad():
        unmerged_logits = peft_model(input_ids=IDS).logits
    expected = peft_model.merge_and_unload().state_dict()
    merged = load_file(str(out / MERGED_WEIGHTS))
    original = load_file(str(model_dir / "model.safetensors"))
    for key, weight in merged.items():
        torch.testing.assert_close(weight, expected[key], rtol=0, atol=1e-6, msg=key)
        if key.endswith(("q_proj.weight", "v_proj.weight")):
            assert not torch.equal(weight, original[key]), key
        else:
            assert torch.equal(weight, original[key]), key
    assert (out / "config.json").read_text() == (model_dir / "config.json").read_text()
    with torch.no_grad():
        logits = _base(out)(input_ids=IDS).logits
    torch.testing.assert_close(logits, unmerged_logits, rtol=0, atol=1e-4)


def test_merge_refuses_what_it_does_not_implement(llama: Path, adapters: list[Path], tmp_path):
    dora = tmp_path / "dora"
    dora.mkdir()
    (dora / ADAPTER_WEIGHTS).write_bytes((adapters[0] / ADAPTER_WEIGHTS).read_bytes())
    config = json.loads((adapters[0] / ADAPTER_CONFIG).read_text())
    (dora / ADAPTER_CONFIG).write_text(json.dumps({**config, "use_dora": True}))
    with pytest.raises(ValueError, match="use_dora"):
        merge_adapter(llama, dora, tmp_path / "out")
