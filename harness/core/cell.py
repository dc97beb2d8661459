"""A cell's identity: the settings that make one measurement, printed as its id and its test
label and parsed back from an id, in this one place (a planned cell, a measurement record and
a comparison of two runs all use it)."""

from __future__ import annotations

import re
from dataclasses import dataclass, fields, replace

_FLASH = {None: "auto", True: "on", False: "off"}
# The levers at their defaults add nothing to an id: (field, id prefix, default).
_LEVERS = (("depth", "d", 0), ("kv_type", "kv-", "f16"), ("parallel", "np", 1),
           ("shared_prefix", "px", 0))
_PART = re.compile(r"(tg|ub|fa-|ctx|pp|kv-|np|px|t|b|d)(.+)")  # longest first


@dataclass(frozen=True)
class CellId:
    """model|dtype|t THREADS|b BATCH|ub UBATCH|fa-FLASH|ctx N_CTX|pp PROMPT|tg GEN[|levers]."""

    model: str
    dtype: str
    threads: int
    n_batch: int | None
    n_ubatch: int | None
    flash_attn: bool | None
    n_ctx: int | None  # None: an id recorded before contexts were sized per cell
    n_prompt: int
    n_gen: int
    depth: int = 0
    kv_type: str = "f16"
    parallel: int = 1
    shared_prefix: int = 0

    def __str__(self) -> str:
        parts = [self.model, self.dtype, f"t{self.threads}", f"b{self.n_batch}",
                 f"ub{self.n_ubatch}", f"fa-{_FLASH[self.flash_attn]}"]
        parts += [f"ctx{self.n_ctx}"] if self.n_ctx is not None else []
        parts += [f"pp{self.n_prompt}", f"tg{self.n_gen}"]
        return "|".join(parts + [f"{prefix}{getattr(self, name)}" for name, prefix, default
                                 in _LEVERS if getattr(self, name) != default])

    @classmethod
    def parse(cls, text: str) -> CellId:
        """The cell an id names (ValueError for a string that is not one)."""
        model, dtype, *rest = text.split("|")
        found = {}
        for part in rest:
            m = _PART.fullmatch(part)
            if not m:
                raise ValueError(f"not a cell id: {text!r}")
            found[m.group(1)] = m.group(2)
        flash = {v: k for k, v in _FLASH.items()}
        return cls(model, dtype, int(found["t"]), _int(found.get("b")), _int(found.get("ub")),
                   flash[found.get("fa-", "auto")], _int(found.get("ctx")), int(found["pp"]),
                   int(found["tg"]), int(found.get("d", 0)), found.get("kv-", "f16"),
                   int(found.get("np", 1)), int(found.get("px", 0)))

    @classmethod
    def of(cls, cell) -> CellId:
        """The identity of anything holding these settings by name (a measurement record)."""
        return cls(**{f.name: getattr(cell, f.name) for f in fields(cls)})

    def without_context(self) -> CellId:
        """The same cell at any context (the context follows the other settings)."""
        return replace(self, n_ctx=None)

    @property
    def test(self) -> str:
        """pp512 (prefill only), tg64 (decode from empty), pp16+tg64, then the levers:
        tg32@d2048 (at a depth), kv=q8_0, x8 (8 sequences), px2048+pp32 (after a prefix)."""
        if self.n_gen == 0:
            label = f"pp{self.n_prompt}"
        elif self.n_prompt == 0:
            label = f"tg{self.n_gen}"
        else:
            label = f"pp{self.n_prompt}+tg{self.n_gen}"
        if self.shared_prefix:
            label = f"px{self.shared_prefix}+{label}"
        if self.depth:
            label += f"@d{self.depth}"
        if self.parallel > 1:
            label += f" x{self.parallel}"
        if self.kv_type != "f16":
            label += f" kv={self.kv_type}"
        return label


def _int(text: str | None) -> int | None:
    return None if text is None or text == "None" else int(text)
