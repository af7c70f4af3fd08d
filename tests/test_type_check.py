"""The type checker: mypy (the test extra), run as pyproject.toml's [tool.mypy] configures
it, finds no error in multiserve/; and the same command does report errors, among them a
model family that breaks the engine <-> model contract (families/base.py `ModelFamily`).

Cost: a cold run (a new clone: no .mypy_cache) ~14 CPU-s on this 2-core machine, a warm
one ~0.4 CPU-s (the cache in .mypy_cache/, ignored by git)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _mypy(*args: str) -> subprocess.CompletedProcess[str]:
    """`mypy [args]` from the repository root (its configuration: pyproject.toml)."""
    return subprocess.run([sys.executable, "-m", "mypy", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=300)


def test_multiserve_has_no_type_error() -> None:
    run = _mypy()
    assert run.returncode == 0, run.stdout + run.stderr


def test_the_command_reports_type_errors(tmp_path: Path) -> None:
    bad = tmp_path / "bad_types.py"
    bad.write_text(
        "from multiserve.config import EngineConfig\n"
        "from multiserve.model.families.base import ModelFamily\n"
        "from multiserve.model.families.dense import DenseFamily\n"
        "from multiserve.model.invariance.plan import InvariancePlan\n"
        "\n"
        "\n"
        "def pages(cfg: EngineConfig) -> int:\n"
        "    return cfg.page_size + 'one'\n"
        "\n"
        "\n"
        "class Broken(DenseFamily):\n"
        "    def scans(self, plan: InvariancePlan, num_tokens: str) -> bool:\n"
        "        return False\n"
        "\n"
        "\n"
        "family: ModelFamily = Broken()\n")
    run = _mypy(str(bad))
    assert run.returncode == 1, run.stdout + run.stderr
    errors = [line for line in run.stdout.splitlines() if ": error:" in line]
    # the str added to an int; the override that narrows `scans`; and the family it makes
    # no longer a ModelFamily
    assert [line.split(":")[1] for line in errors] == ["8", "12", "16"], run.stdout
    assert "[operator]" in errors[0] and "[override]" in errors[1]
    assert '"Broken"' in errors[2] and '"ModelFamily"' in errors[2]
