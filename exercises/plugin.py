"""pytest plugin: swap an exercise's functions into minikv before the tests are collected.

Loaded with ``-p exercises.plugin``; does nothing unless ``MINIKV_EXERCISE`` names an exercise.
``MINIKV_EXERCISE_USE=reference`` plugs in the library's own functions (each wrapped in a new
function, so the swap itself is exercised) instead of the stub's.

How the swap works: a target ``module:attr`` is replaced in its module and in every imported
``minikv``/``minikv_gpu`` module that holds the same object under any name (``from minikv.paged
import slot_mapping`` copies the name); a target ``module:Class.method`` is set on the class. The
test modules are imported after this runs, so their own ``from ... import`` see the learner's function.
One table holds functions outside module namespaces: ``quant_codecs.CODECS["q8_0"]`` is rebuilt.
"""

from __future__ import annotations

import functools
import importlib
import os
import sys

from exercises import EXERCISES

# imported before the swap, so that every module holding a copy of a name is found and patched
# (a chapter package imports all of its modules)
MODULES = ("minikv.attention", "minikv.online_softmax", "minikv.kv_cache", "minikv.paged", "minikv.mla",
           "minikv.quant", "minikv.window", "minikv.model", "minikv.generate")


def resolve(target: str):
    """``"pkg.mod:Class.meth"`` -> (owner object, attribute name, current value)."""
    mod_name, _, path = target.partition(":")
    owner = importlib.import_module(mod_name)
    *outer, attr = path.split(".")
    for part in outer:
        owner = getattr(owner, part)
    return owner, attr, owner.__dict__[attr]


def swap(target: str, new) -> None:
    owner, attr, old = resolve(target)
    setattr(owner, attr, new)
    if isinstance(owner, type):
        return  # a method: every instance and subclass reads it from the class
    for name, mod in list(sys.modules.items()):
        if mod is None or not name.startswith(("minikv", "minikv_gpu")):
            continue
        for key, value in list(vars(mod).items()):
            if value is old:
                setattr(mod, key, new)


def reference_of(target: str):
    """The library's function in a fresh wrapper (a different object, so ``swap`` really swaps)."""
    fn = resolve(target)[2]

    @functools.wraps(fn)
    def reference(*args, **kwargs):
        return fn(*args, **kwargs)

    return reference


def install(name: str, use: str = "stub") -> None:
    """Swap exercise ``name``'s functions into minikv: the stub's (``use="stub"``) or the library's."""
    ex = EXERCISES[name]
    for mod in MODULES:
        importlib.import_module(mod)
    stub = importlib.import_module(f"exercises.{ex.stub}")
    new = {fn: (getattr(stub, fn) if use == "stub" else reference_of(target)) for fn, target in ex.targets}
    for fn, target in ex.targets:
        swap(target, new[fn])
    if name == "q8_0":
        from minikv.quant import codecs as qc
        qc.CODECS["q8_0"] = qc._fixed("q8_0", 2 + qc.QK, new["encode_q8_0"], new["decode_q8_0"])


def pytest_configure(config) -> None:
    name = os.environ.get("MINIKV_EXERCISE")
    if not name:
        return
    if name not in EXERCISES:
        raise SystemExit(f"MINIKV_EXERCISE={name!r}: no such exercise; one of {', '.join(EXERCISES)}")
    install(name, os.environ.get("MINIKV_EXERCISE_USE", "stub"))


def pytest_report_header(config):
    name = os.environ.get("MINIKV_EXERCISE")
    if name:
        return f"exercise {name}: {os.environ.get('MINIKV_EXERCISE_USE', 'stub')} functions swapped into minikv"
