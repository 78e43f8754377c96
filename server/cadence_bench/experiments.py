"""`cadence bench experiment E1|E2|E3|E4|E6`: launch cadence in each configuration an
experiment needs (docs/experiments/README.md says what each measures), run its workload,
write `docs/experiments/<E>.md` (the command, the table, a summary computed from the
numbers, the router's step trace) and PNG plots beside it.

E1-E4 and E6 record each configuration's measurement under `<out-dir>/records/<E>/` as
it is measured and render the report from the records, so a long run resumes where it
stopped (`exp_runner`, `exp_records`); one module per experiment (`e1_batching`,
`e2_variance`, `e3_batch_size`, `e4_kv`, `speculative_experiment`). `--scale full` is the
documents' sizes, run on this CPU (hours); `--scale small` divides lengths and counts so
each experiment runs in minutes.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from cadence_bench.exp_records import RecordStore
from cadence_bench.exp_report import cpu_class, cpus
from cadence_bench.exp_runner import SCALES, Context, Scale

__all__ = ["SCALES", "Scale", "run_experiment"]

# The names the LoRA experiment (its own module) imports from here.
_cpu_class = cpu_class
_cpus = cpus


def _recorded(name: str) -> Callable[..., None]:
    """The module running experiment `name` over records (imported when it runs)."""
    if name == "E1":
        from cadence_bench.e1_batching import run
    elif name == "E2":
        from cadence_bench.e2_variance import run
    elif name == "E3":
        from cadence_bench.e3_batch_size import run
    elif name == "E6":
        from cadence_bench.speculative_experiment import run
    else:
        from cadence_bench.e4_kv import run
    return run


def run_experiment(
    name: str,
    scale: str,
    out_dir: str,
    server_args: list[str],
    divisor: int | None = None,
    num_prompts: int | None = None,
    only: tuple[str, ...] = (),
    fresh: bool = False,
    report_only: bool = False,
    none_prompts: int | None = None,
) -> None:
    if name not in ("E1", "E2", "E3", "E4", "E6"):
        raise SystemExit(f"{name} is not implemented; see docs/experiments")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    base = SCALES[scale]
    chosen = Scale(divisor or base.div, num_prompts or base.num_prompts, base.rates)
    label = scale
    if divisor:
        label += f" --length-divisor {divisor}"
    if num_prompts:
        label += f" --num-prompts {num_prompts}"
    store = RecordStore(out, name, tuple(only), fresh)
    ctx = Context(name, chosen, label, out, server_args, store, report_only)
    with ctx.servers:
        if name == "E1" and none_prompts is not None:
            from cadence_bench.e1_batching import run as run_e1

            run_e1(ctx, none_prompts)
        else:
            _recorded(name)(ctx)
    print(f"wrote {out / (name + '.md')}")
