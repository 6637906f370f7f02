"""The call descriptor: what every rank of one all-reduce launch must agree on, in four int32 words
the kernels exchange (layout.CALL_W_*), and the 32-bit signature the barrier flags carry.

    word 0  rows of this launch (M of the launch: a chunk of the call's rows)
    word 1  H
    word 2  algorithm | dtype << 4 | residual << 5 | norm output << 6 | all-reduce output << 7 |
            gemma << 8 | (form & 7) << 9 | world size << 12 | (form >> 3) << 20 (form: the index
            of the algorithm's form in plan.ALGORITHM_FORMS, 0 = its default: ranks in different
            forms would read rows where their peers never wrote them, so the form is part of what
            they must agree on; its fourth bit, for the reduce-scatter's ninth and tenth forms,
            sits above the world size so that the words of forms 0-7, and the kernels'
            constants, stay as they were)
    word 3  the quantization format (QuantSpec): kind | group size << 4 | swizzled << 12 |
            column-major << 13 | ue8m0 << 14

Words 1-3 are compile-time constants of a kernel, word 0 is its run-time M. The barrier algorithms
compare the signature ``(rows * SIGNATURE_MULTIPLIER) ^ constant`` (32-bit; plus the grid size
times GRID_MULTIPLIER) that rides in every barrier flag; lamport compares all four words, pushed
beside the rows. On a mismatch the host reads every rank's last descriptor (layout.CALL_W_LAST) and
names the fields that differ.
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass, fields
from typing import Optional, Sequence

from distnorm.formats import FORMATS, QuantSpec, kernel_spec

__all__ = ["CallDescriptor", "GRID_MULTIPLIER", "SIGNATURE_MULTIPLIER", "signature"]

SIGNATURE_MULTIPLIER = 0x2545F491  # odd: rows -> rows * K is a bijection mod 2^32
# The barrier kernels add grid size * GRID_MULTIPLIER (odd) to the signature their flags carry, so
# ranks that launched other grids mismatch at once (kernels/allreduce.py, _describe_launch).
GRID_MULTIPLIER = 0x3C6EF35F
_DTYPES = ("bfloat16", "float16")
_KINDS = tuple(FORMATS)


def _algos() -> tuple:
    from distnorm.collectives.plan import ALGORITHMS
    return tuple(ALGORITHMS)


def _forms(algo: str) -> tuple:
    from distnorm.collectives.plan import ALGORITHM_FORMS, knob
    return ALGORITHM_FORMS.get(knob(algo), ("",))


@dataclass(frozen=True)
class CallDescriptor:
    """One launch as the kernels describe it (see the module docstring)."""

    rows: int
    hidden: int
    algo: str
    dtype: str
    quant: QuantSpec
    residual: bool
    norm_out: bool
    allreduce_out: bool
    gemma: bool
    world: int
    form: str = ""  # "" = the algorithm's default form

    def __post_init__(self) -> None:
        if not self.form:
            object.__setattr__(self, "form", _forms(self.algo)[0])

    def words(self) -> tuple[int, int, int, int]:
        form = _forms(self.algo).index(self.form)
        assert form < 16, (self.algo, self.form)  # four bits
        flags = (_algos().index(self.algo) | _DTYPES.index(self.dtype) << 4 | self.residual << 5
                 | self.norm_out << 6 | self.allreduce_out << 7 | self.gemma << 8
                 | (form & 7) << 9 | self.world << 12 | (form >> 3) << 20)
        q = kernel_spec(self.quant)
        qword = (_KINDS.index(q.kind) | q.group_size << 4 | q.swizzled << 12 | q.col_major << 13
                 | q.scale_ue8m0 << 14)
        return self.rows, self.hidden, flags, qword

    @classmethod
    def from_words(cls, words: Sequence[int]) -> Optional["CallDescriptor"]:
        """The descriptor the words hold, or None when they hold none (zeros, sentinel, garbage)."""
        rows, hidden, flags, qword = (int(w) & 0xFFFFFFFF for w in words)
        algos = _algos()
        try:
            kind = _KINDS[qword & 0xF]
            group = (qword >> 4) & 0xFF
            quant = QuantSpec(kind, group, "swizzled" if qword >> 12 & 1 else "linear",
                              "col" if qword >> 13 & 1 else "row", bool(qword >> 14 & 1))
            algo = algos[flags & 0xF]
            form = (flags >> 9 & 0x7) | (flags >> 20 & 1) << 3
            return cls(rows, hidden, algo, _DTYPES[flags >> 4 & 1],
                       quant, bool(flags >> 5 & 1), bool(flags >> 6 & 1), bool(flags >> 7 & 1),
                       bool(flags >> 8 & 1), flags >> 12 & 0xFF, _forms(algo)[form])
        except IndexError:
            return None

    def signature(self) -> int:
        return signature(self.rows, signature_constant(self.words()))

    def differences(self, other: "CallDescriptor") -> list[str]:
        """'field: mine vs theirs' for every field that differs."""
        out = []
        for f in fields(self):
            a, b = getattr(self, f.name), getattr(other, f.name)
            if a != b:
                if f.name == "quant":
                    a, b = _quant_name(a), _quant_name(b)
                out.append(f"{f.name}: {a} vs {b}")
        return out

    def __str__(self) -> str:
        outs = [n for n in ("residual", "norm_out", "allreduce_out", "gemma") if getattr(self, n)]
        form = f" form={self.form}" if self.form else ""
        return (f"M={self.rows} H={self.hidden} {self.dtype} {_quant_name(self.quant)} "
                f"algo={self.algo}{form} world={self.world}" + (f" [{', '.join(outs)}]" if outs else ""))


def _quant_name(q: QuantSpec) -> str:
    if q.kind == "none":
        return "quant=None"
    extra = [f"group_size={q.group_size}"] if q.grouped else []
    if q.block_scaled:
        extra.append(q.sf_layout)
    if q.col_major:
        extra.append("col-major")
    if q.scale_ue8m0:
        extra.append("ue8m0")
    return q.kind + (f"({', '.join(extra)})" if extra else "")


def signature_constant(words: Sequence[int]) -> int:
    """The compile-time half of the signature: a 32-bit hash of words 1-3 (as a signed int32)."""
    c = zlib.crc32(b"".join(int(w).to_bytes(4, "little", signed=False) for w in words[1:]))
    return c - (1 << 32) if c >= 1 << 31 else c


def signature(rows: int, constant: int) -> int:
    """(rows * SIGNATURE_MULTIPLIER) ^ constant as a signed int32, as the kernels compute it."""
    v = ((rows * SIGNATURE_MULTIPLIER) & 0xFFFFFFFF) ^ (constant & 0xFFFFFFFF)
    return v - (1 << 32) if v >= 1 << 31 else v
