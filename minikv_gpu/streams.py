"""Pinned host memory, streams, events and asynchronous block copies: what both runtimes offer a copy engine.

    rt = get_runtime()
    host = rt.pinned_empty((L, M, b, Hkv, D), np.float16)   # page-locked: the DMA engine reads it directly
    copy = rt.stream()                                      # a copy stream that never waits for the null stream
    done = rt.event()
    rt.copy_blocks_async(host, [3, 5], dev_pool, [0, 7], copy)  # host[:, 3] = dev_pool[:, 0], ... on `copy`
    done.record(copy)
    rt.current_stream().wait_event(done)                   # compute launched after this sees the copies

The objects are CuPy's own on a GPU (``cupy.cuda.Stream(non_blocking=True)``, ``cupy.cuda.Event``),
and ``SimStream``/``SimEvent`` on the simulator, which speak the same few words: ``event.record(stream)``,
``stream.wait_event(event)``, ``event.done`` (a query), ``event.synchronize()``, ``stream.synchronize()``.

``copy_blocks_async(dst, dst_ids, src, src_ids, stream)`` copies whole blocks between two pools
``[L, blocks, ...]`` of one dtype, one on the device and one pinned on the host: block ``src_ids[i]``
of every layer to block ``dst_ids[i]``. On CuPy each block is one ``cudaMemcpy2DAsync`` of L rows
(a row is one layer's block, the pitch is the pool's layer stride): the DMA engine does the gather
and the scatter, no kernel and no staging buffer is needed, and no SM is taken from the compute.

The simulator has no second engine. Its compute stream (``current_stream()``) runs everything at
once, as its kernels do. A ``SimStream`` runs each copy at once too, unless it is built with
``deferred=True``: then its copies wait in a queue and run only when something needs them (a
``wait_event`` on another stream, ``synchronize``), so a missing wait shows up as wrong numbers,
the way a race would on a GPU, and an event stays not ``done`` until its copies ran. Every stream
and event appends what it does to ``rt.stream_log``: ``("copy", stream, "d2h"|"h2d", src_ids, dst_ids)``
when issued, ``("ran", stream, n)`` when n queued copies ran, ``("record", stream, event_id)``,
``("wait", stream, event_id)`` (and ``("marker", stream, event_id)`` when a deferred stream queues that
wait); tests read the ordering protocol there.
"""

from __future__ import annotations

import itertools
import weakref

import numpy as np

from minikv.errors import DTypeError, InvalidInputError, ShapeError

__all__ = ["CupyCopies", "SimCopies", "SimEvent", "SimStream", "check_block_copy"]


def check_block_copy(rt, dst, dst_ids, src, src_ids) -> tuple[list[int], list[int], bool]:
    """Validate a block copy; returns (dst_ids, src_ids, to_host)."""
    pools = (dst, src)
    if any(getattr(a, "ndim", 0) < 2 for a in pools) or dst.shape[0] != src.shape[0] or dst.shape[2:] != src.shape[2:]:
        raise ShapeError(f"block copy between shapes {getattr(dst, 'shape', None)} and {getattr(src, 'shape', None)}; "
                         "expected two [L, blocks, ...] pools differing only in their block counts")
    if dst.dtype != src.dtype:
        raise DTypeError(f"block copy from {src.dtype} to {dst.dtype}; the copy moves bytes, cast the pools alike")
    if not (dst.flags.c_contiguous and src.flags.c_contiguous):
        raise ShapeError("block copy pools must be C-contiguous (a block is one run of bytes per layer)")
    pinned = [rt.is_pinned(a) for a in pools]  # on the simulator the device pool is a NumPy array too
    if pinned[0] == pinned[1] or not isinstance(pools[pinned.index(False)], rt.xp.ndarray):
        raise InvalidInputError("copy_blocks_async copies between a device pool and a pinned host pool "
                                "(rt.pinned_empty); use the copy kernel for device-to-device copies")
    ids = []
    for name, arr, vals in (("dst_ids", dst, dst_ids), ("src_ids", src, src_ids)):
        vals = [int(v) for v in np.asarray(vals, dtype=np.int64).reshape(-1)]
        if any(not 0 <= v < arr.shape[1] for v in vals):
            raise InvalidInputError(f"{name}={vals} names a block outside [0, {arr.shape[1]})")
        ids.append(vals)
    if len(ids[0]) != len(ids[1]) or len(set(ids[0])) != len(ids[0]):
        raise InvalidInputError(f"dst_ids={ids[0]}, src_ids={ids[1]}: pass one distinct destination per source")
    return ids[0], ids[1], pinned[0]


# --- the simulator --------------------------------------------------------------------------------

class SimEvent:
    """A point in a ``SimStream``: ``done`` once the stream ran every copy issued before ``record``."""

    _ids = itertools.count()

    def __init__(self, rt):
        self.rt, self.id = rt, next(SimEvent._ids)
        self._stream, self._mark = None, 0

    def record(self, stream=None) -> None:
        self._stream = stream if stream is not None else self.rt.current_stream()
        self._mark = self._stream.issued
        self.rt.stream_log.append(("record", self._stream.name, self.id))

    @property
    def done(self) -> bool:
        return self._stream is None or self._stream.ran >= self._mark

    def synchronize(self) -> None:
        if self._stream is not None:
            self._stream.run_until(self._mark)


class SimStream:
    """A stream of the simulator (see the module docstring); ``deferred``: copies wait until needed."""

    def __init__(self, rt, name: str, deferred: bool = False):
        self.rt, self.name, self.deferred = rt, name, bool(deferred)
        self._queue: list = []
        self.issued = self.ran = 0

    def __repr__(self) -> str:
        return f"<SimStream {self.name!r} issued={self.issued} ran={self.ran}>"

    def enqueue(self, fn, entry: tuple) -> None:
        self.rt.stream_log.append(entry)
        self._queue.append(fn)
        self.issued += 1
        if not self.deferred:
            self.run_until(self.issued)

    def run_until(self, mark: int) -> None:
        n = 0
        while self.ran < mark:
            self._queue.pop(0)()
            self.ran, n = self.ran + 1, n + 1
        if n:
            self.rt.stream_log.append(("ran", self.name, n))

    def wait_event(self, event: SimEvent) -> None:
        """Work issued here after this call runs after ``event``'s copies."""
        self.rt.stream_log.append(("wait", self.name, event.id))
        if event.done:
            return
        if self.deferred:  # a queued marker: when this stream gets there, the other one catches up
            other, mark = event._stream, event._mark  # as recorded now: the event may be recorded again
            self.enqueue(lambda: other.run_until(mark), ("marker", self.name, event.id))
        else:
            event.synchronize()

    def synchronize(self) -> None:
        self.run_until(self.issued)


class SimCopies:
    """The copy API of ``SimRuntime`` (mixed in): pinned memory is a flag, streams are ``SimStream``."""

    def __init__(self) -> None:
        super().__init__()
        self.stream_log: list = []
        self._pinned: list = []  # (start address, end address, weakref to the array)
        self._compute = SimStream(self, "compute")
        self._numbers = itertools.count()

    def pinned_empty(self, shape, dtype) -> np.ndarray:
        """An uninitialised host array the runtime counts as pinned (``is_pinned``)."""
        a = np.empty(shape, dtype=dtype)
        self._pinned = [p for p in self._pinned if p[2]() is not None] + [
            (a.ctypes.data, a.ctypes.data + a.nbytes, weakref.ref(a))]
        return a

    def is_pinned(self, a) -> bool:
        """Whether host array ``a`` (or the array it views) came from ``pinned_empty``."""
        if not isinstance(a, np.ndarray):
            return False
        ptr = a.ctypes.data
        return any(lo <= ptr < max(hi, lo + 1) and ref() is not None for lo, hi, ref in self._pinned)

    def stream(self, deferred: bool = False) -> SimStream:
        return SimStream(self, f"copy{next(self._numbers)}", deferred)

    def current_stream(self) -> SimStream:
        return self._compute

    def event(self, timing: bool = False) -> SimEvent:
        return SimEvent(self)

    def copy_blocks_async(self, dst, dst_ids, src, src_ids, stream) -> None:
        """``dst[:, dst_ids[i]] = src[:, src_ids[i]]`` on ``stream`` (module docstring)."""
        d, s, to_host = check_block_copy(self, dst, dst_ids, src, src_ids)

        def run():
            dst[:, d] = src[:, s]
        stream.enqueue(run, ("copy", stream.name, "d2h" if to_host else "h2d", tuple(s), tuple(d)))


# --- CuPy -------------------------------------------------------------------------------------------

class CupyCopies:
    """The copy API of ``CupyRuntime`` (mixed in): CuPy's pinned memory, streams and events."""

    def pinned_empty(self, shape, dtype) -> np.ndarray:
        """A NumPy array in page-locked memory (``cupyx.empty_pinned``: CuPy's pinned memory pool)."""
        import cupyx

        return cupyx.empty_pinned(shape, dtype=dtype)

    def is_pinned(self, a) -> bool:
        """Whether the CUDA driver knows host array ``a`` as page-locked (``cudaPointerGetAttributes``)."""
        if not isinstance(a, np.ndarray) or a.size == 0:
            return False
        return self.xp.cuda.runtime.pointerGetAttributes(a.ctypes.data).type == 1  # cudaMemoryTypeHost

    def stream(self, deferred: bool = False):
        if deferred:
            raise InvalidInputError("deferred=True is the simulator's model of a late copy; a GPU stream is "
                                    "asynchronous already (drop the argument)")
        return self.xp.cuda.Stream(non_blocking=True)

    def current_stream(self):
        return self.xp.cuda.get_current_stream()

    def event(self, timing: bool = False):
        return self.xp.cuda.Event(disable_timing=not timing)

    def copy_blocks_async(self, dst, dst_ids, src, src_ids, stream) -> None:
        """``dst[:, dst_ids[i]] = src[:, src_ids[i]]`` on ``stream``: one 2D copy per block (module docstring)."""
        d, s, _ = check_block_copy(self, dst, dst_ids, src, src_ids)
        runtime = self.xp.cuda.runtime
        width = int(np.prod(src.shape[2:], dtype=np.int64)) * src.dtype.itemsize  # one layer's block, in bytes
        base = [a.ctypes.data if isinstance(a, np.ndarray) else a.data.ptr for a in (dst, src)]
        pitch = (dst.strides[0], src.strides[0])
        for di, si in zip(d, s):
            runtime.memcpy2DAsync(base[0] + di * width, pitch[0], base[1] + si * width, pitch[1], width,
                                  src.shape[0], runtime.memcpyDefault, stream.ptr)
