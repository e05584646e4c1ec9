"""The seam's rules, which every cache keeps: ``KVCacheBase.__init_subclass__`` (``minikv.kv_cache``)
wraps each subclass's ``write``, ``attend`` and ``free_sequence`` with the functions here.

* a layer attends only after it wrote its K/V in the open step (else it would read zeros, or the
  rows another sequence left there);
* ``attend`` takes floating-point queries whose heads are a multiple of the KV heads, and the score
  options (learned sinks, soft-capping) only where the cache's own ``attend`` applies them;
* ``free_sequence`` waits until the step ended (the step would commit into freed rows).

``KVCacheBase.end_step`` keeps the third rule: a step commits only once every layer wrote.
"""

from __future__ import annotations

import functools
import inspect

from minikv.errors import ConfigError, DTypeError, InvalidInputError, ShapeError


def records_write(fn):
    """Wrap a cache's ``write``: the layer counts as written once the store succeeded."""
    @functools.wraps(fn)
    def write(self, layer, *args, **kwargs):
        out = fn(self, layer, *args, **kwargs)
        self._written.add(layer)
        return out

    write._seam_rule = True
    return write


def after_write(fn):
    """Wrap a cache's ``attend``: a layer that has not written in the open step may not attend.

    The score options of ``minikv.online_softmax`` (``sinks=``, ``softcap=``: gpt-oss, Gemma 2) reach
    only caches whose own ``attend`` names them; any other cache refuses them with a ConfigError
    naming itself, rather than attending without them (plausible text, wrong logits)."""
    takes_options = "sinks" in inspect.signature(fn).parameters

    @functools.wraps(fn)
    def attend(self, layer, q, *args, **kwargs):
        if getattr(q, "ndim", None) == 3 and (q.dtype.kind != "f" or q.shape[1] % self.num_kv_heads):
            raise (ShapeError if q.dtype.kind == "f" else DTypeError)(
                f"q: {q.dtype} [N, Hq={q.shape[1]}, D]; pass floating-point queries, Hq a multiple of the "
                f"{self.num_kv_heads} KV heads")
        if not takes_options and any(kwargs.get(o) is not None for o in ("sinks", "softcap")):
            raise ConfigError(f"{type(self).__name__} does not apply learned sinks or logit soft-capping; this "
                              "model needs them: use a contiguous, paged or hybrid cache (or 'none')")
        kwargs = kwargs if takes_options else {k: v for k, v in kwargs.items() if k not in ("sinks", "softcap")}
        if self._step is not None:
            self._check_layer(layer)
            if layer not in self._written:
                raise InvalidInputError(f"attend(layer={layer}) before write(layer={layer}) in this step; "
                                        "each layer writes its K/V, then attends")
        return fn(self, layer, q, *args, **kwargs)

    attend._seam_rule = True
    return attend


def outside_step(fn):
    """Wrap a cache's ``free_sequence``: refused while a step is open (the step would commit into freed rows)."""
    @functools.wraps(fn)
    def free_sequence(self, seq_id, *args, **kwargs):
        if getattr(self, "_step", None) is not None:
            raise InvalidInputError(f"free_sequence({seq_id!r}) while a step is open; free it once the step ended")
        return fn(self, seq_id, *args, **kwargs)

    free_sequence._seam_rule = True
    return free_sequence
