"""Tensor parallelism over MPI ranks: the heads, the MLP and the vocabulary split across processes.

The idea (Megatron-LM's layout, as vLLM and SGLang run it)
-----------------------------------------------------------
Every rank holds the whole residual stream x: [N, H] and a *slice* of every weight. A layer's
two branches each end in one all-reduce, and nothing else crosses ranks::

    attention: Q/K/V column-parallel (rank r computes its heads only), attention over its own
               KV heads in its own cache, Wo row-parallel -> a partial [N, H] -> Allreduce(sum)
    MLP:       gate/up column-parallel (a slice of I), W_down row-parallel  -> Allreduce(sum)

So each rank's KV cache holds only its KV heads, with the query heads that map to them (a
contiguous GQA group stays on one rank): no rank ever reads another rank's K or V, and no KV
is gathered. The embedding and the LM head are split by vocabulary: rank r looks up only the
ids in its vocabulary slice (zeros elsewhere, so an Allreduce of [N, H] rebuilds the rows
exactly) and computes the logits of its slice, which an Allgather joins into [B, V].

Collectives per forward of N tokens (B logit rows), per rank, for tp > 1:
    1 Allreduce int32 [1]        the error flag (every rank agrees the step may start)
    1 Allreduce [N, H]           the embedding
    2 L Allreduce [N, H]         after Wo and after W_down of each layer
    1 Allgather [B, V]           the logits (each rank sends [B, V_r])
SmolLM2 at tp = 3: 60 all-reduces of [N, 576] per forward, plus the embedding and the logits.
A ring all-reduce moves 2 (p - 1) / p of the payload per rank, an all-gather (p - 1) / p.

How the heads split (``head_plan``)
-----------------------------------
* tp <= Hkv: the KV heads go in contiguous chunks, sizes differing by at most one (larger
  first), and each KV head takes its g = Hq / Hkv query heads along. tp = 2 on SmolLM2
  (9 query, 3 KV heads) gives 6 + 3 query heads and 2 + 1 KV heads: the first rank does twice
  the attention work and holds twice the cache (``imbalance`` reports it; vLLM refuses it).
* tp > Hkv: the ranks go in contiguous chunks over the KV heads; every rank of a chunk holds a
  copy of that KV head (replication) and a share of its query heads. tp = 9 on SmolLM2 gives one
  query head and one (replicated) KV head per rank: 3 x the KV bytes of tp = 3 in total.

MLA (DeepSeek-V2/V3) has one latent "head": head sharding splits the query heads (and W_UK,
W_UV, Wo with them), but every rank computes and caches the whole latent. Context parallelism
(``cp``, ``minikv.parallel.context``) cuts that duplicate by striping tokens over cp ranks instead.
A world of tp x cp ranks: rank = cp_rank * tp + tp_rank.

Faults: every forward starts with an Allreduce of an error flag (``agree``): a rank whose input,
cache step or positions were refused sets it, and then every rank raises (the others a
``RankFailedError`` naming the rank and its message) before any layer collective, so nobody
hangs. ``abort_on_error`` is the backstop for errors after that point: it aborts the communicator.
A rank that raises nothing but stops answering is caught by the watchdog of every collective
(``minikv.parallel.watchdog``): after ``$MINIKV_MPI_TIMEOUT`` seconds the others raise
``CollectiveTimeoutError`` naming it, and the job ends with one line.

The GPU wing: ``minikv_gpu.parallel`` runs this loop with each rank's share on its device and the
collectives on device arrays (host-staged, or ``cupy.cuda.nccl``).
"""

from __future__ import annotations

import sys
from contextlib import ExitStack
from dataclasses import dataclass, replace
from typing import Sequence

import numpy as np

from minikv.errors import ConfigError, MinikvError, ParallelError, ShapeError, check_int
from minikv.layers import rms_norm
from minikv.mla.block import MLALayerWeights, mla_attention_block
from minikv.model import LayerWeights, Model, ModelWeights, attention_block, mlp_block
from minikv.parallel.collectives import Collectives, agree, mpi_world

# --- the plan: who holds which heads, columns and vocabulary rows ---------------------------------

def split_even(n: int, parts: int) -> list[range]:
    """``n`` items in ``parts`` contiguous ranges whose sizes differ by at most one, larger first."""
    q, r = divmod(check_int("n", n, minimum=0), check_int("parts", parts))
    bounds = np.cumsum([0] + [q + (i < r) for i in range(parts)])
    return [range(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:])]


@dataclass(frozen=True)
class RankHeads:
    """A rank's heads: query heads ``q`` and KV heads ``kv`` (global indices, contiguous); for MLA ``kv``
    is the one latent, held by every rank."""

    q: range
    kv: range


def head_plan(num_heads: int, num_kv_heads: int, tp: int) -> list[RankHeads]:
    """Each rank's query and KV heads under tp-way head sharding (see the module docstring)."""
    tp = check_int("tp", tp)
    if tp > num_heads:
        raise ConfigError(f"tp={tp} is more than the model's {num_heads} query heads: a rank would hold none; "
                          f"use tp <= {num_heads}")
    g = num_heads // num_kv_heads
    if tp <= num_kv_heads:
        return [RankHeads(range(kv.start * g, kv.stop * g), kv) for kv in split_even(num_kv_heads, tp)]
    plan = []
    for kv, ranks in enumerate(split_even(tp, num_kv_heads)):  # the ranks that share KV head kv
        for q in split_even(g, len(ranks)):
            plan.append(RankHeads(range(kv * g + q.start, kv * g + q.stop), range(kv, kv + 1)))
    return plan


def imbalance(plan: Sequence[RankHeads]) -> dict:
    """Load imbalance of a plan: the busiest rank's query heads (attention work) and KV heads (cache bytes)
    over the mean; 1.0 is even. tp = 2 on SmolLM2: 6 vs 4.5 query heads -> 1.333."""
    q = np.array([len(h.q) for h in plan], dtype=np.float64)
    kv = np.array([len(h.kv) for h in plan], dtype=np.float64)
    return {"query_heads": [len(h.q) for h in plan], "kv_heads": [len(h.kv) for h in plan],
            "attention": float(q.max() / q.mean()), "kv_cache": float(kv.max() / kv.mean())}


def _cols(a: np.ndarray | None, r: range, width: int) -> np.ndarray | None:
    """Columns of heads (or items) ``r``, ``width`` columns each, of a matrix [in, out]."""
    return None if a is None else a[:, r.start * width: r.stop * width]


def _rows(a: np.ndarray, r: range, width: int) -> np.ndarray:
    return a[r.start * width: r.stop * width]


def shard_model(model: Model, heads: RankHeads, inter: range, vocab: range, first: bool) -> Model:
    """The rank's slice of ``model`` as an ordinary ``Model`` of its head counts, MLP width and vocabulary.

    Its forward alone computes partial sums (the all-reduces are ``ParallelModel``'s); it serves for its
    prepared layers and for building the rank's caches with ``minikv.generate.make_cache``. ``first``:
    the rank that adds the output bias once (MLA's ``bo``; the others add zeros to the sum).
    """
    c, w = model.config, model.weights
    layers = []
    for lw in w.layers:
        mlp = dict(mlp_norm=lw.mlp_norm, w_gate=_cols(lw.w_gate, inter, 1), w_up=_cols(lw.w_up, inter, 1),
                   w_down=_rows(lw.w_down, inter, 1))
        if c.mla is None:
            d = c.head_dim
            layers.append(LayerWeights(attn_norm=lw.attn_norm, wq=_cols(lw.wq, heads.q, d),
                                       wk=_cols(lw.wk, heads.kv, d), wv=_cols(lw.wv, heads.kv, d),
                                       wo=_rows(lw.wo, heads.q, d), **mlp))
            continue
        m = c.mla
        qk, kvb = m.qk_head_dim, m.qk_nope_head_dim + m.v_head_dim
        layers.append(MLALayerWeights(
            attn_norm=lw.attn_norm, wkv_a=lw.wkv_a, kv_a_norm=lw.kv_a_norm, wkv_b=_cols(lw.wkv_b, heads.q, kvb),
            wo=_rows(lw.wo, heads.q, m.v_head_dim), wq=_cols(lw.wq, heads.q, qk), wq_a=lw.wq_a,
            q_a_norm=lw.q_a_norm, wq_b=_cols(lw.wq_b, heads.q, qk), bq_a=lw.bq_a, bkv_a=lw.bkv_a,
            bo=lw.bo if first else None, **mlp))
    lm_head = None if w.lm_head is None else w.lm_head[vocab.start: vocab.stop]
    weights = ModelWeights(embed=w.embed[vocab.start: vocab.stop], layers=layers, final_norm=w.final_norm,
                           lm_head=lm_head)
    cfg = replace(c, vocab_size=len(vocab), intermediate_size=len(inter), num_heads=len(heads.q),
                  num_kv_heads=len(heads.kv) if c.mla is None else 1)
    return Model(cfg, weights, dtype=model.dtype)


# --- one rank's model --------------------------------------------------------------------------------

class ParallelModel:
    """One rank's share of ``model`` in a world of tp x cp MPI ranks; it runs like a ``Model``.

    What the loops use: ``config`` (the whole model's), ``dtype``, ``check_tokens``, ``forward``
    (``Model.forward``'s contract; every rank returns the same logits), ``logits`` (uncached),
    ``make_cache`` (this rank's cache) and ``generate`` (the generation loop, for the CLI).
    model: a ``Model``, or anything with its ``config``, ``weights`` and ``dtype``: the weights are only
    sliced, so memory-mapped arrays (``np.load(mmap_mode="r")``) make each rank read just its share.
    comm: an mpi4py communicator of tp x cp ranks (default ``COMM_WORLD``; a single process needs none).
    After each forward ``trace`` lists its collectives (``Collective``); ``totals`` sums them over the run.
    """

    def __init__(self, model: Model, tp: int = 1, cp: int = 1, comm=None):
        tp, cp = check_int("tp", tp), check_int("cp", cp)
        c = model.config
        if cp > 1 and c.mla is None:
            raise ConfigError(f"cp={cp}: context parallelism stripes MLA's single latent over ranks; this is a GQA "
                              "model, whose KV heads shard with --tp (use --cp 1)")
        if comm is None and tp * cp > 1:
            comm = mpi_world()
        self.trace, self.totals = [], {"collectives": 0, "bytes": 0, "wire_bytes": 0.0}
        self.world = Collectives(comm, "world", self.trace)
        if self.world.size != tp * cp:
            raise ParallelError(f"tp={tp} x cp={cp} needs {tp * cp} MPI ranks, but this run has {self.world.size}; "
                                f"start it with mpiexec -n {tp * cp}, or pass --tp {self.world.size // cp}")
        for name, n in (("intermediate_size", c.intermediate_size), ("vocab_size", c.vocab_size)):
            if tp > n:
                raise ConfigError(f"tp={tp} is more than the model's {name}={n}; use a smaller tp")
        self.tp, self.cp = tp, cp
        self.cp_rank, self.tp_rank = divmod(self.world.rank, tp)
        self.tp_group = self.world.split(self.cp_rank, "tp")  # the ranks holding the same tokens
        self.cp_group = self.world.split(self.tp_rank, "cp")  # the ranks holding the same heads
        self.plan = head_plan(c.num_heads, 1 if c.mla else c.num_kv_heads, tp)
        self.heads = self.plan[self.tp_rank]
        self.vocab = split_even(c.vocab_size, tp)
        inter = split_even(c.intermediate_size, tp)[self.tp_rank]
        self.local = shard_model(model, self.heads, inter, self.vocab[self.tp_rank], first=self.tp_rank == 0)
        self.config, self.dtype = c, model.dtype
        self.cache_bytes: list[int] | None = None  # every rank's cache bytes after ``generate``
        self.last_cache = None  # the cache ``make_cache`` built last

    check_tokens = Model.check_tokens        # they read only ``self.config``: the whole model's
    check_positions = Model.check_positions

    def describe(self) -> dict:
        """tp, cp and the heads' load imbalance (``imbalance``)."""
        return {"tp": self.tp, "cp": self.cp, "imbalance": imbalance(self.plan)}

    def check_call(self, tokens, cache, seq_ids) -> tuple[list[np.ndarray], list]:
        """``Model.check_call`` against this rank's geometry: the cache must be one ``make_cache`` built."""
        toks = self.check_tokens(tokens)
        seq_ids = list(range(len(toks))) if seq_ids is None else list(seq_ids)
        if len(seq_ids) != len(toks):
            raise ShapeError(f"{len(seq_ids)} seq_ids for {len(toks)} token lists; give one id per sequence")
        lc = self.local.config
        got, want = (cache.num_layers, cache.num_kv_heads, cache.head_dim), (lc.num_layers, lc.num_kv_heads,
                                                                             lc.head_dim)
        if got != want or getattr(cache, "mla", None) != lc.mla:
            raise ConfigError(f"rank {self.world.rank}: cache geometry (layers, kv_heads, head_dim)={got} is not "
                              f"this rank's {want}; build the cache with ParallelModel.make_cache")
        return toks, seq_ids

    def forward(self, tokens: Sequence, cache, seq_ids: Sequence | None = None,
                all_logits: bool = False) -> np.ndarray:
        """``Model.forward`` across the ranks: logits [B, V] (or [N, V]), the same on every rank.

        The checks, the cache step and the positions are agreed on by every rank (``agree``) before the
        first layer collective; a step that fails anywhere is rolled back everywhere.
        """
        self.trace.clear()
        with ExitStack() as stack:
            err = positions = None
            try:
                toks, seq_ids = self.check_call(tokens, cache, seq_ids)
                positions = stack.enter_context(cache.step(seq_ids, [t.size for t in toks]))
                if getattr(cache, "rotates_in_cache", False):
                    positions = None  # the cache rotates by in-cache position: no absolute angles
                else:
                    self.check_positions(positions)
            except Exception as e:  # any failure: every rank must hear of it
                err = e
            agree(self.world, err)
            logits = self._run(toks, cache, positions, all_logits)
        for c in self.trace:
            self.totals["collectives"] += 1
            self.totals["bytes"] += c.bytes
            self.totals["wire_bytes"] += c.wire_bytes
        return logits

    def _run(self, toks: list[np.ndarray], cache, positions, all_logits: bool) -> np.ndarray:
        """The layers: each branch's partial [N, H] summed over the tp group; the logits gathered by vocabulary."""
        c, m, tp = self.config, self.local, self.tp_group
        ids = np.concatenate(toks)
        cos = sin = None
        if positions is not None:
            cos, sin = m.cos[positions], m.sin[positions]  # [N, D/2]
        vocab = self.vocab[self.tp_rank]
        mine = (ids >= vocab.start) & (ids < vocab.stop)
        rows = m.embed[np.where(mine, ids - vocab.start, 0)]
        x = tp.allreduce(np.where(mine[:, None], rows, rows.dtype.type(0)))  # [N, H]: one rank holds each row
        attention = attention_block if c.mla is None else mla_attention_block
        for li, lw in enumerate(m.prepared_layers):
            x = x + tp.allreduce(attention(x, lw, m.config, cache, li, cos, sin))
            x = x + tp.allreduce(mlp_block(x, lw, m.config))
        if not all_logits:
            x = x[np.cumsum([t.size for t in toks]) - 1]
        logits = tp.allgather(rms_norm(x, m.final_norm, c.rms_eps) @ m.lm_head.T, [len(v) for v in self.vocab])
        assert logits.dtype == self.dtype, logits.dtype  # no silent float64 promotion
        return logits

    def make_cache(self, kind: str, max_len: int, max_seqs: int = 1, block_size: int = 16, **options):
        """This rank's cache of ``kind``: ``minikv.generate.make_cache`` for its heads (``options``: kv_dtype,
        group, residual, eviction); with cp > 1 a latent cache of its 1/cp of the tokens
        (``minikv.parallel.context.StripedLatentCache``). Every rank must call it: a cache refused on one
        rank is refused on all (``agree``). ``minikv.generate.make_cache`` hands a ParallelModel here."""
        cache, err = None, None
        try:
            cache = self._make_cache(kind, max_len, max_seqs, block_size, **options)
        except MinikvError as e:
            err = e
        agree(self.world, err)
        self.last_cache = cache
        return cache

    def _make_cache(self, kind: str, max_len: int, max_seqs: int, block_size: int, **options):
        from minikv.generate import make_cache

        shared = self.tp > self.config.num_kv_heads and self.config.mla is None
        if kind in ("h2o", "snapkv") and shared:
            raise ConfigError(f"cache {kind!r} scores each KV head by the attention of all its query heads, which "
                              f"tp={self.tp} > {self.config.num_kv_heads} KV heads splits over ranks; use "
                              f"tp <= {self.config.num_kv_heads} or cache window/contiguous/paged")
        if self.cp == 1:
            return make_cache(kind, self.local, max_len, max_seqs, block_size, **options)
        from minikv.parallel.context import striped_cache

        return striped_cache(kind, self.local, self.cp_group, max_len, max_seqs, block_size, **options)

    def logits(self, ids: Sequence[int]) -> np.ndarray:
        """Uncached logits [T, V] of one sequence (a fresh cache of the rank: none, or striped for cp)."""
        cache = self.make_cache("none" if self.cp == 1 else "contiguous", max(len(ids), 1))
        cache.add_sequence(0)
        return self.forward([ids], cache, all_logits=True)

    def cache_bytes_per_rank(self, cache) -> list[int]:
        """``cache.bytes_allocated()`` of every rank, in rank order (every rank must call it)."""
        return [int(b) for b in self.world.gather_objects(int(cache.bytes_allocated()))]

    @staticmethod
    def generate(model: "ParallelModel", prompt_ids, max_new_tokens: int, **kwargs):
        """``generate(model, ...)`` (module level): the CLI calls ``model.generate`` like ``minikv.generate``."""
        return generate(model, prompt_ids, max_new_tokens, **kwargs)


def generate(model: ParallelModel, prompt_ids: Sequence[int], max_new_tokens: int, **kwargs):
    """``minikv.generate.generate`` on every rank of a ``ParallelModel``: the same loop, the same tokens
    everywhere (every rank samples the same gathered logits with the same seed). The loop builds the
    cache through ``ParallelModel.make_cache``. Afterwards ``model.cache_bytes`` lists every rank's cache
    bytes (None when no cache was built: ``max_new_tokens == 0``)."""
    from minikv.generate import generate as generate_one

    model.last_cache = None
    result = generate_one(model, prompt_ids, max_new_tokens, **kwargs)
    model.cache_bytes = None if model.last_cache is None else model.cache_bytes_per_rank(model.last_cache)
    return result


# --- the command line -------------------------------------------------------------------------------

def from_flags(model: Model, tp: int | None, cp: int | None) -> Model | ParallelModel:
    """The CLI's ``--tp``/``--cp``: ``model`` itself when neither is given, else this rank's ``ParallelModel``
    (MPI started by mpiexec); ranks other than 0 then print only their errors."""
    if tp is None and cp is None:
        return model
    pm = ParallelModel(model, tp=1 if tp is None else tp, cp=1 if cp is None else cp)
    if pm.world.size > 1:
        _abort_on_uncaught(pm.world)
    if pm.world.rank != 0:
        quiet_output()
    return pm


def _abort_on_uncaught(world) -> None:
    """An exception no handler catches prints its traceback, then aborts every rank (mpi4py's advice)."""
    previous = sys.excepthook

    def hook(kind, value, tb):
        previous(kind, value, tb)
        sys.stderr.flush()
        world.comm.Abort(1)

    sys.excepthook = hook


class _ErrorsOnly:
    """A stderr that passes only lines starting ``minikv:`` (the errors), for ranks other than 0."""

    def __init__(self, stream):
        self.stream, self.keep = stream, False

    def write(self, s: str) -> int:
        self.keep = self.keep or s.startswith("minikv:")  # print() writes the text, then "\n"
        if self.keep:
            self.stream.write(s)
            self.keep = not s.endswith("\n")
        return len(s)

    def flush(self) -> None:
        self.stream.flush()

    def isatty(self) -> bool:
        return False

    def __getattr__(self, name):  # encoding, fileno, ... of the real stream
        return getattr(self.stream, name)


def quiet_output() -> None:
    """Rank 0 prints: the other ranks' stdout is dropped and their stderr keeps only error lines."""
    import os

    sys.stdout = open(os.devnull, "w", encoding="utf-8")  # noqa: SIM115  (for the life of the process)
    sys.stderr = _ErrorsOnly(sys.stderr)
