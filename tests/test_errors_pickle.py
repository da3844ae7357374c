"""Every tangram error survives pickling, as Dask sends a task's error from a worker to the client.

Pickled as ``Exception`` does it, an error is rebuilt by calling its class with
its ``args`` (the message); the classes whose ``__init__`` takes their parts
(``SpecError(field, value, problem)``, a load given up on) failed there. This
distributed installs tblib's reducer for each error before it pickles it, so
through Dask the client got the right class anyway (helper-47 checked nine
cases); plain pickling, and a Dask that does not, did not. So the round trip here
uses each class's own reduction (``_own_pickle``), and the live test checks the
path end to end (it passes either way).
"""

from __future__ import annotations

import io
import pickle

import pytest
from distributed import Client, LocalCluster

from tangram_dask import errors
from tangram_dask.models.residency import LoadGivenUp


def _all(cls: type) -> list[type]:
    out = [cls]
    for sub in cls.__subclasses__():
        out += _all(sub)
    return out


SAMPLES = {
    errors.SpecError: lambda: errors.SpecError("units", (0, 2), "min must be >= 1"),
    errors.FileFormatError: lambda: errors.FileFormatError("w.yaml", "kinds.x.weight", "must be > 0"),
    errors.ConfigError: lambda: errors.ConfigError("tangram.worker.slots", -1, "must be >= 0"),
    LoadGivenUp: lambda: LoadGivenUp(3, 7_000_000, "the loader of model 'rm' did not return within 5 s"),
}


def _sample(cls: type) -> BaseException:
    return SAMPLES[cls]() if cls in SAMPLES else cls(f"a {cls.__name__}")


def _own_pickle(obj: object) -> bytes:
    """``pickle.dumps`` by the class's own reduction, not by the reducers tblib (which distributed imports) may have
    registered in copyreg for it."""
    buf = io.BytesIO()
    p = pickle.Pickler(buf)
    p.dispatch_table = {}
    p.dump(obj)
    return buf.getvalue()


@pytest.mark.parametrize("cls", _all(errors.TangramError), ids=lambda c: c.__name__)
def test_every_error_is_the_same_after_pickling(cls):
    e = _sample(cls)
    back = pickle.loads(_own_pickle(e))
    assert type(back) is cls and str(back) == str(e) and back.args == e.args and vars(back) == vars(e)


def test_the_classes_sampled_are_all_of_them():
    assert LoadGivenUp in _all(errors.TangramError)  # (imported above: the walk sees it)
    assert set(SAMPLES) <= set(_all(errors.TangramError))


def _given_up() -> None:
    raise LoadGivenUp(1, 2_000_000, "the loader of model 'rm' did not return within 5 s on GPUs [0]")


def test_a_load_given_up_on_a_worker_reaches_the_client_as_a_model_error():
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=True, dashboard_address=":0") as cluster, \
            Client(cluster) as client:
        with pytest.raises(errors.ModelError, match="did not return within 5 s") as info:
            client.submit(_given_up, pure=False).result(timeout=60)
        assert type(info.value) is LoadGivenUp and (info.value.hold, info.value.per_gpu) == (1, 2_000_000)
