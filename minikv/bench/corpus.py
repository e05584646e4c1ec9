"""A fixed English text for timings and for perplexity / KL measurements, with no download.

The Python standard library ships its reference manual's topics in
``pydoc_data/topics.py``. We use one chapter, "Special method names"
(``topics["specialnames"]``, about 62 000 characters of prose and short code
examples), from its start. Its wording can change between Python versions, so
results record the Python version next to their numbers.
"""

from __future__ import annotations

from minikv.errors import InvalidInputError

TOPIC = "specialnames"


def reference_text() -> str:
    """The whole chapter (str)."""
    from pydoc_data.topics import topics

    return topics[TOPIC]


def reference_tokens(tokenizer, n: int) -> list[int]:
    """The first ``n`` token ids of the chapter, encoded with ``tokenizer``."""
    ids = tokenizer.encode(reference_text())
    if not 0 < n <= len(ids):
        raise InvalidInputError(f"n={n}: the reference text has {len(ids)} tokens; ask for 1..{len(ids)}")
    return ids[:n]
