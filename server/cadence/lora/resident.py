"""The adapters paged into the KV pool, as tables a step indexes in one operation.

The model's linear layers come in kinds (the same module in every decoder layer:
`model.layers.*.self_attn.qkv_proj`), each kind's layers numbered by their decoder layer.
A resident adapter holds a slot; per kind a table [slots, layers, R] holds each adapter's
A row indices for each layer (padded by repeating its last real row), its ranks [slots,
layers] (0 where it leaves the layer alone), and per output piece (out_offset, out_size)
the same for Bᵀ. A step's tables are then these tables indexed by its adapters' slots.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch
from torch import nn

from cadence.layers.linear import LinearBase
from cadence.lora.pool import PagedAdapter

PieceKey = tuple[int, int]  # (out_offset, out_size) of a layer's output
_LAYER_NUMBER = re.compile(r"\.(\d+)(?=\.)")


@dataclass(frozen=True, slots=True)
class Site:
    kind: str  # the layer's name with its decoder layer number as "*"
    index: int  # its decoder layer number (0 for a layer outside the stack)


def layer_sites(model: nn.Module) -> dict[str, Site]:
    """Every linear layer of the model (qualified name -> kind and index)."""
    sites = {}
    for name, module in model.named_modules():
        if isinstance(module, LinearBase):
            m = _LAYER_NUMBER.search(name)
            if m is None:
                sites[name] = Site(name, 0)
            else:
                sites[name] = Site(name[: m.start(1)] + "*" + name[m.end(1) :], int(m.group(1)))
    return sites


def _fit(t: torch.Tensor, slots: int, cols: int | None = None) -> torch.Tensor:
    """`t` [S, L(, C)] with at least `slots` slots and `cols` columns: new slots zero, new
    columns repeating each row's last (its padding property kept)."""
    if t.shape[0] < slots:
        grown = t.new_zeros(max(slots, 2 * t.shape[0]), *t.shape[1:])
        grown[: t.shape[0]] = t
        t = grown
    if cols is not None and t.shape[2] < cols:
        t = torch.cat([t, t[:, :, -1:].expand(-1, -1, cols - t.shape[2])], dim=2)
    return t


@dataclass(slots=True)
class IndexTable:
    """Row indices [slots, layers, R] and real ranks [slots, layers] of one matrix kind;
    `rank_start` [slots, layers] for a piece (which shrink columns it reads)."""

    rows: torch.Tensor
    ranks: torch.Tensor
    rank_start: torch.Tensor

    @classmethod
    def empty(cls, layers: int, device: torch.device) -> IndexTable:
        zeros = torch.zeros(1, layers, dtype=torch.long, device=device)
        return cls(torch.zeros(1, layers, 1, dtype=torch.long, device=device), zeros, zeros.clone())

    def reserve(self, slots: int, cols: int | None = None) -> None:
        """Room for `slots` slots (rank 0 in the new ones) and `cols` row indices."""
        self.rows = _fit(self.rows, slots, cols)
        self.ranks = _fit(self.ranks, slots)
        self.rank_start = _fit(self.rank_start, slots)

    def put(self, slot: int, layer: int, rows: torch.Tensor, rank_start: int = 0) -> None:
        r = rows.shape[0]
        self.reserve(slot + 1, r)
        rows = rows.to(self.rows.device)
        self.rows[slot, layer, :r] = rows
        self.rows[slot, layer, r:] = rows[-1]
        self.ranks[slot, layer] = r
        self.rank_start[slot, layer] = rank_start

    def forget(self, slot: int) -> None:
        if slot < self.ranks.shape[0]:
            self.ranks[slot] = 0


@dataclass(slots=True)
class KindTable:
    in_features: int
    layers: int
    a: IndexTable
    pieces: dict[PieceKey, IndexTable] = field(default_factory=dict)


class ResidentAdapters:
    """The paged-in adapters by name, with their slots and the per-kind tables."""

    def __init__(self, sites: dict[str, Site], device: torch.device | str = "cpu") -> None:
        self.sites = sites
        self.device = torch.device(device)
        self.layers_of: dict[str, int] = {}
        for site in sites.values():
            self.layers_of[site.kind] = max(self.layers_of.get(site.kind, 0), site.index + 1)
        self.adapters: dict[str, PagedAdapter] = {}
        self.slot_of: dict[str, int] = {}
        self.kinds: dict[str, KindTable] = {}
        self._free: list[int] = []

    def __contains__(self, name: str) -> bool:
        return name in self.adapters

    def add(self, paged: PagedAdapter) -> None:
        if paged.name in self.adapters:
            raise ValueError(f"adapter {paged.name} is already paged in")
        slot = self._free.pop() if self._free else len(self.slot_of)
        for name, layer in paged.layers.items():
            site = self.sites[name]
            table = self.kinds.get(site.kind)
            if table is None:
                layers = self.layers_of[site.kind]
                a = IndexTable.empty(layers, self.device)
                table = self.kinds[site.kind] = KindTable(layer.in_features, layers, a)
            table.a.put(slot, site.index, layer.a_rows)
            for p in layer.pieces:
                key = (p.out_offset, p.out_size)
                piece = table.pieces.get(key)
                if piece is None:
                    piece = table.pieces[key] = IndexTable.empty(table.layers, self.device)
                piece.put(slot, site.index, p.b_rows, p.rank_start)
        self.adapters[paged.name] = paged
        self.slot_of[paged.name] = slot
        for table in self.kinds.values():  # every slot indexes every table
            table.a.reserve(slot + 1)
            for piece in table.pieces.values():
                piece.reserve(slot + 1)

    def remove(self, name: str) -> PagedAdapter:
        paged = self.adapters.pop(name)
        slot = self.slot_of.pop(name)
        for table in self.kinds.values():
            table.a.forget(slot)
            for piece in table.pieces.values():
                piece.forget(slot)
        self._free.append(slot)
        return paged

    def clear(self) -> None:
        self.adapters.clear()
        self.slot_of.clear()
        self.kinds.clear()
        self._free.clear()
