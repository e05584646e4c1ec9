"""FLOPs: per layer, per forward pass, per generation, with and without a KV cache.

A multiply-add counts as 2 FLOPs. For one token that attends to ``ctx`` keys
(itself included), one layer costs (H = hidden, Hq/Hkv = query/KV heads,
D = head_dim, I = MLP width)::

    projections    2 H (Hq + 2 Hkv) D  +  2 Hq D H      (q, k, v in; o out)
    scores         2 Hq D ctx                          (q . k for every key)
    weighted V     2 Hq D ctx                          (probabilities x V)
    MLP            2 x 3 H I  (SwiGLU: gate, up, down) or 2 x 2 H I (GELU: up, down)

and the output head adds ``2 H V`` per token whose logits are computed. Norms,
RoPE, softmax and residual adds are O(H) per token and are left out.

Without a cache, producing the token at position t means running the whole
prefix again: t + 1 tokens through every projection and MLP, plus causal
attention of every prefix position over its own prefix. With a cache only the
newest token runs. ``generation_flops`` and ``cache_speedup`` turn that into the
predicted speed-up that the step-2 notebook compares with a measured one.

MLA (step 4) has two ways to attend, and the count follows the one that runs
(``mla_form``, the rule of ``minikv.mla.latent.latent_attention(form="auto")`` and of
serving engines): a decode step (one new token) is *absorbed*, every query head
scoring the cached r + dr wide latent rows; a prefill (more than one new token)
and every pass without a cache is *expanded*, building each head's K and V from
the latent once per token and attending at Dn + dr (scores) and Dv (values) per
head, which is 3.4x fewer attention FLOPs per key for DeepSeek-V3's shapes.
"""

from __future__ import annotations

from minikv.costs.memory import check_count, kv_cache_bytes, weights_bytes
from minikv.costs.shape import ModelShape
from minikv.errors import InvalidInputError, check_int

FLOP_PARTS = ("projections", "scores", "weighted_v", "mlp")
MLA_FORMS = ("auto", "absorbed", "expanded")


def _attended_keys(num_tokens: int, past: int, dense_mask: bool) -> int:
    """Sum over the new tokens of the number of keys each one is scored against.

    Causal: new token i (0-based) sees past + i + 1 keys, so the sum is
    n past + n (n + 1) / 2. ``dense_mask``: an implementation that computes the
    whole n x (past + n) score block and masks it afterwards (like step 1's
    ``causal_attention``) pays for n (past + n) scores.
    """
    n = num_tokens
    return n * (past + n) if dense_mask else n * past + n * (n + 1) // 2


def _layer_rates(s: ModelShape, layer: int) -> dict:
    """FLOPs of one layer per new token (projections, mlp) and per attended key (scores, weighted_v).

    MLA adds the absorbed form's per-key rates (``scores_latent``, ``weighted_v_latent``: keys
    scored as cached latent rows) and ``latent_up``, the 2 Hq r (Dn + Dv) FLOPs of one pass
    through W_UK and W_UV: paid per key row expanded into per-head K and V, or per query that
    attends absorbed (W_UK folded into the query, W_UV applied to the latent result). For MLA
    ``scores`` and ``weighted_v`` are the expanded form's rates; other shapes have no latent.
    """
    h, hq = s.hidden_size, s.num_heads
    latent = {"scores_latent": 0, "weighted_v_latent": 0, "latent_up": 0}
    if s.is_mla:
        r, dr, dn, dv = s.kv_lora_rank, s.rope_dim, s.head_dim, s.v_dim
        if s.q_lora_rank:
            q = 2 * h * s.q_lora_rank + 2 * s.q_lora_rank * hq * (dn + dr)
        else:
            q = 2 * h * hq * (dn + dr)
        proj = q + 2 * h * (r + dr) + 2 * hq * dv * h
        scores, weighted = 2 * hq * (dn + dr), 2 * hq * dv
        latent = {"scores_latent": 2 * hq * (r + dr), "weighted_v_latent": 2 * hq * r,
                  "latent_up": 2 * hq * r * (dn + dv)}
    else:
        d, hkv = s.head_dim, s.num_kv_heads
        proj = 2 * h * (hq + 2 * hkv) * d + 2 * hq * d * h
        scores = weighted = 2 * hq * d
    mats = s.mlp_matrices
    if s.is_moe_layer(layer):
        experts = s.experts_per_token + s.shared_experts
        mlp = experts * 2 * mats * h * s.moe_intermediate_size + 2 * h * s.num_experts
    else:
        mlp = 2 * mats * h * s.intermediate_size
    return {"projections": proj, "scores": scores, "weighted_v": weighted, "mlp": mlp, **latent}


def _model_rates(s: ModelShape) -> dict:
    """``_layer_rates`` summed over all layers."""
    s.need("hidden_size", "num_heads", "intermediate_size", "vocab_size", "head_dim", what="FLOPs")
    total = dict.fromkeys(FLOP_PARTS + ("scores_latent", "weighted_v_latent", "latent_up"), 0)
    for layer, count in s.layer_runs():
        for k, v in _layer_rates(s, layer).items():
            total[k] += v * count
    return total


def _combine(rates: dict, tokens: int, past: int, dense_mask: bool, mla_form: str) -> dict:
    """Rates x counts: projections and MLP scale with tokens, scores and weighted V with keys.

    MLA splits the keys by form (``mla_form``, checked by the caller): "absorbed" scores every
    key as a latent row; "expanded" builds per-head K and V for all past + tokens rows;
    "auto" is absorbed for one new token (a decode step) and otherwise expanded over the
    pass's own tokens and absorbed over the ``past`` cached before it, the rule of
    ``minikv.mla.latent.latent_attention(form="auto")``.
    """
    keys = _attended_keys(tokens, past, dense_mask)
    if not rates["latent_up"]:  # no latent: every key is a per-head K/V key
        latent_keys, built = 0, 0
    elif mla_form == "absorbed" or (mla_form == "auto" and tokens == 1):
        latent_keys, built = keys, 0
    elif mla_form == "expanded":
        latent_keys, built = 0, past + tokens
    else:  # auto prefill: the pass's own tokens expanded, the history before it absorbed
        latent_keys, built = tokens * past, tokens
    absorbing_queries = tokens if latent_keys else 0
    return {"projections": rates["projections"] * tokens + rates["latent_up"] * (built + absorbing_queries),
            "scores": rates["scores"] * (keys - latent_keys) + rates["scores_latent"] * latent_keys,
            "weighted_v": rates["weighted_v"] * (keys - latent_keys) + rates["weighted_v_latent"] * latent_keys,
            "mlp": rates["mlp"] * tokens}


def _check_form(mla_form: str) -> str:
    if mla_form not in MLA_FORMS:
        raise InvalidInputError(f"mla_form={mla_form!r}; use one of {MLA_FORMS}")
    return mla_form


def layer_flops(shape: ModelShape, layer: int = 0, num_tokens: int = 1, past: int = 0,
                dense_mask: bool = False, mla_form: str = "auto") -> dict:
    """FLOPs of one layer for ``num_tokens`` new tokens after ``past`` cached ones.

    Per new token (multiply-add = 2 FLOPs; H hidden, Hq/Hkv heads, D head_dim, I MLP width):

        projections  2 H (Hq + 2 Hkv) D + 2 Hq D H
        scores       2 Hq D x keys        (keys = tokens this token attends to, itself included)
        weighted_v   2 Hq D x keys
        mlp          2 x 3 H I (SwiGLU) or 2 x 2 H I (GELU); MoE: active experts x that + router 2 H E

    Query heads, not KV heads, set the attention cost: GQA shrinks the cache
    and the K/V projections but every query head still scores every key.
    MLA (step 4; r = kv_lora_rank, dr = rope_dim, Dn = head_dim, Dv = v_head_dim)
    counts the form that runs (``mla_form="auto"``):

      * decode (one new token) is **absorbed**: the query
        is mapped into latent space (2 Hq Dn r), scores are dot products with the
        cached latent and RoPE key (2 Hq (r + dr) per key), the probabilities
        weight the latent (2 Hq r per key) and the result goes up to V
        (2 Hq r Dv);
      * a prefill (more than one new token) is **expanded**,
        as real engines prefill: each new token's latent is decompressed into
        per-head K and V once (2 Hq r (Dn + Dv)), scores cost 2 Hq (Dn + dr) and
        weighted V 2 Hq Dv per key, 3.4x fewer attention FLOPs per key than
        absorbed for DeepSeek-V3 (1,088 against 320 multiply-adds per head).
        History cached before a prefill chunk is read absorbed, as
        ``minikv.mla.latent.latent_attention`` does. A pass without a cache
        (``recompute_flops``, ``generation_flops(cache=False)``) is a prefill
        each time and is counted expanded throughout, even for one token, as
        ``minikv.mla.caches.LatentNoCache`` runs it.

    Both add the query path, the down-projection 2 H (r + dr) and the output
    projection 2 Hq Dv H per token. ``mla_form="absorbed"`` or ``"expanded"``
    forces one form for every key (expanded then rebuilds K and V for the
    ``past`` rows too: 2 Hq r (Dn + Dv) each); other shapes ignore it.
    Returns ``{"projections", "scores", "weighted_v", "mlp", "total"}``.
    """
    shape.need("hidden_size", "num_heads", "intermediate_size", "head_dim", what="FLOPs")
    num_tokens = check_count("num_tokens", num_tokens, 1)
    past = check_count("past", past, 0)
    layer = check_int("layer", layer, minimum=0, maximum=shape.num_layers - 1, error=InvalidInputError)
    out = _combine(_layer_rates(shape, layer), num_tokens, past, dense_mask, _check_form(mla_form))
    out["total"] = sum(out.values())
    return out


def _forward(rates: dict, shape: ModelShape, num_tokens: int, past: int, logit_rows: int,
             dense_mask: bool, mla_form: str = "auto") -> dict:
    out = _combine(rates, num_tokens, past, dense_mask, mla_form)
    out["lm_head"] = logit_rows * 2 * shape.hidden_size * shape.vocab_size
    out["total"] = sum(out.values())
    return out


def forward_flops(shape: ModelShape, num_tokens: int, past: int = 0, logits: str = "last",
                  dense_mask: bool = False, mla_form: str = "auto") -> dict:
    """FLOPs of one forward pass of one sequence: ``num_tokens`` new tokens after ``past`` cached.

    Sums ``layer_flops`` over the layers and adds the output head: 2 H V per
    token whose logits are computed (``logits="last"``: one, as generation
    does; ``"all"``: every new token). ``mla_form`` as in ``layer_flops``
    (MLA: decode absorbed, prefill expanded). Returns the parts of
    ``layer_flops`` plus ``"lm_head"`` and ``"total"``.
    """
    if logits not in ("last", "all"):
        raise InvalidInputError(f"logits={logits!r}; use 'last' (one row, as generation does) or 'all'")
    num_tokens = check_count("num_tokens", num_tokens, 1)
    past = check_count("past", past, 0)
    rows = 1 if logits == "last" else num_tokens
    return _forward(_model_rates(shape), shape, num_tokens, past, rows, dense_mask, _check_form(mla_form))


def decode_flops(shape: ModelShape, context: int, dense_mask: bool = False) -> dict:
    """With a cache: one token at position ``context - 1`` attends to ``context`` keys (MLA: absorbed)."""
    context = check_count("context", context, 1)
    return forward_flops(shape, 1, past=context - 1, dense_mask=dense_mask)


def recompute_flops(shape: ModelShape, context: int, dense_mask: bool = False) -> dict:
    """Without a cache: the token at position ``context - 1`` needs all ``context`` tokens run again.

    That pass is a prefill of ``context`` tokens, so MLA counts it expanded (see ``layer_flops``).
    """
    context = check_count("context", context, 1)
    return forward_flops(shape, context, past=0, dense_mask=dense_mask, mla_form="expanded")


def generation_flops(shape: ModelShape, prompt_len: int, new_tokens: int, cache: bool = True,
                     dense_mask: bool = False) -> int:
    """Total FLOPs to generate ``new_tokens`` tokens after a prompt of ``prompt_len`` (one sequence).

    The loop of ``minikv.generate``: the prompt's forward pass yields the first
    new token; each further token needs one more pass.
      * cache=True:  prefill of prompt_len tokens, then new_tokens - 1 decode
        steps of one token each (the k-th sees prompt_len + k keys).
      * cache=False: the k-th new token (k = 0..new_tokens-1) needs a forward
        pass over all prompt_len + k tokens, recomputing every K and V.
    Each pass computes logits for its last token only. MLA: the prefill and
    every uncached pass expanded, the decode steps absorbed (see ``layer_flops``).
    """
    prompt_len = check_count("prompt_len", prompt_len, 1)
    new_tokens = check_count("new_tokens", new_tokens, 0)
    if new_tokens == 0:
        return 0
    rates = _model_rates(shape)
    form = "auto" if cache else "expanded"

    def flops(n, past):
        return _forward(rates, shape, n, past, 1, dense_mask, form)["total"]

    if cache:
        return flops(prompt_len, 0) + _series(lambda k: flops(1, prompt_len + k), new_tokens - 1)
    return _series(lambda k: flops(prompt_len + k, 0), new_tokens)


def _series(term, count: int) -> int:
    """``sum(term(k) for k in range(count))`` in closed form, for a ``term`` that is a polynomial of degree
    at most 2 in k (a pass's FLOPs are: keys grow as n past + n (n + 1) / 2). Newton's forward differences:
    sum = count t0 + C(count, 2) d1 + C(count, 3) d2, exact in integers, so a 2^31-token generation costs
    three evaluations instead of 2^31 passes."""
    t0, t1, t2 = (term(k) for k in range(3))
    d1, d2 = t1 - t0, t2 - 2 * t1 + t0
    return count * t0 + count * (count - 1) // 2 * d1 + count * (count - 1) * (count - 2) // 6 * d2


def cache_speedup(shape: ModelShape, prompt_len: int, new_tokens: int, dense_mask: bool = False) -> float:
    """Predicted FLOP ratio (no cache) / (cache) for a whole generation."""
    new_tokens = check_count("new_tokens", new_tokens, 1)
    return (generation_flops(shape, prompt_len, new_tokens, False, dense_mask)
            / generation_flops(shape, prompt_len, new_tokens, True, dense_mask))


def arithmetic_intensity(shape: ModelShape, num_tokens: int, past: int = 0, batch: int = 1,
                         weights_dtype: str = "fp16", kv_dtype: str = "fp16") -> float:
    """FLOPs per byte moved for one forward step of ``batch`` sequences.

    Bytes = the weights read once (for MoE only the experts one token uses, a
    lower bound) + every sequence's K/V read and written
    (``past + num_tokens`` tokens each). Activations are ignored. Decode
    (num_tokens = 1, batch 1) lands near 1 FLOP/byte in fp16, far below what a
    GPU can do per byte of bandwidth (hundreds), so decode is memory-bound;
    a long prefill reuses each weight for every prompt token and is compute-bound.
    """
    batch = check_count("batch", batch, 1)
    flops = batch * forward_flops(shape, num_tokens, past)["total"]
    moved = (weights_bytes(shape, weights_dtype, active=True)
             + kv_cache_bytes(shape, batch, past + num_tokens, 0, kv_dtype))
    return flops / moved

