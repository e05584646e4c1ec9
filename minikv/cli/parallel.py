"""``--tp`` and ``--cp`` of ``minikv generate`` and ``minikv perplexity``: the same run on MPI ranks.

    mpiexec -n 3 minikv generate --tp 3 --prompt "..." --json
    mpiexec -n 2 minikv perplexity --cp 2 --model DEEPSEEK_DIR --ids-file ids.txt

Every rank runs the command; rank 0 prints (``minikv.parallel.tensor.from_flags`` silences the others
but for their errors). The library side is ``minikv.parallel``.
"""

from __future__ import annotations

from contextlib import nullcontext

from minikv.cli import mpi_start
from minikv.cli.mpi_start import launched_ranks
from minikv.errors import ConfigError, MinikvError, ParallelError


def add_parallel_flags(p) -> None:
    p.add_argument("--tp", type=int, default=None,
                   help="tensor parallelism: split the heads, MLP and vocabulary over TP MPI ranks (run under "
                        "mpiexec -n TP; needs the parallel extra: pip install 'minikv[parallel]')")
    p.add_argument("--cp", type=int, default=None,
                   help="context parallelism for an MLA model: stripe its latent cache over CP ranks (position p "
                        "on rank p mod CP); with --tp the world is TP x CP ranks")


def runner_of(args, model):
    """``model`` itself without --tp/--cp, else this rank's ``minikv.parallel.tensor.ParallelModel``, built
    once the ranks agreed that none refused and all parsed the same arguments and model
    (``minikv.cli.mpi_start.agree``, before the first collective)."""
    if launched_ranks() > 1 and (args.tp is not None or args.cp is not None):
        mpi_start.agree(None, mpi_start.digest(args, model))
    if args.tp is None and args.cp is None:
        if launched_ranks() > 1:  # P copies of one run would each print, and compute everything P times
            raise ParallelError(f"this command runs on {launched_ranks()} MPI ranks but has no --tp or --cp; pass "
                                f"--tp {launched_ranks()} (or --tp T --cp C with T x C = {launched_ranks()})")
        return model
    from minikv.parallel.tensor import from_flags

    try:
        return from_flags(model, args.tp, args.cp)
    except MinikvError as e:
        # the ranks agreed on the same arguments and model, so each one refuses the same way: rank 0 prints
        e.startup_agreed = launched_ranks() > 1
        raise


def is_parallel(runner) -> bool:
    return hasattr(runner, "world")


def guard(runner):
    """The backstop around a parallel run (an error on some ranks only aborts them all); else nothing."""
    if not is_parallel(runner):
        return nullcontext()
    from minikv.parallel.collectives import abort_on_error

    return abort_on_error(runner.world)


def json_fields(runner, cache_bytes: list[int] | None) -> dict:
    """What ``--json`` adds on a parallel run: tp, cp, every rank's cache bytes and the heads' imbalance."""
    if not is_parallel(runner):
        return {}
    return {**runner.describe(), "cache_bytes_per_rank": cache_bytes}


def perplexity_factory(args, runner):
    """The rank's cache for ``minikv.perplexity.perplexity``'s ``cache_factory``; ``made`` keeps it to report."""
    if args.cache == "none":
        raise ConfigError("--cache none recomputes the whole text at every step; with --tp/--cp use a cache "
                          "that keeps tokens (contiguous, paged, ...)")
    if args.nll_file is not None:
        raise ConfigError("--nll-file compares with the exact run in one process; drop --tp/--cp for it")
    made = []

    def factory(m, n):
        made.append(runner.make_cache(args.cache, n, block_size=args.block_size, kv_dtype=args.kv_dtype,
                                      group=args.group, residual=args.residual, eviction=args.eviction))
        return made[-1]

    return factory, made
