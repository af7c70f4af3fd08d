"""ProgramKind: a step program's kind keeps the letter reports and commands have always
carried ("T", "R", "S", and "M" for K decode steps per dispatch): in compile status ("T=4"), in
JSON and through pickling."""

from __future__ import annotations

import json
import pickle

from multiserve.engine.device.programs import KINDS, ProgramKind, ProgramSet, needs


def test_each_kind_round_trips_through_its_letter() -> None:
    assert [k.value for k in KINDS] == ["T", "R", "S", "M"]
    assert (ProgramKind.FORWARD, ProgramKind.HEAD, ProgramKind.FUSED,
            ProgramKind.DECODE_STEPS) == KINDS
    for kind in KINDS:
        assert ProgramKind(f"{kind}") is kind and ProgramKind(str(kind)) is kind
        assert json.loads(json.dumps([kind, 4])) == [kind.value, 4]
        assert pickle.loads(pickle.dumps(kind)) is kind
        assert {kind.value: 1}[kind] == 1  # looked up by its letter, and the letter by it
    assert needs(ProgramKind.FUSED, 8) == (("T", 8), ("R", 8))
    assert needs(ProgramKind.DECODE_STEPS, 8) == (("T", 8), ("R", 8))
    assert needs(ProgramKind.FORWARD, 8) == ()


def test_compile_status_names_programs_by_letter() -> None:
    primed: list[tuple[ProgramKind, int]] = []

    def prime(kind: ProgramKind, size: int, program: object) -> bool:
        primed.append((kind, size))
        return kind != ProgramKind.FUSED or size != 4  # the fused step of 4 is rejected

    programs = ProgramSet(lambda kind, size: (lambda *args: (kind, size)), prime)
    planned = [(ProgramKind.FORWARD, 1), (ProgramKind.HEAD, 1), (ProgramKind.FUSED, 1),
               (ProgramKind.FORWARD, 4), (ProgramKind.HEAD, 4), (ProgramKind.FUSED, 4)]
    programs.compile_first(planned, threads=1)
    programs.compile_rest([], threads=1)
    status = programs.status()
    assert status.compiled == ["T=1", "T=4", "R=1", "R=4", "S=1"]
    assert status.rejected == ["S=4"] and status.pending == []
    assert primed == planned and programs.ready("S") == (1,)
    program = programs.get("T", 4)
    assert program is not None and program() == ("T", 4)
