"""Exercises: write a step's key function yourself, then run that step's own tests against it.

Each exercise is one stub file here (``step6_ring_slot.py``: a docstring and ``raise
NotImplementedError``). ``python -m exercises ring_slot`` (or ``make exercise EX=ring_slot``)
runs a selection of the step's existing tests with your function swapped into minikv by the
pytest plugin ``exercises.plugin``. The library is the reference solution:
``python -m exercises ring_slot --reference`` runs the same tests with the library's own function
plugged in the same way (they pass).

``EXERCISES`` maps a name to its ``Exercise``: where the stub lives, what it replaces, which tests check it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Exercise:
    """One exercise.

    stub:    module under ``exercises`` holding the learner's functions
    targets: (function name in ``stub``, "module:attr" or "module:Class.method" it replaces)
    tests:   pytest arguments: the step's tests that exercise those functions
    """

    stub: str
    targets: tuple[tuple[str, str], ...]
    tests: tuple[str, ...]
    step: str


EXERCISES: dict[str, Exercise] = {
    "softmax": Exercise(
        "step1_softmax", (("softmax", "minikv.attention:softmax"),),
        ("tests/test_attention.py", "-k", "softmax"), "1, no cache"),
    "online_softmax_update": Exercise(
        "step2_online_softmax_update", (("update", "minikv.online_softmax:update"),),
        ("tests/test_online_softmax.py", "-k", "not refused and not assert_close"), "2, contiguous cache"),
    "slot_mapping": Exercise(
        "step3_slot_mapping", (("slot_mapping", "minikv.paged:slot_mapping"),),
        ("tests/test_paged.py", "-k",
         "reads_every_block or fork_then_write or fork_at_a_block or freed_blocks_are_reused"),
        "3, paged cache"),
    "allocator_decref": Exercise(
        "step3_allocator", (("decref", "minikv.paged.allocator:BlockAllocator.decref"),),
        ("tests/test_block_allocator.py", "-k", "bad_calls or ref_counts or freed_registered or manager"),
        "3, paged cache"),
    "q8_0": Exercise(
        "step5_q8_0", (("encode_q8_0", "minikv.quant.codecs:encode_q8_0"),
                       ("decode_q8_0", "minikv.quant.codecs:decode_q8_0")),
        ("tests/test_quant.py", "-k", "q8_0"), "5, quantized cache"),
    "ring_slot": Exercise(
        "step6_ring_slot", (("ring_slot", "minikv.window:WindowPolicy.ring_slot"),
                            ("visible", "minikv.window:WindowPolicy.visible")),
        ("tests/test_window.py", "-k", "ring or (policy_equals and sinks and float64)"), "6, sliding window"),
}
