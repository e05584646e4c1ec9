"""GPU check, step 6: decode attention over an evicting cache's slots (``minikv_gpu.window``, ``kernels/window.cu``).

    python benchmarks/gpu_check_window.py OUT.json               # on the GPU (part of gpu_check.py too)
    python benchmarks/gpu_check_window.py OUT.json --sim-smoke   # here: toy sizes on the simulator

One decode step of B sequences over a sliding-window ring of W slots with S sinks (the goal case:
llama-8B heads, Hq 32, Hkv 8, D 128, B 64, W 4096, S 4; float16 slots), built as the cache leaves it:
a long-wrapped ring (positions far past W, so storage order is not time order, and the slot of q
holds the key that has just left the window) plus the query's own key in one more slot (C = W + 1).
Six variants: ``v1``, ``v3`` and ``v4`` (register-resident), ``v1_mass`` (v1 with each slot's softmax mass,
what H2O accumulates) and ``v3_rope``, ``v4_rope`` (with in-cache rotation: pre-RoPE keys rotated by rank).

Each variant is first run through ``window_decode`` and checked against NumPy on a few sequences
(``minikv.window.ring.attend_slots`` with ``WindowPolicy.visible``; ``attend_in_cache`` for the rotation;
the mass against attend_slots' mass), then timed as the kernel launch alone (``window_decode``
copies the positions to the host and back per call; the timed launch is the same kernel with the
same arguments, and its output after timing must equal ``window_decode``'s (within 1e-6), rotating
over input copies past L2. Reported: median time, the minimum bytes (the visible keys' K/V, every
slot's position, q and out; the mass written too), achieved GB/s and its fraction of the copy.
"""

from __future__ import annotations

import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))

from gpu_check_common import Timer, l2_bytes, randn, rel_err, stage_main  # noqa: E402

WINDOW_RTOL = 1e-4  # tests/gpu/test_gpu_window.py's tolerance against NumPy


@dataclass(frozen=True)
class WindowCase:
    name: str
    batch: int
    window: int
    sinks: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # the slots' dtype
    checked: int  # sequences checked against NumPy (the first and the last ones)

    @property
    def slots(self) -> int:
        return self.window + 1  # the ring and the query's own key


GOAL_WINDOW = WindowCase("goal llama8b B64 W4096", 64, 4096, 4, 32, 8, 128, "float16", 2)
SMOKE_WINDOW = WindowCase("smoke B2 W24", 2, 24, 2, 8, 2, 32, "float16", 2)
VARIANTS = {"v1": dict(version=1), "v3": dict(version=3), "v4": dict(version=4),
            "v1_mass": dict(version=1, want_mass=True), "v3_rope": dict(version=3, rope=True),
            "v4_rope": dict(version=4, rope=True)}


def ring_positions(case: WindowCase, q_pos: np.ndarray) -> np.ndarray:
    """pos [B, Hkv, C]: the survivors of positions 0 .. q-1 in their ring slots, q in slot W (q >= W + S)."""
    from minikv.window import WindowPolicy

    pol = WindowPolicy(case.window, case.sinks)
    pos = np.full((case.batch, case.num_kv_heads, case.slots), -1, np.int64)
    for i, q in enumerate(int(x) for x in q_pos):
        for p in [*range(case.sinks), *range(q - (case.window - case.sinks), q)]:
            pos[i, :, pol.ring_slot(p)] = p
        pos[i, :, case.window] = q
    if np.any(pos < 0):
        raise AssertionError("ring_positions: a slot stayed empty (q_pos < W + S?)")
    return pos


def _launcher(rt, q, k, v, pos, q_pos, case: WindowCase, version: int, want_mass: bool, rope):
    """A no-argument launch of ``window_decode``'s kernel on these device inputs (its code, without the
    per-call host round trip of the positions), and its out (, mass) buffers."""
    from minikv_gpu import window as gw
    from minikv_gpu.runtime import device_f32, head_dim_defines, score_options

    b, hq, d = q.shape
    hkv, c, group = case.num_kv_heads, case.slots, hq // case.num_kv_heads
    defines = {**head_dim_defines(d), "CACHE_HALF": int(np.dtype(k.dtype) == np.float16)}
    mode = gw.ROPE_MODES[rope[2]] if rope is not None else 0
    cos, sin = gw._tables(rt, rope, d, case.window - 1)
    xp = rt.xp
    out = xp.zeros((b, hq, d), dtype=np.float32)
    mass = xp.zeros((b, hkv, c) if want_mass else (1,), dtype=np.float32)
    common = (pos, q_pos, cos, sin, out)
    scalars = (np.int32(hq), np.int32(hkv), np.int32(c), np.int32(case.window), np.int32(case.sinks),
               np.int32(mode), np.float32(1.0 / np.sqrt(d))) + score_options(rt, hq)  # no sinks, no cap
    qd = device_f32(rt, q, "q")
    if version >= 3:
        kern = rt.kernel("window", f"window_decode_v{version}", defines={**defines, "GQA_GROUP": group})

        def launch():
            kern((b, hkv), (128,), (qd, k, v) + common + scalars)
    else:
        kern = rt.kernel("window", "window_decode_v1", defines=defines)

        def launch():
            kern((b, hkv), (32 * group,), (qd, k, v) + common + (mass, np.int32(want_mass)) + scalars,
                 shared_mem=4 * group * d)
    return launch, out, mass


def _check(entry: dict, name: str, got, want, what: str = "out") -> None:
    """Record ``what``'s error against NumPy in ``entry``; a miss beyond WINDOW_RTOL goes to entry["misses"] (the
    variant is still timed: its row is kept)."""
    err = rel_err(got, want)
    key = "rel_err" if what == "out" else f"{what}_rel_err"
    entry[key] = max(entry.get(key, 0.0), err)
    if not err <= WINDOW_RTOL:
        entry.setdefault("misses", []).append(f"{what} relative error {err:.2e} against minikv.window "
                                              f"(tolerance {WINDOW_RTOL:g})")


def run_window(rt, smoke: bool, timer: Timer, copy_gbs: float = float("nan")) -> dict:
    """Check and time every variant (see the module docstring); a failing variant is recorded, not raised."""
    from minikv import window as ref
    from minikv.layers import rope_tables
    from minikv_gpu.window import window_decode

    case = SMOKE_WINDOW if smoke else GOAL_WINDOW
    rng = np.random.default_rng(6)
    b, hq, hkv, d, c, w = case.batch, case.num_heads, case.num_kv_heads, case.head_dim, case.slots, case.window
    dt = np.dtype(case.dtype)
    q_pos = (3 * w + 17 + 13 * np.arange(b)).astype(np.int64)  # long-wrapped rings, each at its own phase
    pos = ring_positions(case, q_pos)
    policy = ref.WindowPolicy(w, case.sinks)
    visible_keys = sum(int(policy.visible(q_pos[i:i + 1], pos[i]).sum()) for i in range(b))  # b * hkv * W
    per_copy = 2 * b * hkv * c * d * dt.itemsize
    copies = int(min(4, max(1, -(-2 * l2_bytes(rt) // per_copy))))
    kv = [(randn(rt, rng, (b, hkv, c, d)).astype(dt), randn(rt, rng, (b, hkv, c, d)).astype(dt))
          for _ in range(copies)]
    q = randn(rt, rng, (b, hq, d))
    pos_d, qp_d = rt.asarray(pos.astype(np.int32)), rt.asarray(q_pos.astype(np.int32))
    rope = (*rope_tables(d, w, 10000.0), "half")
    rows = sorted({0, b - 1})[:case.checked]
    qh = rt.asnumpy(q)
    kh, vh = (np.stack([rt.asnumpy(a[r]) for r in rows]).astype(np.float32) for a in kv[0])  # only those copied
    base = 2 * 4 * b * hq * d + 4 * b * hkv * c  # q read, out written, every slot's position read
    res: dict = {"case": {**asdict(case), "slots": c}, "copy_gb_per_s": copy_gbs, "inputs_rotated": copies,
                 "visible_keys": visible_keys, "checked_sequences": rows, "rtol": WINDOW_RTOL,
                 "slot_bytes": 2 * b * hkv * c * d * dt.itemsize}
    for name, opts in VARIANTS.items():
        version, want_mass, rot = opts["version"], opts.get("want_mass", False), opts.get("rope", False)
        try:
            full = window_decode(q, kv[0][0], kv[0][1], pos, q_pos, w, case.sinks, rope if rot else None,
                                 want_mass, version=version, runtime=rt)
            out = rt.asnumpy(full[0] if want_mass else full)
            entry: dict = {"version": version, "mass": want_mass, "in_cache_rope": rot}
            for i, r in enumerate(rows):
                qp1 = q_pos[r:r + 1]
                if rot:
                    _check(entry, name, out[r:r + 1],
                           ref.attend_in_cache(qh[r:r + 1], kh[i], vh[i], pos[r], qp1, policy.visible, rope))
                    continue
                got = ref.attend_slots(qh[r:r + 1], [(kh[i], vh[i], pos[r])],
                                       lambda kp, qp1=qp1: policy.visible(qp1, kp),
                                       np.ones(1, bool) if want_mass else None)
                _check(entry, name, out[r:r + 1], got[0] if want_mass else got)
                if want_mass:
                    _check(entry, name, rt.asnumpy(full[1])[r], got[1][0], "mass")
            entry.update(_time(rt, timer, case, (q, kv, pos_d, qp_d), version, want_mass, rope if rot else None,
                               full, out, nbytes=2 * visible_keys * d * dt.itemsize + base, copy_gbs=copy_gbs))
        except Exception as e:
            entry = {"version": version, "error": f"{type(e).__name__}: {e}"}
        res[name] = entry
        print("window:", name, {k: entry.get(k) for k in ("median_ms", "gb_per_s", "of_copy", "rel_err", "error")},
              flush=True)
    res["ratios"] = _ratios({n: res[n].get("median_ms") for n in VARIANTS})
    return res


def _time(rt, timer: Timer, case: WindowCase, inputs, version: int, want_mass: bool, rope, full, out, nbytes: int,
          copy_gbs: float) -> dict:
    """Time the variant's kernel launch alone, rotating over the input copies; its output must equal
    window_decode's (``full``, ``out``); GB/s over ``nbytes`` (+ the mass written)."""
    q, kv, pos_d, qp_d = inputs
    launches = [_launcher(rt, q, kd, vd, pos_d, qp_d, case, version, want_mass, rope) for kd, vd in kv]
    t = timer.median_ms([fn for fn, _, _ in launches])
    same = rel_err(rt.asnumpy(launches[0][1]), out)
    if want_mass:
        same = max(same, rel_err(rt.asnumpy(launches[0][2]), rt.asnumpy(full[1])))
    if not same <= 1e-6:  # the same deterministic kernel: equal, unless the launch drifted from window.py's
        raise AssertionError(f"window v{version}: the timed launch's output differs from window_decode's "
                             f"({same:.1e}) after {t['samples']} samples")
    nbytes += 4 * case.batch * case.num_kv_heads * case.slots if want_mass else 0
    gbs = nbytes / (t["median_ms"] * 1e-3) / 1e9
    return {**t, "min_bytes": nbytes, "gb_per_s": gbs, "of_copy": gbs / copy_gbs}


def _ratios(ms: dict) -> dict:
    """Time ratios between the variants (> 1: the second named is faster), None where one did not run."""
    pairs = {"v3_vs_v1": ("v1", "v3"), "v4_vs_v3": ("v3", "v4"), "mass_cost_vs_v1": ("v1_mass", "v1"),
             "rope_cost_vs_v3": ("v3_rope", "v3")}
    return {k: ms[a] / ms[b] if ms[a] and ms[b] else None for k, (a, b) in pairs.items()}


def errors(res: dict) -> list[str]:
    """The failed variants of a run_window result, and every tolerance miss, as report error lines."""
    return [f"window {n}: {res[n]['error']}" for n in VARIANTS if "error" in res.get(n, {})] + \
        [f"window {n}: {m}" for n in VARIANTS for m in res.get(n, {}).get("misses", [])]


def main(argv: list[str] | None = None) -> int:
    return stage_main(argv, __doc__, run_window, failed=errors, summary=lambda res: {
        n: {m: res[n].get(m) for m in ("median_ms", "rel_err", "error") if m in res[n]} for n in VARIANTS})


if __name__ == "__main__":
    sys.exit(main())
