"""What the main job runs: its options (DemoConfig), the format variants that fit H, the inputs and
the keyword arguments of one op call. Pure torch, no GPU needed."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from distnorm.formats import FORMATS, format_variants, hidden_multiple, make_quant_spec

EPS = 1e-6
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
# The float32 [1] argument a format takes (FORMATS[...].scalar). Fixed values that keep the random
# inputs' normed y (|y| < ~8) inside each format's range: y / 0.05 < 448, 200 * 8 / 6 < 448.
SCALAR_VALUES = {"scale": 0.05, "global_scale": 200.0}


@dataclass(frozen=True)
class DemoConfig:
    """The main job's options, after argument checks (picklable: it travels to spawned ranks)."""

    tokens: int = 128
    hidden: int = 4096
    dtype: str = "bf16"
    iters: int = 20
    seed: int = 0

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]


@dataclass(frozen=True)
class Case:
    """One format variant of format_variants(): its name, `quant` and layout options."""

    name: str
    quant: Optional[str]
    options: dict

    @property
    def spec(self):
        return make_quant_spec(self.quant, **self.options)

    @property
    def hidden_multiple(self) -> int:
        """H must be a multiple of this (8, or the format's scale block / group)."""
        return hidden_multiple(self.spec)


def variant_names() -> list:
    return [name for name, _, _ in format_variants()]


def select_cases(names: tuple = ()) -> list:
    """The cases named (all when `names` is empty), in format_variants() order.
    ValueError names the unknown ones."""
    unknown = sorted(set(names) - set(variant_names()))
    if unknown:
        raise ValueError(f"unknown variant(s) {', '.join(unknown)}; choose from "
                         f"{', '.join(variant_names())}")
    return [Case(n, q, o) for n, q, o in format_variants() if not names or n in names]


def split_by_hidden(cases: list, H: int) -> tuple:
    """(cases whose block divides H, the others)."""
    return ([c for c in cases if H % c.hidden_multiple == 0],
            [c for c in cases if H % c.hidden_multiple])


def blocks_text(cases: list) -> str:
    """'name (block), ...': what H must be a multiple of for each case."""
    return ", ".join(f"{c.name} ({c.hidden_multiple})" for c in cases)


def quant_kwargs(case: Case, device) -> dict:
    """Keyword arguments of add_rmsnorm / allreduce_add_rmsnorm (and their references) for `case`:
    quant, its layout options, and the float32 [1] scalar the format needs."""
    kw = {"quant": case.quant, **case.options}
    scalar = FORMATS[case.quant or "none"].scalar
    if scalar:
        kw[scalar] = torch.tensor([SCALAR_VALUES[scalar]], dtype=torch.float32, device=device)
    return kw


def make_inputs(cfg: DemoConfig, case_index: int, device, rank: int = 0) -> tuple:
    """(x, residual, weight) for one case: fresh normal / uniform random values, never zeros.
    x differs per rank; residual and weight are the same on every rank, as in tensor parallelism."""
    M, H, dtype = cfg.tokens, cfg.hidden, cfg.torch_dtype
    shared = torch.Generator(device="cpu").manual_seed(cfg.seed * 1_000_003 + case_index)
    own = torch.Generator(device="cpu").manual_seed(cfg.seed * 1_000_003 + case_index
                                                    + 7919 * (rank + 1))
    x = torch.randn(M, H, generator=own).to(dtype)
    residual = torch.randn(M, H, generator=shared).to(dtype)
    weight = (torch.rand(H, generator=shared) + 0.5).to(dtype)
    return x.to(device), residual.to(device), weight.to(device)
