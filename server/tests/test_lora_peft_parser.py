"""PEFT LoRA folders parsed into a rank's AdapterWeights: for each family the dense delta
the parsed slices add to each cadence layer equals PEFT's own `get_delta_weight` of the
modules fused there (ranks, rsLoRA, rank/alpha patterns, layer selection, regex targets);
with 2 ranks each rank's slices equal its part of the weights PEFT merges (uneven head
split included) and put together give the whole delta; what cadence cannot serve is
refused, naming the field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from cadence.lora.peft_adapter import AdapterError, load_peft_adapter
from cadence.lora.peft_config import parse_adapter_config
from cadence.models import load_model
from lora_helpers import dense_delta, make_peft_adapter, peft_deltas, peft_model
from lora_tp_worker import run_group
from safetensors.torch import load_file, save_file

LLAMA_ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
OPT_ALL = ["q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"]
GPT2_ALL = ["c_attn", "c_proj", "c_fc"]

# transformers' separate projections fused in one cadence layer, in its output order
FUSED = {
    leaf: (fused, parts)
    for fused, parts in (
        ("qkv_proj", ("q_proj", "k_proj", "v_proj")),
        ("gate_up_proj", ("gate_proj", "up_proj")),
    )
    for leaf in parts
}

CASES = {
    "llama_all": ("llama_gqa", dict(target_modules=LLAMA_ALL)),
    "llama_qv_rslora": ("llama_gqa", dict(r=4, alpha=8, target_modules=["q_proj", "v_proj"],
                                          use_rslora=True)),
    "llama_patterns": ("llama_gqa", dict(
        target_modules=LLAMA_ALL,
        rank_pattern={"q_proj": 2, r"layers\.1\.mlp\.down_proj": 6},
        # the first key matching wins: layer 0's q_proj takes 7, layer 1's 3
        alpha_pattern={"model.layers.0.self_attn.q_proj": 7, "q_proj": 3, "up_proj": 5},
    )),
    "llama_layer_1": ("llama_gqa", dict(target_modules=["q_proj", "gate_proj", "o_proj"],
                                        layers_to_transform=[1])),
    "llama_regex": ("llama_gqa", dict(target_modules=r".*\.(k_proj|o_proj|up_proj)")),
    "qwen2": ("qwen2", dict(r=6, target_modules=["q_proj", "k_proj", "v_proj", "down_proj"])),
    "opt_all": ("opt", dict(target_modules=OPT_ALL)),
    "opt_350m_projections": ("opt_350m", dict(r=4, target_modules=["project_in", "project_out",
                                                                     "q_proj", "fc2"])),
    "gpt2_all": ("gpt2", dict(target_modules=GPT2_ALL)),
    "gpt2_layer_0_rslora": ("gpt2", dict(r=4, target_modules=["c_attn", "c_proj"],
                                         use_rslora=True, layers_to_transform=0,
                                         exclude_modules=["mlp.c_proj"])),
}  # fmt: skip


@pytest.fixture(scope="module")
def adapters(model_dirs, tmp_path_factory) -> dict[str, Path]:
    """Every case's adapter, made once by PEFT."""
    root = tmp_path_factory.mktemp("lora")
    return {
        case: make_peft_adapter(model_dirs(model), root / case, seed=i, **kwargs)
        for i, (case, (model, kwargs)) in enumerate(CASES.items())
    }


def expected_deltas(model_dir: Path, adapter_dir: Path) -> dict[str, torch.Tensor]:
    """PEFT's deltas per cadence layer: a fused layer's parts stacked in its output order,
    zeros for a part the adapter leaves alone."""
    peft = peft_model(model_dir, adapter_dir)
    deltas = peft_deltas(peft)
    modules = dict(peft.get_base_model().named_modules())
    layers = {}
    for name in deltas:
        parent, leaf = name.rsplit(".", 1)
        fused, parts = FUSED.get(leaf, (leaf, (leaf,)))
        layers[f"{parent}.{fused}"] = torch.cat(
            [
                deltas.get(f"{parent}.{p}", torch.zeros_like(modules[f"{parent}.{p}"].weight))
                for p in parts
            ]
        )
    return layers


def peft_ranks(adapter_dir: Path) -> dict[str, int]:
    tensors = load_file(str(adapter_dir / "adapter_model.safetensors"))
    return {
        k.removeprefix("base_model.model.").removesuffix(".lora_A.weight"): v.shape[0]
        for k, v in tensors.items()
        if k.endswith(".lora_A.weight")
    }


@pytest.mark.parametrize("case", CASES)
def test_parsed_deltas_equal_peft_delta_weights(case, adapters, model_dirs):
    model_dir = model_dirs(CASES[case][0])
    model = load_model(model_dir, "float32", "cpu")
    weights = load_peft_adapter(case, adapters[case], model, torch.float32)
    expected = expected_deltas(model_dir, adapters[case])
    layers = dict(model.named_modules())
    assert sorted(weights.layers) == sorted(expected)
    for name, lora in weights.layers.items():
        got = dense_delta(lora, layers[name].out_features)
        torch.testing.assert_close(got, expected[name], atol=1e-5, rtol=1e-5, msg=name)
        assert lora.a.dtype == torch.float32 and lora.a.is_contiguous()
        assert all(p.b_t.is_contiguous() for p in lora.pieces)
        # parts in the layer's order: q, k, v (gate, up), A rows stacked alike
        offsets = [(p.out_offset, p.rank_start) for p in lora.pieces]
        assert offsets == sorted(offsets), name
    ranks = peft_ranks(adapters[case])
    assert weights.max_rank == max(ranks.values())
    assert weights.target_modules == tuple(sorted({m.rsplit(".", 1)[-1] for m in ranks}))


def test_patterns_give_each_module_its_rank_and_alpha(adapters):
    """PEFT's own choice per module (through its LoRA layers), seen in the parsed ranks."""
    ranks = peft_ranks(adapters["llama_patterns"])
    assert ranks["model.layers.0.self_attn.q_proj"] == 2
    assert ranks["model.layers.1.mlp.down_proj"] == 6
    assert ranks["model.layers.0.mlp.down_proj"] == 8


def test_bfloat16_weights_are_cast(adapters, model_dirs):
    model_dir = model_dirs("llama_gqa")
    model = load_model(model_dir, "bfloat16", "cpu")
    weights = load_peft_adapter("x", adapters["llama_all"], model, torch.bfloat16)
    expected = expected_deltas(model_dir, adapters["llama_all"])
    layers = dict(model.named_modules())
    for name, lora in weights.layers.items():
        assert lora.a.dtype == torch.bfloat16
        assert all(p.b_t.dtype == torch.bfloat16 for p in lora.pieces)
        got = dense_delta(lora, layers[name].out_features)
        scale = expected[name].abs().max().item()
        torch.testing.assert_close(got, expected[name], atol=0.02 * scale, rtol=0.02, msg=name)


# --- two ranks --------------------------------------------------------------------------

TP_CASES = {
    # 3 KV heads over 2 ranks: 2 KV groups (6 query heads) on rank 0, 1 (3) on rank 1
    "uneven": ("llama_9_heads_3_kv", dict(target_modules=LLAMA_ALL)),
    "kv1_replicated": ("llama_kv1_odd_vocab", dict(r=4, target_modules=LLAMA_ALL)),
    "opt": ("opt", dict(target_modules=OPT_ALL)),
    "opt_350m": ("opt_350m", dict(target_modules=["project_in", "project_out", "out_proj"])),
    "gpt2": ("gpt2", dict(target_modules=GPT2_ALL)),
}


@pytest.fixture(scope="module")
def two_ranks(model_dirs, tmp_path_factory) -> tuple[list[dict], dict[str, Path]]:
    """Each case parsed on both ranks of a gloo group, beside PEFT's merged model."""
    root = tmp_path_factory.mktemp("lora_tp")
    cases, adapter_dirs = [], {}
    for case, (model, kwargs) in TP_CASES.items():
        model_dir = model_dirs(model)
        adapter = make_peft_adapter(model_dir, root / case, seed=3, **kwargs)
        merged = root / f"{case}_merged"
        peft_model(model_dir, adapter).merge_and_unload().save_pretrained(merged)
        cases.append((case, str(model_dir), str(merged), str(adapter)))
        adapter_dirs[case] = adapter
    return run_group(2, cases, root), adapter_dirs


@pytest.mark.parametrize("case", TP_CASES)
def test_each_ranks_slices_equal_its_part_of_the_merged_weights(case, two_ranks):
    ranks, _ = two_ranks
    for rank, results in enumerate(ranks):
        deltas, merged = results[case]["delta"], results[case]["merged_minus_base"]
        for name, diff in merged.items():
            got = deltas.get(name, torch.zeros_like(diff))
            torch.testing.assert_close(got, diff, atol=1e-5, rtol=1e-4, msg=f"rank {rank} {name}")
        assert deltas, f"rank {rank}: nothing adapted"


def test_uneven_slices_put_together_give_the_whole_delta(two_ranks, model_dirs):
    """9 query heads in 3 KV groups of head_dim 8 over 2 ranks: q/k/v rows 48/16/16 on
    rank 0, 24/8/8 on rank 1; the row-parallel o_proj's inputs split 48/24."""
    ranks, adapter_dirs = two_ranks
    whole = expected_deltas(model_dirs("llama_9_heads_3_kv"), adapter_dirs["uneven"])
    local = [r["uneven"]["delta"] for r in ranks]
    splits = [(48, 16, 16), (24, 8, 8)]
    for layer in range(2):
        attn, mlp = f"model.layers.{layer}.self_attn", f"model.layers.{layer}.mlp"
        parts = [local[r][f"{attn}.qkv_proj"].split(splits[r]) for r in range(2)]
        together = torch.cat([torch.cat([p[i] for p in parts]) for i in range(3)])
        torch.testing.assert_close(together, whole[f"{attn}.qkv_proj"], atol=1e-5, rtol=1e-5)
        for name in (f"{attn}.o_proj", f"{mlp}.down_proj"):  # row-parallel: input columns
            together = torch.cat([local[r][name] for r in range(2)], dim=1)
            torch.testing.assert_close(together, whole[name], atol=1e-5, rtol=1e-5)
        gate_up = [local[r][f"{mlp}.gate_up_proj"].chunk(2) for r in range(2)]
        together = torch.cat([torch.cat([g[i] for g in gate_up]) for i in range(2)])
        torch.testing.assert_close(together, whole[f"{mlp}.gate_up_proj"], atol=1e-5, rtol=1e-5)


# --- refusals ---------------------------------------------------------------------------


def rewrite(adapter_dir: Path, config: dict | None = None, tensors: dict | None = None) -> Path:
    """Updates the adapter's config fields / replaces its tensors (None values delete)."""
    if config is not None:
        path = adapter_dir / "adapter_config.json"
        raw = json.loads(path.read_text())
        raw.update(config)
        path.write_text(json.dumps(raw))
    if tensors is not None:
        path = adapter_dir / "adapter_model.safetensors"
        current = load_file(str(path))
        current.update(tensors)
        save_file({k: v for k, v in current.items() if v is not None}, str(path))
    return adapter_dir


@pytest.fixture(scope="module")
def gqa_model(model_dirs):
    return load_model(model_dirs("llama_gqa"), "float32", "cpu")


def refusal(model, adapter_dir: Path) -> str:
    with pytest.raises(AdapterError) as e:
        load_peft_adapter("bad", adapter_dir, model, torch.float32)
    return str(e.value)


KEY = "base_model.model.model.layers.0.self_attn.q_proj"


@pytest.mark.parametrize(
    "extra, names",
    [
        (dict(target_modules=["q_proj"], use_dora=True), ["use_dora"]),
        (dict(target_modules=["q_proj"], modules_to_save=["lm_head"]), ["modules_to_save"]),
        (dict(target_modules=["embed_tokens"]), ["target_modules", "embed_tokens"]),
        (dict(target_modules=["lm_head"]), ["target_modules", "lm_head"]),
        (dict(target_modules=["q_proj"], bias="all"), ["bias"]),
        (dict(target_modules=["q_proj"], lora_bias=True), ["lora_bias"]),
    ],
)
def test_unsupported_adapters_are_refused(extra, names, gqa_model, model_dirs, tmp_path):
    adapter = make_peft_adapter(model_dirs("llama_gqa"), tmp_path / "a", r=4, **extra)
    message = refusal(gqa_model, adapter)
    assert all(n in message for n in names), message
    assert "'bad'" in message


@pytest.fixture
def q_adapter(model_dirs, tmp_path) -> Path:
    targets = ["q_proj", "v_proj"]
    return make_peft_adapter(model_dirs("llama_gqa"), tmp_path / "q", r=4, target_modules=targets)


def test_unknown_key_is_refused(q_adapter, gqa_model):
    message = refusal(
        gqa_model, rewrite(q_adapter, tensors={f"{KEY}.lora_C.weight": torch.ones(2)})
    )
    assert f"{KEY}.lora_C.weight" in message and "maps to no LoRA factor" in message


def test_missing_factor_is_refused(q_adapter, gqa_model):
    message = refusal(gqa_model, rewrite(q_adapter, tensors={f"{KEY}.lora_B.weight": None}))
    assert "model.layers.0.self_attn.q_proj" in message and "lora_B.weight is missing" in message


def test_module_the_model_lacks_is_refused(q_adapter, gqa_model):
    moved = {f"{KEY}.lora_A.weight": None, f"{KEY}.lora_B.weight": None}
    tensors = load_file(str(q_adapter / "adapter_model.safetensors"))
    far = "base_model.model.model.layers.5.self_attn.q_proj"  # the model has 2 layers
    moved |= {f"{far}.lora_{f}.weight": tensors[f"{KEY}.lora_{f}.weight"] for f in "AB"}
    message = refusal(gqa_model, rewrite(q_adapter, tensors=moved))
    assert "target_modules" in message and "model.layers.5.self_attn.q_proj" in message


def test_weights_target_modules_does_not_select_are_refused(q_adapter, gqa_model):
    message = refusal(gqa_model, rewrite(q_adapter, config={"target_modules": ["q_proj"]}))
    assert "v_proj" in message and "target_modules" in message


def test_targeted_module_without_weights_is_refused(q_adapter, gqa_model):
    config = {"target_modules": ["q_proj", "v_proj", "o_proj"]}
    message = refusal(gqa_model, rewrite(q_adapter, config=config))
    assert "model.layers.0.self_attn.o_proj" in message and "no LoRA weights" in message


@pytest.mark.parametrize(
    "config, says",
    [
        ({"r": 8}, "weights have rank 4, the config says r=8"),
        ({"rank_pattern": {"v_proj": 2}}, "v_proj: its weights have rank 4, the config says r=2"),
        ({"r": 0}, "r=0: not a positive integer"),
        ({"r": "4"}, "r='4': not a positive integer"),
    ],
)
def test_rank_the_weights_do_not_have_is_refused(config, says, q_adapter, gqa_model):
    message = refusal(gqa_model, rewrite(q_adapter, config=config))
    assert says in message, message


def test_broken_factor_rank_is_refused(q_adapter, gqa_model):
    """lora_B's rank differs from lora_A's."""
    message = refusal(
        gqa_model, rewrite(q_adapter, tensors={f"{KEY}.lora_B.weight": torch.ones(64, 3)})
    )
    assert "model.layers.0.self_attn.q_proj" in message and "rank" in message


def test_adapter_for_another_shape_is_refused(model_dirs, gqa_model, tmp_path):
    """An adapter made for 4 KV heads: its k_proj has 64 outputs, the model's 32."""
    adapter = make_peft_adapter(
        model_dirs("llama_mha_tied"), tmp_path / "mha", r=4, target_modules=["k_proj"]
    )
    message = refusal(gqa_model, adapter)
    assert "k_proj" in message and "do not fit the base layer" in message


def test_lm_head_factors_alone_are_refused(model_dirs, gqa_model, tmp_path):
    """Without the LM head's base weights PEFT saves beside them: the module is refused."""
    adapter = make_peft_adapter(
        model_dirs("llama_gqa"), tmp_path / "head", r=4, target_modules=["lm_head"]
    )
    message = refusal(
        gqa_model, rewrite(adapter, tensors={"base_model.model.lm_head.base_layer.weight": None})
    )
    assert "target_modules: lm_head is the LM head" in message, message


def test_pickled_weights_are_refused(q_adapter, gqa_model):
    (q_adapter / "adapter_model.safetensors").rename(q_adapter / "adapter_model.bin")
    message = refusal(gqa_model, q_adapter)
    assert "adapter_model.bin" in message and "pickle" in message


def test_another_base_model_name_is_not_refused(q_adapter, gqa_model):
    rewrite(q_adapter, config={"base_model_name_or_path": "someone/another-model"})
    weights = load_peft_adapter("ok", q_adapter, gqa_model, torch.float32)
    assert sorted(weights.layers) == ["model.layers.0.self_attn.qkv_proj",
                                      "model.layers.1.self_attn.qkv_proj"]  # fmt: skip


@pytest.mark.parametrize(
    "config, field",
    [
        ({"peft_type": "LOHA"}, "peft_type"),
        ({"init_lora_weights": "pissa"}, "init_lora_weights"),
        ({"target_modules": None}, "target_modules"),
        ({"layers_to_transform": "0"}, "layers_to_transform"),
        ({"rank_pattern": {"(": 2}}, "rank_pattern"),
    ],
)
def test_broken_config_fields_are_named(config, field):
    base = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"], "bias": "none"}
    with pytest.raises(AdapterError, match=field):
        parse_adapter_config({**base, **config})


# --- PEFT's matching rules ----------------------------------------------------------------

MODULE_NAMES = [
    f"{prefix}{i}.{leaf}"
    for prefix, leaves in (
        ("model.layers.", ("self_attn.q_proj", "self_attn.o_proj", "mlp.down_proj")),
        ("transformer.h.", ("attn.c_attn", "mlp.c_proj")),
        ("model.decoder.layers.", ("self_attn.out_proj", "fc2")),
    )
    for leaf in leaves
    for i in (0, 1, 12)
] + ["model.decoder.project_in", "lm_head"]


@pytest.mark.parametrize(
    "fields",
    [
        dict(target_modules=["q_proj", "c_proj", "fc2"]),
        dict(target_modules=["q_proj", "c_attn", "mlp.c_proj"], layers_to_transform=[1, 12]),
        dict(target_modules=["o_proj", "out_proj", "c_proj"], layers_to_transform=0),
        dict(target_modules=["q_proj", "c_attn"], layers_to_transform=[1], layers_pattern="h"),
        dict(target_modules=["model.layers.12.mlp.down_proj", "project_in", "q_proj"],
             layers_to_transform=[0]),
        dict(target_modules=r".*layers\.1\d?\..*(proj|fc2)"),
        dict(target_modules=["q_proj", "c_proj", "fc2"], exclude_modules=["mlp.c_proj"]),
        dict(target_modules=r".*proj", exclude_modules=r".*\.1\..*"),
    ],
)  # fmt: skip
def test_target_matching_is_peft_s(fields):
    from peft import LoraConfig
    from peft.tuners.tuners_utils import check_target_module_exists

    ours = parse_adapter_config({"r": 4, **fields})
    theirs = LoraConfig(r=4, **fields)
    for name in MODULE_NAMES:
        assert ours.targets(name) == bool(check_target_module_exists(theirs, name)), name


def test_rank_and_alpha_patterns_are_peft_s():
    from peft.utils.other import get_pattern_key

    ranks = {r"layers\.1\..*": 3, "q_proj": 2, "model.layers.0.mlp.down_proj": 6}
    alphas = {"c_attn": 5.0, r"h\.1[0-9]\.mlp\.c_proj": 7.0}
    ours = parse_adapter_config(
        {"r": 4, "lora_alpha": 8, "target_modules": ["x"], "rank_pattern": ranks,
         "alpha_pattern": alphas}
    )  # fmt: skip
    for name in MODULE_NAMES:
        rank = ranks.get(get_pattern_key(ranks.keys(), name), 4)
        alpha = alphas.get(get_pattern_key(alphas.keys(), name), 8)
        assert ours.rank(name) == rank, name
        assert ours.scaling(name) == pytest.approx(alpha / rank), name
