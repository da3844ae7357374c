"""Every error tangram-dask raises, rooted at one base class.

    TangramError                    base of everything below
    ├── SpecError (ValueError)      an action spec is wrong: the caller's fault
    ├── FileFormatError (ValueError) a workload or cluster file is wrong: the file's fault
    ├── ConfigError (ValueError)    a ``tangram:`` dask config key is unknown or has a bad value
    ├── TrajectoryError (ValueError) ``begin_trajectory`` or ``expect_trajectories`` got a bad argument
    ├── PluginMissingError          actions sent to a scheduler without the tangram plugin
    ├── PlacementError              the scheduler could not place an action (plugin side)
    ├── ModelError                  a reward model could not be registered, loaded or used
    └── SandboxError                a sandbox could not be created or used (worker side)

Each message says what is wrong (field or key, value) and how to fix it.
"""

from __future__ import annotations


def _show(value: object, limit: int = 200) -> str:
    """``repr(value)``, shortened past ``limit`` characters; never raises (a huge int, a broken __repr__)."""
    try:
        r = repr(value)
    except Exception:
        if isinstance(value, int):
            return f"<int of {value.bit_length()} bits>"
        return f"<{type(value).__name__} object>"
    return r if len(r) <= limit else f"{r[:limit - 20]}...{r[-12:]} ({len(r)} chars)"


def _restore(cls: type, args: tuple, state: dict) -> "TangramError":
    """A pickled tangram error, rebuilt without its ``__init__`` (see :meth:`TangramError.__reduce__`)."""
    e = cls.__new__(cls)
    e.args = args
    e.__dict__.update(state)
    return e


class TangramError(Exception):
    """Base class of all tangram-dask errors."""

    def __reduce__(self):
        # Dask pickles a task's error to send it to the client. Pickled as Exception does it, an error is rebuilt
        # by calling its class with its args (the message), and the classes whose __init__ takes their parts
        # (SpecError's field, value, problem; a load given up on) failed there: the client got a plain Exception
        # holding the repr, and `except ModelError` missed a reward call's load that was given up on
        return _restore, (type(self), self.args, dict(self.__dict__))


class SpecError(TangramError, ValueError):
    """An action spec field has a bad value.

    ``field`` names the field, ``value`` is what was given.
    """

    def __init__(self, field: str, value: object, problem: str):
        self.field = field
        self.value = value
        self.problem = problem
        super().__init__(f"action spec field {field!r} = {_show(value)}: {problem}")


class FileFormatError(TangramError, ValueError):
    """A workload or cluster file has an unknown, missing or bad key."""

    def __init__(self, path: str, key: str, problem: str):
        self.path = path
        self.key = key
        self.problem = problem
        super().__init__(f"{path}: {key}: {problem}")


class ConfigError(TangramError, ValueError):
    """A ``tangram:`` dask config key is unknown or has a bad value.

    ``key`` is the dotted path (``tangram.worker.slots``), ``value`` what was given.
    """

    def __init__(self, key: str, value: object, problem: str):
        self.key = key
        self.value = value
        self.problem = problem
        super().__init__(f"{key}: {problem}")


class TrajectoryError(TangramError, ValueError):
    """``begin_trajectory`` or ``expect_trajectories`` got a bad argument (an ``expected_s``, a name, not a
    mapping); the message names it and what was given."""


class PluginMissingError(TangramError):
    """Actions were sent to a scheduler that does not run the tangram scheduler plugin."""


class PlacementError(TangramError):
    """The scheduler plugin could not place an action; the message says why."""


class ModelError(TangramError):
    """A reward model could not be registered, loaded, kept resident or used (tangram_dask.models)."""


class SandboxError(TangramError):
    """A sandbox could not be started, reset or used."""
