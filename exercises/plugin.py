"""pytest plugin: swap an exercise's functions into its lesson before the tests are collected.

Loaded with ``-p exercises.plugin``; does nothing unless ``MINIKV_EXERCISE`` names an exercise.
``MINIKV_EXERCISE_USE=reference`` plugs in the lesson's own functions (each wrapped in a new
function, so the swap itself is exercised) instead of the stub's.

How the swap works: a target ``module:attr`` is replaced in its lesson module and in every imported
``minikv`` module that holds the same object under any name (``from minikv.textbook.s3_paged import
slot_mapping`` copies the name); a target ``module:Class.method`` is set on the class. The lessons
look their functions up when they run, and ``tests/test_textbook.py`` calls them through their
module (``s3.slot_mapping``), so the tests and the lesson code they drive call yours.
"""

from __future__ import annotations

import functools
import importlib
import os
import sys

from exercises import EXERCISES
from minikv.textbook import LESSONS


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
        if mod is None or not name.startswith("minikv"):
            continue
        for key, value in list(vars(mod).items()):
            if value is old:
                setattr(mod, key, new)


def reference_of(target: str):
    """The lesson's function in a fresh wrapper (a different object, so ``swap`` really swaps)."""
    fn = resolve(target)[2]

    @functools.wraps(fn)
    def reference(*args, **kwargs):
        return fn(*args, **kwargs)

    return reference


def install(name: str, use: str = "stub") -> None:
    """Swap exercise ``name``'s functions into its lesson: the stub's (``use="stub"``) or the lesson's own."""
    ex = EXERCISES[name]
    for lesson in LESSONS:  # imported before the swap, so that every copy of a name is found
        importlib.import_module(f"minikv.textbook.{lesson}")
    stub = importlib.import_module(f"exercises.{ex.stub}")
    new = {fn: (getattr(stub, fn) if use == "stub" else reference_of(target)) for fn, target in ex.targets}
    for fn, target in ex.targets:
        swap(target, new[fn])


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
        return f"exercise {name}: {os.environ.get('MINIKV_EXERCISE_USE', 'stub')} functions swapped into the lesson"
