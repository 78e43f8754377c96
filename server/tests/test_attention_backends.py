"""Every attention backend passes the same transformers-equivalence tests: `cpu` (the
C++ kernels, the CPU default, which the rest of the suite runs), `torch` (the fallback
without a compiler) and `triton` (on CPU under the Triton interpreter, on a GPU
compiled); and the switch picks what each device should run."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import test_model
import torch
from cadence.attention_backends.base import Workspace
from cadence.layers.kernel_ops import TORCH_OPS, UsesLayerOps
from cadence.runners import LlamaCpuFlatRunner, ModelRunner
from cadence.shard import backends
from cadence.shard.engine import Engine


def _engine_with_backend(
    backend: str, engine_for: Callable[..., Engine], **config: object
) -> Callable[..., Engine]:
    def make(model_dir: Path, **kwargs: object) -> Engine:
        engine = engine_for(model_dir, attention_backend=backend, **config, **kwargs)
        assert engine.attention_backend.name == backend
        return engine

    return make


@pytest.fixture
def triton_engine_for(engine_for: Callable[..., Engine]) -> Callable[..., Engine]:
    return _engine_with_backend("triton", engine_for)


@pytest.fixture
def torch_engine_for(engine_for: Callable[..., Engine]) -> Callable[..., Engine]:
    return _engine_with_backend("torch", engine_for)


@pytest.mark.parametrize(
    "variant", ["llama_gqa", "llama_9_heads_3_kv", "llama_kv1_odd_vocab", "mistral_window"]
)
def test_torch_backend_prefill_and_decode_match_transformers(
    variant, model_dirs, hf_model, torch_engine_for
):
    test_model.test_prefill_and_ten_decode_steps_match_transformers(
        variant, model_dirs, hf_model, torch_engine_for
    )


def test_torch_backend_mixed_prefill_and_decode_batch(model_dirs, hf_model, torch_engine_for):
    test_model.test_mixed_batch_of_prefills_and_decodes_matches_each_sequence_alone(
        model_dirs, hf_model, torch_engine_for
    )


def test_cpu_backend_is_the_cpu_default(model_dirs, engine_for) -> None:
    engine = engine_for(model_dirs("llama_gqa"))
    assert engine.attention_backend.name == "cpu"
    assert isinstance(engine.runner, LlamaCpuFlatRunner)


@pytest.mark.parametrize(
    "variant", ["llama_gqa", "llama_9_heads_3_kv", "llama_kv1_odd_vocab", "mistral_window"]
)
def test_triton_backend_prefill_and_decode_match_transformers(
    variant, model_dirs, hf_model, triton_engine_for
):
    test_model.test_prefill_and_ten_decode_steps_match_transformers(
        variant, model_dirs, hf_model, triton_engine_for
    )


def test_triton_backend_chunked_prefill(model_dirs, hf_model, triton_engine_for):
    test_model.test_chunked_prefill_in_three_chunks_matches_transformers(
        model_dirs, hf_model, triton_engine_for
    )


def test_triton_backend_mixed_prefill_and_decode_batch(model_dirs, hf_model, triton_engine_for):
    test_model.test_mixed_batch_of_prefills_and_decodes_matches_each_sequence_alone(
        model_dirs, hf_model, triton_engine_for
    )


def test_backend_switch_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu, gpu, ws = torch.device("cpu"), torch.device("cuda"), Workspace()
    on = backends.CpuKernels(True)
    off = backends.CpuKernels(False, "turned off (--no-cpu-kernels)")

    def chosen(requested: str, device: torch.device, kernels: backends.CpuKernels) -> str:
        return backends.attention_backend(requested, device, kernels, ws).name

    assert chosen("auto", cpu, on) == "cpu"  # the C++ kernels build here
    assert chosen("auto", cpu, off) == "torch"
    assert chosen("torch", cpu, on) == "torch"
    assert chosen("torch", gpu, off) == "torch"
    with pytest.raises(ValueError, match="CPU devices only"):
        chosen("cpu", gpu, off)
    with pytest.raises(ValueError, match=r"unavailable: turned off \(--no-cpu-kernels\)"):
        chosen("cpu", cpu, off)
    with pytest.raises(ValueError, match="unknown attention backend"):
        chosen("flash", cpu, on)
    monkeypatch.setattr(backends, "triton_interpreted", False)  # as on a machine without it
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        chosen("triton", cpu, on)


def test_without_cpu_kernels_every_layer_runs_torch(model_dirs, engine_for) -> None:
    engine = engine_for(model_dirs("llama_gqa"), cpu_kernels=False)
    assert engine.attention_backend.name == "torch"
    assert engine.ops is TORCH_OPS
    assert type(engine.runner) is ModelRunner
    assert engine.packed_bytes == 0
    norms = [m for m in engine.model.modules() if isinstance(m, UsesLayerOps)]
    assert norms and all(m.ops is TORCH_OPS for m in norms)


def test_triton_norms_and_rotary_serve_beside_the_triton_backend(model_dirs, hf_model, engine_for):
    """Without the C++ kernels, the triton backend's engine binds Triton's RMSNorm and
    rotary into the model (as on CUDA) and still matches transformers."""
    make = _engine_with_backend("triton", engine_for, cpu_kernels=False)
    engine = make(model_dirs("llama_gqa"))
    assert engine.ops.norms.startswith("triton")
    test_model.test_prefill_and_ten_decode_steps_match_transformers(
        "llama_gqa", model_dirs, hf_model, make
    )


@pytest.mark.parametrize("variant", ["llama_gqa", "llama_9_heads_3_kv", "mistral_window"])
def test_short_chunks_on_the_decode_kernel_match_transformers(
    variant, model_dirs, hf_model, engine_for
):
    """Chunks of at most SHORT_CHUNK tokens after a cached prefix (what a grammar's forced
    tokens make) run every token as a decode query on the cpu backend."""
    from cadence.attention_backends.base import SHORT_CHUNK
    from shard_helpers import MiniRouter
    from test_model import TOL, hf_logits

    path = model_dirs(variant)
    hf, engine = hf_model(path), engine_for(path)
    assert engine.attention_backend.name == "cpu"
    router = MiniRouter(engine)
    prompt = torch.randint(3, 256, (40,), generator=torch.Generator().manual_seed(4)).tolist()
    ref = hf_logits(hf, prompt)
    chunks = [SHORT_CHUNK, 2, 5, SHORT_CHUNK - 1, 40 - 2 * SHORT_CHUNK - 6]
    got = [router.logits_step(joined=[router.join(1, prompt, num_compute=chunks[0])], forced={})]
    for i, n in enumerate(chunks[1:], start=2):
        forced = {1: 7} if i == len(chunks) else {}  # the last chunk samples
        got.append(router.logits_step(continuing=[router.cont(1, n)], forced=forced))
    torch.testing.assert_close(torch.cat([g[1] for g in got]), ref[:40], atol=TOL, rtol=0)


@pytest.mark.parametrize("variant", ["llama_gqa", "mistral_window"])
def test_short_and_long_chunks_in_one_step_match_transformers(
    variant, model_dirs, hf_model, engine_for
):
    """Decodes, short chunks (decode kernel) and long chunks (padded SDPA) in the same
    steps, with and without a cached prefix."""
    from shard_helpers import MiniRouter
    from test_model import TOL, hf_logits

    path = model_dirs(variant)
    hf, engine = hf_model(path), engine_for(path)
    router = MiniRouter(engine)
    g = torch.Generator().manual_seed(5)
    prompts = {
        i: torch.randint(3, 256, (n,), generator=g).tolist() for i, n in [(1, 23), (2, 30), (3, 4)]
    }
    refs = {i: hf_logits(hf, p + [9]) for i, p in prompts.items()}
    got: dict[int, list[torch.Tensor]] = {i: [] for i in prompts}
    # step 1: 1 long from the start, 2 short from the start, 3 whole (short, samples)
    out = router.logits_step(
        joined=[
            router.join(1, prompts[1], num_compute=20),
            router.join(2, prompts[2], num_compute=5),
            router.join(3, prompts[3]),
        ],
        forced={3: 9},
    )
    for i in prompts:
        got[i].append(out[i])
    # step 2: 1 short after its prefix (samples), 2 long after its prefix (samples),
    # 3 decodes
    out = router.logits_step(
        continuing=[router.cont(1, 3), router.cont(2, 25), router.cont(3)],
        forced={1: 9, 2: 9, 3: 9},
    )
    for i in prompts:
        got[i].append(out[i])
    for i, p in prompts.items():
        n = len(p) + (1 if i == 3 else 0)
        torch.testing.assert_close(torch.cat(got[i]), refs[i][:n], atol=TOL, rtol=0)
