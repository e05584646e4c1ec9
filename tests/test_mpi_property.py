"""The MPI start-up as a property (issue 25): whatever one rank gets differently from the others (a seed, a
length, a prompt, a model file, a missing file, a bad flag), the job ends with one line, printed once by
rank 0, naming that rank; ranks given the same input run.

Each example is one ``mpiexec -n 2`` or ``-n 3`` run of ``minikv generate --tp N`` on a tiny GGUF model
(about 3 s each on a 2-core machine): ``EXAMPLES`` of them per run of the suite.
"""

from __future__ import annotations

import string

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.test_cli_reliability import tiny_gguf  # noqa: F401  (the fixture)
from tests.test_mpi_start import errors, generate, run_ranks

EXAMPLES = 8
ARGUMENTS = ("--seed", "--max-new-tokens", "--prompt")
BAD_FLAGS = [("--top-k", "nope"), ("--temperature", "nan"), ("--max-new-tokens", "-1"), ("--block-size", "0"),
             ("--cache", "bogus")]


@pytest.fixture(scope="module")
def other_gguf(tmp_path_factory) -> str:
    """tiny_gguf's shapes and name with other weights: only the model checksum tells them apart."""
    from minikv.weights.random_models import random_model
    from tests.test_gguf import TINY_TOKENS, write_tiny_gguf

    path = tmp_path_factory.mktemp("other") / "tiny.gguf"
    write_tiny_gguf(path, random_model(num_layers=2, hidden_size=16, num_heads=4, num_kv_heads=2, head_dim=4,
                                       intermediate_size=12, vocab_size=len(TINY_TOKENS), max_position=64, seed=2))
    return str(path)


@st.composite
def worlds(draw):
    """(world size, the odd rank, what it gets differently: None, (flag, value), "model", "missing" or
    ("bad", flag, value))."""
    size = draw(st.sampled_from([2, 3]), label="ranks")
    odd = draw(st.integers(0, size - 1), label="odd rank")
    kind = draw(st.sampled_from(["same", "argument", "model", "missing", "bad"]), label="kind")
    if kind == "argument":
        flag = draw(st.sampled_from(ARGUMENTS))
        value = {"--seed": st.integers(1, 10**9).map(str),  # the default is 0
                 "--max-new-tokens": st.sampled_from(["1", "2", "4"]),  # the others ask 3
                 "--prompt": st.text(string.ascii_letters + " ", min_size=1, max_size=6).filter(
                     lambda p: p != "hello")}[flag]
        return size, odd, (flag, draw(value, label="value"))
    if kind == "bad":
        return size, odd, ("bad", *draw(st.sampled_from(BAD_FLAGS), label="bad flag"))
    return size, odd, None if kind == "same" else kind


def argv_of(model: str, size: int, change=None, other: str = "", absent: str = "") -> list[str]:
    argv = generate({"model": other, "missing": absent}.get(change, model) if isinstance(change, str) else model)
    argv[argv.index("--tp") + 1] = str(size)
    if isinstance(change, tuple):
        flag, value = change[-2:]
        if flag in argv:
            argv[argv.index(flag) + 1] = value
        else:
            argv += [flag, value]
    return argv


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(world=worlds())
def test_one_rank_with_other_input_is_named_once_by_rank_0(world, tiny_gguf, other_gguf, tmp_path_factory):  # noqa: F811
    size, odd, change = world
    absent = str(tmp_path_factory.getbasetemp() / "absent.gguf")
    per_rank = [[argv_of(tiny_gguf, size, change if r == odd else None, other_gguf, absent), 0] for r in range(size)]
    r = run_ranks(per_rank)
    lines = errors(r.stderr)
    if change is None:
        assert r.returncode == 0 and lines == [], r.stderr[-2000:]
        assert r.stdout.startswith("hello")
        return
    assert r.returncode == 2, r.stderr[-2000:]
    (line,) = lines  # once, by rank 0: the other ranks stay silent
    # a rank that differs from rank 0 is named; if rank 0 is the odd one, every other rank differs from it
    differ = ", ".join(str(k) for k in range(1, size)) if odd == 0 else str(odd)
    if change == "model":
        assert f"rank(s) {differ} of {size} run with other model (config or weights) than rank 0" in line
    elif change == "missing":
        assert f"rank {odd} of {size} refused" in line and "does not exist" in line
    elif change[0] == "bad":
        assert f"rank {odd} of {size} refused" in line and change[1] in line
    else:
        assert f"rank(s) {differ} of {size} run with other arguments than rank 0" in line
