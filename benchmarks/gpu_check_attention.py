"""GPU check, the peer: torch's scaled_dot_product_attention on the same data, every backend timed
explicitly (``torch.nn.attention.sdpa_kernel``): flash, cuDNN, memory-efficient, and the default
dispatch (with the backend it picked, read off the profiler's kernel names). Inputs are float16 (a
float32 cache is converted once, outside the timing: float32 SDPA runs the math backend, an unfair
peer). A backend that cannot run is recorded with its error, never fatal. ``best`` is the fastest
of flash, cuDNN and efficient (the default dispatch picks one of them, or math)."""

from __future__ import annotations

from gpu_check_common import AttnCase, Timer, bandwidth, stats

BACKENDS = ("FLASH_ATTENTION", "CUDNN_ATTENTION", "EFFICIENT_ATTENTION")
_KERNEL_HINTS = (("flash", "flash"), ("cudnn", "cudnn"), ("fmha", "efficient"), ("efficient", "efficient"),
                 ("mem_eff", "efficient"))


def _inputs(torch, rt, caches, q):
    """q [B, Hq, 1, D] and each cache's K/V [B, Hkv, S, D] as float16 torch tensors on the device."""
    qs = torch.from_dlpack(rt.asarray(q)).to(torch.float16).unsqueeze(2).contiguous()
    kvs = [(torch.from_dlpack(c.k[0]).to(torch.float16), torch.from_dlpack(c.v[0]).to(torch.float16))
           for c in caches]  # a no-op view for float16 caches, one conversion for float32
    return qs, kvs


def _backend_fns(torch, F, backend, qs, kvs, expand: bool):
    """One launch per input set under ``backend`` (None: the default dispatch)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    group = qs.shape[1] // kvs[0][0].shape[1]

    def make(k, v):
        if expand:  # a backend without GQA support: K/V repeated per query head (G x the bytes)
            k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        if backend is None:
            return lambda: F.scaled_dot_product_attention(qs, k, v, enable_gqa=not expand)

        def fn():
            with sdpa_kernel(getattr(SDPBackend, backend)):
                return F.scaled_dot_product_attention(qs, k, v, enable_gqa=not expand)
        return fn
    return [make(k, v) for k, v in kvs]


def _default_backend(torch, fn) -> str:
    """Which backend the default dispatch ran, from the CUDA kernel names the profiler saw."""
    try:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        names = " ".join(e.key.lower() for e in prof.key_averages())
    except Exception as e:
        return f"unknown ({type(e).__name__}: {e})"
    for hint, name in _KERNEL_HINTS:
        if hint in names:
            return name
    return "math (no fused kernel name seen)"


def time_torch_sdpa(rt, caches, q, case: AttnCase, timer: Timer, copy_gbs: float, ours=None) -> dict:
    """Every SDPA backend over ``caches``' K/V (float16) and query ``q`` (host float32 [B, Hq, D]).
    ``ours``: our output on caches[0] to compare with (default: caches[0].prepare_attend(0, q)())."""
    try:
        import torch
        import torch.nn.functional as F
    except ImportError as e:
        return {"error": f"torch not importable: {e}"}
    try:
        qs, kvs = _inputs(torch, rt, caches, q)
        ref = torch.from_dlpack(ours if ours is not None else caches[0].prepare_attend(0, rt.asarray(q))())
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}"}
    res: dict = {"torch": torch.__version__, "dtype": "float16", "backends": {}}
    if case.dtype != "float16":
        res["note"] = "GB/s counts this case's float32 cache bytes; SDPA read float16 copies (half as many)"
    for backend in (None,) + BACKENDS:
        name = backend or "default"
        entry: dict = {}
        for expand in (False, True):
            try:
                fns = _backend_fns(torch, F, backend, qs, kvs, expand)
                out = fns[0]().squeeze(2).float()
                err = float((out - ref).abs().max() / ref.abs().max())
                t = _torch_timer(torch, fns, timer) if rt.name == "cupy" else timer.median_ms(fns)
                entry = {**t, "rel_err_vs_ours": err, **bandwidth(case, t, copy_gbs), "kv_expanded": expand}
                if backend is None and rt.name == "cupy":
                    entry["ran"] = _default_backend(torch, fns[0])
                break
            except Exception as e:  # unavailable for these inputs: try without GQA, then record why
                entry.setdefault("error", f"{type(e).__name__}: {str(e)[:300]}")
        res["backends"][name] = entry
    timed = {n: e for n, e in res["backends"].items() if n != "default" and "median_ms" in e}
    if timed:
        best = min(timed, key=lambda n: timed[n]["median_ms"])
        res["best"] = {"backend": best, "median_ms": timed[best]["median_ms"]}
    elif "median_ms" in res["backends"].get("default", {}):
        res["best"] = {"backend": "default", "median_ms": res["backends"]["default"]["median_ms"]}
    return res


def _torch_timer(torch, fns, timer: Timer) -> dict:
    """Timer.median_ms for torch launches: torch's events, and a torch CUDA graph of one batch."""
    for i in range(timer.warmup):
        fns[i % len(fns)]()
    torch.cuda.synchronize()
    samples = []
    for r in range(timer.repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        fns[r % len(fns)]()
        start.record()
        for i in range(timer.batch):
            fns[(r + i + 1) % len(fns)]()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / timer.batch)
    eager = stats(samples)
    try:
        graph = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up on a side stream, as torch's graph docs ask
            fns[0]()
        torch.cuda.current_stream().wait_stream(side)
        with torch.cuda.graph(graph):
            keep = [fns[i % len(fns)]() for i in range(timer.batch)]  # noqa: F841 (outputs live in the graph pool)
        for _ in range(timer.warmup):
            graph.replay()
        samples = []
        for _ in range(timer.repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / timer.batch)
    except Exception as e:
        return {**eager, "method": "events", "graph_error": f"{type(e).__name__}: {e}"}
    return {**stats(samples), "method": "graph", "events_median_ms": eager["median_ms"]}
