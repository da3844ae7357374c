"""The result of one sandboxed run: what it printed, what it cost, why it ended."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RunResult:
    """One run of code or a command in a sandbox.

    ``reason`` is one of ``ok`` (exit 0), ``error`` (non-zero exit or an
    uncaught exception), ``timeout`` (wall or CPU time limit), ``memory``
    (memory limit), ``output_limit`` (stdout or stderr over the limit: the run
    was stopped and the stream cut, ``*_truncated`` says which), ``file_limit``
    (a file grew past the limit) or ``killed`` (a signal the sandbox did not
    send, or the sandbox itself died). ``detail`` says more in words.
    ``cpu_mechanism`` is how the granted CPUs were enforced: ``affinity``
    (``sched_setaffinity``) or ``none``.
    """

    reason: str
    exit_code: int | None
    stdout: str
    stderr: str
    wall_s: float
    cpu_s: float
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    signal: int | None = None
    detail: str = ""
    backend: str = ""
    cpus: tuple[int, ...] = ()
    cpu_mechanism: str = "none"
    leftovers_killed: int = 0

    @property
    def ok(self) -> bool:
        return self.reason == "ok"

    @property
    def truncated(self) -> bool:
        return self.stdout_truncated or self.stderr_truncated

    def __repr__(self) -> str:
        cut = " truncated" if self.truncated else ""
        return (f"RunResult(reason={self.reason!r}, exit_code={self.exit_code}, wall_s={self.wall_s:.3f}, "
                f"cpu_s={self.cpu_s:.3f}, backend={self.backend!r}, stdout={len(self.stdout)} chars, "
                f"stderr={len(self.stderr)} chars{cut}, detail={self.detail!r})")
