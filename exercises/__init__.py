"""Exercises: a lesson's key function with its body removed; write it, then run the lesson's tests on it.

Each exercise is one stub file here (``s6_ring_slot.py``: the lesson function's signature, a
docstring with the rules and a hint, and ``raise NotImplementedError``). ``python -m exercises
ring_slot`` (or ``make exercise EX=ring_slot``) runs that lesson's tests in
``tests/test_textbook.py`` with your function swapped into the lesson module
(``minikv/textbook/``) by the pytest plugin ``exercises.plugin``. The lesson is the reference
solution: ``python -m exercises ring_slot --reference`` runs the same tests with the lesson's own
function plugged in the same way (they pass).

``EXERCISES`` maps a name to its ``Exercise``: where the stub lives, what it replaces, which tests check it.
"""

from __future__ import annotations

from dataclasses import dataclass

LESSON_TESTS = ("tests/test_textbook.py", "-m", "not model")  # the random-model tests: numpy and pytest only


@dataclass(frozen=True)
class Exercise:
    """One exercise.

    stub:    module under ``exercises`` holding the learner's functions
    targets: (function name in ``stub``, "module:attr" or "module:Class.method" of the lesson it replaces)
    tests:   pytest arguments: the lesson's tests that call those functions
    step:    the lesson's step, for the listing
    """

    stub: str
    targets: tuple[tuple[str, str], ...]
    tests: tuple[str, ...]
    step: str


def lesson_tests(keywords: str) -> tuple[str, ...]:
    return (*LESSON_TESTS, "-k", keywords)


EXERCISES: dict[str, Exercise] = {
    "softmax": Exercise(
        "s1_softmax", (("softmax", "minikv.textbook.s1_attention:softmax"),),
        lesson_tests("test_s1_"), "1, attention"),
    "online_softmax_update": Exercise(
        "s2_online_softmax_update", (("online_softmax_update", "minikv.textbook.s2_kv_cache:online_softmax_update"),),
        lesson_tests("test_s2_"), "2, the KV cache"),
    "slot_mapping": Exercise(
        "s3_slot_mapping", (("slot_mapping", "minikv.textbook.s3_paged:slot_mapping"),),
        lesson_tests("test_s3_slot_mapping or test_s3_paged"), "3, paged cache"),
    "allocator_free": Exercise(
        "s3b_allocator_free", (("free", "minikv.textbook.s3b_sharing_batching:SharingAllocator.free"),),
        lesson_tests("test_s3b_"), "3b, sharing and batching"),
    "q8_0": Exercise(
        "s5_q8_0", (("encode_q8_0", "minikv.textbook.s5_quant:encode_q8_0"),
                    ("decode_q8_0", "minikv.textbook.s5_quant:decode_q8_0")),
        lesson_tests("test_s5_"), "5, quantized cache"),
    "ring_slot": Exercise(
        "s6_ring_slot", (("ring_slot", "minikv.textbook.s6_window:ring_slot"),
                         ("visible", "minikv.textbook.s6_window:visible")),
        lesson_tests("test_s6_ and not mutation"), "6, sliding window"),
}
