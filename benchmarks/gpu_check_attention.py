"""GPU check, attention without a cache: torch's scaled_dot_product_attention, the peer that every
decode-attention timing is set against, on the same cache arrays (zero-copy through DLPack)."""

from __future__ import annotations

from gpu_check_common import AttnCase, Timer, bandwidth, stats


def time_torch_sdpa(rt, caches, q, case: AttnCase, timer: Timer, copy_gbs: float) -> dict:
    """torch's scaled_dot_product_attention over the same cache arrays (zero-copy through DLPack)."""
    try:
        import torch
        import torch.nn.functional as F
    except ImportError as e:
        return {"error": f"torch not importable: {e}"}
    try:
        dt = torch.float16 if case.dtype == "float16" else torch.float32
        s = case.context + 1
        qs = torch.from_dlpack(rt.asarray(q)).to(dt).unsqueeze(2)  # [B, Hq, 1, D]
        kvs = [(torch.from_dlpack(c.k[0]), torch.from_dlpack(c.v[0])) for c in caches]  # [B, Hkv, S, D] each
        assert kvs[0][0].shape[2] == s

        def make(k, v):
            return lambda: F.scaled_dot_product_attention(qs, k, v, enable_gqa=True)
        fns = [make(k, v) for k, v in kvs]
        out = fns[0]().squeeze(2).float()
        ours = caches[0].prepare_attend(0, rt.asarray(q))()
        err = float((out - torch.from_dlpack(ours)).abs().max() / torch.from_dlpack(ours).abs().max())
        if rt.name == "cupy":
            t = _torch_timer(torch, fns, timer)
        else:
            t = timer.median_ms(fns)
        return {**t, "rel_err_vs_ours": err, **bandwidth(case, t, copy_gbs), "torch": torch.__version__}
    except Exception as e:  # a peer that cannot run is reported, not fatal
        return {"error": f"{type(e).__name__}: {e}"}


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
