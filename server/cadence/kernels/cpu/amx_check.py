"""`python -m cadence.kernels.cpu.amx_check`: whether the AMX-INT8 product of quantized
weights (`torch.ops.cadence.quant_matmul_tiles` with tiles 1, `quant_amx.h`) runs on this
machine and gives the VNNI product's bits (`quant_matmul` of the same avx512_bf16
kernels), whether attention over an int8 KV cache on AMX-INT8 tiles
(`use_attention_tiles`, attention_int8_amx.h) gives the vector kernel's bits, and, where
the CPU has AMX-BF16, whether the bfloat16 product on its tiles (`bf16_matmul_tiles`,
bf16_kernels.cpp) is within rounding of float32's and gives a row the same bits whatever
the other rows. It runs in a process of its own because a CPU, kernel
or hypervisor that mishandles AMX kills the process (SIGILL) rather than raising: exit 0
and one line when every case matches, 1 and the reason otherwise.

`usable()` runs it as a subprocess, for the launcher to decide on AMX before any shard
starts (what it computes with stays out of the launcher's process; importing this module
still imports its package's torch). The kernels should be built beforehand (`python -m
cadence.kernels.cpu`): a build inside the check counts against its timeout.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from typing import TYPE_CHECKING

from cadence import cpu_isa

if TYPE_CHECKING:  # torch is imported where it is used: the launcher imports this module
    import torch

MODULE = "cadence.kernels.cpu.amx_check"
AMX_FLAGS = frozenset({"amx_tile", "amx_int8"})  # /proc/cpuinfo's names
ISA = "avx512_bf16"  # the only kernels with the AMX product
HARDWARE = 1  # quant_matmul_tiles' tiles: the AMX instructions
ROWS = (1, 16, 33)  # one row, one whole tile, two tiles and a padded one


class AmxUnusable(RuntimeError):
    pass


def no_amx_reason() -> str:
    """Why `amx_available()` is False here: the CPU, or else the kernel's permission."""
    if not AMX_FLAGS <= cpu_isa.cpu_flags():
        return "this CPU has no AMX-INT8"
    return "the kernel refused AMX permission"


def check() -> str:
    """Compares the AMX product with the VNNI one on a few weights of each format (40
    output channels: a padded last block of 16) and row counts; the line to report.
    Raises AmxUnusable with the reason when AMX is not usable or a result differs."""
    import torch

    from cadence.kernels import cpu
    from cadence.quant import cpu_gemm
    from cadence.quant.quantize import quantize_int4, quantize_int8, quantize_int8_blocks

    lacking = cpu_isa.missing(ISA)
    if lacking:
        raise AmxUnusable(f"this CPU lacks {', '.join(lacking)} for the {ISA} kernels")
    cpu.select(ISA)
    op = torch.ops.cadence
    if not op.amx_available():
        raise AmxUnusable(no_amx_reason())
    g = torch.Generator().manual_seed(0)
    weights = {
        "int4": quantize_int4(torch.randn(40, 96, generator=g) * 0.1, 32),
        "int8": quantize_int8(torch.randn(40, 100, generator=g) * 0.1),
        "int8 blocks": quantize_int8_blocks(torch.randn(40, 96, generator=g) * 0.1),
    }
    cases = 0
    for name, weight in weights.items():
        w = cpu_gemm.IntegerCpuKernel(weight).weight
        for rows in ROWS:
            for dtype in (torch.float32, torch.bfloat16):
                x = torch.randn(rows, w.in_features, generator=g).to(dtype)
                want = op.quant_matmul(x, w.packed, w.scales, w.out_features, w.fmt)
                got = op.quant_matmul_tiles(x, w.packed, w.scales, w.out_features, w.fmt, HARDWARE)
                if not torch.equal(got, want):
                    off = float((got.float() - want.float()).abs().max())
                    raise AmxUnusable(
                        f"{name}, {rows} rows, {dtype}: the AMX product differs from VNNI's "
                        f"(by up to {off:g})"
                    )
                cases += 1
    line = f"AMX-INT8 product equals VNNI's bit for bit ({cases} cases); {check_attention(g)}"
    if op.amx_bf16_available():
        line += f"; {check_bf16(g)}"
    return line


def check_attention(g: torch.Generator) -> str:
    """Attention over a random int8 cache on the AMX-INT8 tiles against the vector kernel:
    decode rows of several lengths and a prompt's tokens (one block table, consecutive
    rows), bit for bit. Raises AmxUnusable where a result differs."""
    import torch

    from cadence.kernels import cpu

    op = torch.ops.cadence
    heads, kv_heads, dim, block = 9, 3, 64, 16
    blocks = 64
    k = torch.randint(-127, 128, (blocks, block, kv_heads, dim), dtype=torch.int8, generator=g)
    v = torch.randint(-127, 128, (blocks, block, kv_heads, dim), dtype=torch.int8, generator=g)
    k_scale = torch.rand(blocks, block, kv_heads, generator=g) * 0.04 + 0.01
    v_scale = torch.rand(blocks, block, kv_heads, generator=g) * 0.04 + 0.01
    order = torch.randperm(blocks, generator=g)[:20]
    cases = (  # (tables, context lengths): decode rows, then a prompt of 40 tokens
        (order.view(4, 5), torch.tensor([1, 17, 64, 80])),
        (order[:3].repeat(40, 1), torch.arange(1, 41)),
    )
    for tables, lens in cases:
        q = torch.randn(len(lens), heads, dim, generator=g).to(torch.bfloat16)
        outs = []
        for tiles in (0, HARDWARE):
            op.use_attention_tiles(tiles, 1)
            try:
                outs.append(
                    cpu.paged_decode_attention(
                        q, k, v, tables, lens, dim**-0.5, None, k_scale=k_scale, v_scale=v_scale
                    )
                )
            finally:
                op.use_attention_tiles(0, 1)
        if not torch.equal(outs[0], outs[1]):
            raise AmxUnusable(
                f"attention over an int8 cache ({len(lens)} rows): the AMX-INT8 tiles differ "
                "from the vector kernel"
            )
    return f"int8 attention on AMX-INT8 tiles equals the vector kernel's ({len(cases)} cases)"


def check_bf16(g: torch.Generator) -> str:
    """The AMX-BF16 product against float32's on a few weights and row counts: within a
    bfloat16 rounding of the result and float32's rounding of the sums, and every row's
    bits those it has alone. Raises AmxUnusable where either fails."""
    import torch

    from cadence.layers.packed import HARDWARE_TILES, amx_bf16_packing

    op = torch.ops.cadence
    cases = 0
    for out_features, in_features in ((40, 96), (40, 100), (300, 576)):
        w = torch.randn(out_features, in_features, generator=g).to(torch.bfloat16)
        packed = amx_bf16_packing(w)
        x = torch.randn(max(ROWS), in_features, generator=g).to(torch.bfloat16)
        whole = op.bf16_matmul_tiles(x, packed, None, out_features, HARDWARE_TILES)
        want = x.float() @ w.float().T
        bound = want.abs() / 128 + (x.float().abs() @ w.float().abs().T) * 1e-5
        if not bool(((whole.float() - want).abs() <= bound).all()):
            off = float((whole.float() - want).abs().max())
            raise AmxUnusable(
                f"{out_features} x {in_features} bfloat16: the AMX-BF16 product is off "
                f"float32's by up to {off:g}"
            )
        for rows in ROWS:
            got = op.bf16_matmul_tiles(x[:rows], packed, None, out_features, HARDWARE_TILES)
            if not torch.equal(got, whole[:rows]):
                raise AmxUnusable(
                    f"{out_features} x {in_features} bfloat16: a row's AMX-BF16 product "
                    f"changes between {rows} and {max(ROWS)} rows"
                )
            cases += 1
    return f"AMX-BF16 product within rounding of float32's, rows alike at any count ({cases} cases)"


def main() -> int:
    try:
        print(check())
    except Exception as e:  # whatever fails, AMX is not to be used: say why
        print(f"AMX-INT8 is not usable: {e}")
        return 1
    return 0


def usable(timeout_s: float = 60) -> tuple[bool, str]:
    """(True, the check's line) when the AMX product runs here and matches the VNNI one,
    else (False, why). Spawns no process where /proc/cpuinfo lacks AMX-INT8."""
    if not AMX_FLAGS <= cpu_isa.cpu_flags():
        return False, "this CPU has no AMX-INT8 (/proc/cpuinfo lacks amx_tile or amx_int8)"
    try:
        done = subprocess.run(
            [sys.executable, "-m", MODULE], capture_output=True, text=True, timeout=timeout_s
        )
    except subprocess.TimeoutExpired:
        return False, f"the AMX self-test did not finish in {timeout_s:g} s"
    lines = (done.stdout + done.stderr).strip().splitlines()
    last = lines[-1] if lines else ""
    if done.returncode == 0:
        return True, last
    if done.returncode < 0:  # killed by a signal: SIGILL where AMX faults
        try:
            name = signal.Signals(-done.returncode).name
        except ValueError:
            name = f"signal {-done.returncode}"
        return False, f"the AMX self-test was killed by {name}" + (f" ({last})" if last else "")
    return False, last or f"the AMX self-test exited with status {done.returncode}"


if __name__ == "__main__":
    sys.exit(main())
