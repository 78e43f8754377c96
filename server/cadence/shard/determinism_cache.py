"""The start-up check's answers kept per machine (cadence.shard.determinism: the row counts
under which each product kernel gives every row the same bits), in
`<cache dir>/determinism_checks.json`.

The check multiplies random rows, so what it finds depends on the kernel, the product's
shape, the compute threads, the libraries and the machine, never on the weights: a second
launch on the same machine reads it instead of spending the 1-2 s of products it takes
(most of it the LM head's). Whatever could change a kernel's blocking is in the key: the
CPU model and its cores, torch's version (oneDNN comes with it), the C++ kernels' build
id, the variables that hold oneDNN and ATen to an instruction set, the threads, and the
check's own version."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import torch
from loguru import logger

FILE_NAME = "determinism_checks.json"
# Raised whenever the check itself changes (its row counts, splits or windows): answers of
# another check are not this one's.
CHECK_VERSION = 2
# Environment that changes which code oneDNN, ATen or MKL run for a product.
ISA_VARIABLES = (
    "ONEDNN_MAX_CPU_ISA",
    "DNNL_MAX_CPU_ISA",
    "ATEN_CPU_CAPABILITY",
    "MKL_ENABLE_INSTRUCTIONS",
)

Found = tuple[int, int] | None  # (min_rows, max_rows), or None: no range agrees


def machine(isa: str, dtype: torch.dtype) -> str:
    """What an answer holds for: the kernel table's machine key, the threads, the ISA
    variables set and the check's version."""
    from cadence.quant.calibrate import machine_key

    held = ",".join(f"{name}={os.environ[name]}" for name in ISA_VARIABLES if name in os.environ)
    return (
        f"{machine_key(isa, str(dtype).removeprefix('torch.'))}, "
        f"{torch.get_num_threads()} threads, [{held}], check {CHECK_VERSION}"
    )


class CheckCache:
    """This machine's answers in `path`, by product key ("kernel path, columns, outputs");
    new ones are written back by `save`."""

    def __init__(self, path: Path, machine_key: str) -> None:
        self.path, self.machine = path, machine_key
        self.answers: dict[str, Found] = {}
        self.new: dict[str, Found] = {}
        try:
            stored = json.loads(path.read_text()).get(machine_key, {})
            self.answers = {
                k: None if v is None else (int(v[0]), int(v[1])) for k, v in stored.items()
            }
        except FileNotFoundError:
            pass
        except (OSError, ValueError, TypeError, AttributeError, IndexError) as error:
            logger.warning(f"ignoring {path} ({error}): the products are checked anew")

    def get(self, key: str) -> tuple[bool, Found]:
        """(known, the answer) for product `key`."""
        return key in self.answers, self.answers.get(key)

    def put(self, key: str, found: Found) -> None:
        self.answers[key] = self.new[key] = found

    def save(self) -> None:
        """Merges the new answers into the file (other machines' kept), atomically: shards
        starting at once may each write theirs."""
        if not self.new:
            return
        try:
            data = json.loads(self.path.read_text()) if self.path.exists() else {}
        except (OSError, ValueError):
            data = {}
        if not isinstance(data, dict):
            data = {}
        entry = data.setdefault(self.machine, {})
        entry.update({k: None if v is None else list(v) for k, v in self.new.items()})
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile(
                "w", dir=self.path.parent, prefix=".determinism-", delete=False
            ) as out:
                out.write(json.dumps(data, indent=1) + "\n")
            os.replace(out.name, self.path)
        except OSError as error:  # a read-only cache: the next launch checks again
            logger.warning(f"could not keep the determinism check in {self.path}: {error}")


def default_cache(isa: str, dtype: torch.dtype) -> CheckCache:
    from cadence.model_source import cache_dir

    return CheckCache(cache_dir() / FILE_NAME, machine(isa, dtype))
