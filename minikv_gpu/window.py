"""Step 6 on the GPU: decode attention over an evicting cache's slots (mirrors ``minikv.window``).

``window_decode`` runs ``kernels/window.cu``'s ``window_decode_v3`` (register-resident, decode_v3.cuh's
design) or ``window_decode_v1`` (tiles in shared memory; the one with the mass) for one decode step:
each sequence's single query over its stored slots (any order, each slot's position stored, -1
empty), with the window/sinks visibility of ``WindowPolicy`` (``window=0``: no window rule, causal
on the stored positions, as the base ``Policy``, H2O and SnapKV see their slots). Options:

* ``rope=(cos, sin, layout)``: in-cache positions (StreamingLLM). q and k are *pre-RoPE*; every
  visible key is rotated by its rank among the visible keys and the query by its own rank, the
  window policy's closed form (``minikv.window.ring.rank_positions`` on a ring that lost nothing else);
* ``want_mass=True``: also return each slot's softmax mass summed over the G query heads of its KV
  head (``minikv.window.ring.attend_slots``' ``mass``, what H2O accumulates), 0 where not visible;
* ``sink_logits=[Hq]``, ``softcap=``: ``minikv.online_softmax``'s learned sinks (gpt-oss; one logit per
  query head in the denominator, not StreamingLLM's sink *tokens*, which are ``sinks=``) and tanh
  soft-capping (Gemma 2), in every version.

``EvictingKVCache`` is ``minikv.window.ring.EvictingKVCache`` with single-token decode steps attended by
those kernels (the slots and the step's own new token, appended as one more slot). Prefill and
multi-token steps, and the policies' bookkeeping (placement, eviction, the log), stay the inherited
NumPy path; the storage itself stays in host NumPy arrays, copied to the device per call.
"""

from __future__ import annotations

import numpy as np

from minikv import window as _cpu
from minikv.errors import ConfigError, DTypeError, InvalidInputError, ShapeError, check_choice, check_int
from minikv.layers import ROPE_LAYOUTS
from minikv_gpu.runtime import STATIC_SMEM_LIMIT, device_f32, get_runtime, head_dim_defines, score_options
from minikv_gpu.versions import DECODE_THREADS, choose_version, decode_defines, decode_refusal

__all__ = ["ROPE_MODES", "WINDOW_VERSIONS", "EvictingKVCache", "Visible", "attend_in_cache", "attend_slots",
           "window_decode"]

ROPE_MODES = {None: 0, "half": 1, "interleaved": 2}  # layout -> rope_mode of window_decode_v1
_INT32_MAX = np.iinfo(np.int32).max


def _static_smem(head_dim: int) -> int:
    """window_decode_v1's static shared memory: the K/V tiles, the ranks, the mass rows."""
    return 4 * (32 * (head_dim + 1) + 32 * head_dim + 32 + 32 * 32)


def _check_shapes(q, k, v, pos, q_pos) -> tuple[int, int, int, int, int]:
    """B, Hq, Hkv, C, D of a valid call (ShapeError / DTypeError otherwise)."""
    for name, a in (("q", q), ("k", k), ("v", v), ("pos", pos), ("q_pos", q_pos)):
        if not hasattr(a, "shape") or not hasattr(a, "dtype"):
            raise DTypeError(f"{name} must be an array, got {type(a).__name__}")
    if q.ndim != 3 or k.ndim != 4:
        raise ShapeError(f"q.shape={q.shape}, k.shape={k.shape}: expected q [B, Hq, D] and k [B, Hkv, C, D]")
    b, hq, d = q.shape
    _, hkv, c, _ = k.shape
    if k.shape[0] != b or k.shape[3] != d or v.shape != k.shape:
        raise ShapeError(f"k.shape={k.shape}, v.shape={v.shape}: expected both [B={b}, Hkv, C, D={d}]")
    if hkv == 0 or hq % hkv:
        raise ShapeError(f"Hq={hq} must be a positive multiple of Hkv={hkv} (query head h reads KV head h // G)")
    if pos.shape != (b, hkv, c) or q_pos.shape != (b,):
        raise ShapeError(f"pos.shape={pos.shape}, q_pos.shape={q_pos.shape}: expected [B, Hkv, C]={(b, hkv, c)} "
                         f"and [B]={(b,)}")
    if np.dtype(k.dtype) not in (np.float32, np.float16) or v.dtype != k.dtype:
        raise DTypeError(f"k.dtype={k.dtype}, v.dtype={v.dtype}: the slots must be both float32 or both float16")
    for name, a in (("pos", pos), ("q_pos", q_pos)):
        if not np.issubdtype(np.dtype(a.dtype), np.integer):
            raise DTypeError(f"{name}.dtype={a.dtype}: positions are integers (int64 or int32)")
    return b, hq, hkv, c, d


def _check_policy(window, sinks, rope, group: int, d: int) -> int:
    """The rope_mode of a valid window/sinks/rope/group (ConfigError otherwise)."""
    check_int("window", window, minimum=0, hint="the policy's window W (0: no window rule, causal only)")
    if window:
        check_int("sinks", sinks, minimum=0, maximum=window - 1, error=ConfigError,
                  hint=f"sinks must leave room for the recent tokens: 0 <= S < W={window}")
    elif sinks != 0:
        raise ConfigError(f"sinks={sinks} with window=0: sinks belong to a window policy (pass window=W)")
    if rope is not None and not window:
        raise ConfigError("rope (in-cache positions) ranks keys by the window policy's rule: pass window=W > 0")
    if group > 32 or _static_smem(d) + 4 * group * d > STATIC_SMEM_LIMIT:
        raise ConfigError(f"{group} query heads per KV head at head_dim={d}: window_decode_v1 keeps one warp "
                          "and one shared row per query head; use at most 32 and keep G*D*4 bytes + its tiles "
                          f"under {STATIC_SMEM_LIMIT} bytes")
    if rope is None:
        return 0
    if not (isinstance(rope, tuple) and len(rope) == 3):
        raise InvalidInputError("rope must be (cos, sin, layout) with tables [max_position, D/2]")
    return ROPE_MODES[check_choice("rope layout", rope[2], ROPE_LAYOUTS)]


def _positions(rt, a, name: str):
    """Host or device integer positions as device int32 (InvalidInputError past int32)."""
    host = rt.asnumpy(a) if isinstance(a, rt.xp.ndarray) and rt.xp is not np else np.asarray(a)
    if host.size and (host.max() > _INT32_MAX or host.min() < -1):
        raise InvalidInputError(f"{name} must lie in -1 .. {_INT32_MAX} (int32 on the device)")
    return rt.asarray(host.astype(np.int32))


def _tables(rt, rope, d: int, max_rank: int):
    """cos/sin as device float32 [P, D/2] with P > max_rank (dummies when rope is None)."""
    if rope is None:
        dummy = rt.asarray(np.zeros(1, np.float32))
        return dummy, dummy
    cos, sin = rope[0], rope[1]
    if cos.shape != sin.shape or cos.ndim != 2 or cos.shape[1] != d // 2:
        raise ShapeError(f"rope tables cos {cos.shape}, sin {sin.shape}: expected both [max_position, D/2={d // 2}]")
    if max_rank >= cos.shape[0]:
        raise InvalidInputError(f"rope tables have {cos.shape[0]} rows, but a rank reaches {max_rank}")
    return device_f32(rt, cos, "rope cos"), device_f32(rt, sin, "rope sin")


WINDOW_VERSIONS = (1, 3, 4)  # window_decode_v1 (tiles in shared memory; the mass), _v3, _v4 (register-resident)


def _refusal(group: int, head_dim: int, want_mass: bool) -> tuple[type, str] | None:
    """Why window_decode_v3/v4 cannot serve a call (None when they can)."""
    if want_mass:
        return ConfigError, "window_decode_v3/v4 have no mass output (H2O's); use version=1 or None"
    return decode_refusal(group, head_dim, True)


def window_decode(q, k, v, pos, q_pos, window: int = 0, sinks: int = 0, rope: tuple | None = None,
                  want_mass: bool = False, *, sink_logits=None, softcap: float | None = None,
                  version: int | None = None, runtime=None):
    """One decode query per sequence over its slots (see the module docstring); device arrays back.

    q: [B, Hq, D] float32 (pre-RoPE with ``rope``); k, v: [B, Hkv, C, D] float32 or float16 (pre-RoPE
    keys with ``rope``); pos: [B, Hkv, C] integer (-1 empty); q_pos: [B] integer.
    Returns out [B, Hq, D] float32 (, mass [B, Hkv, C] float32 if ``want_mass``).
    version: 1, 3, 4 (register-resident, no mass) or None (4 where it serves the call, else 1).
    sink_logits: [Hq] float32 learned sink logits, softcap: a positive cap (module docstring), or None.
    """
    rt = get_runtime(runtime)
    b, hq, hkv, c, d = _check_shapes(q, k, v, pos, q_pos)
    defines = {**head_dim_defines(d), "CACHE_HALF": int(np.dtype(k.dtype) == np.float16)}
    group = hq // hkv
    mode = _check_policy(window, sinks, rope, group, d)
    options = score_options(rt, hq, sink_logits, softcap)
    ver = choose_version(version, None, _refusal(group, d, want_mass), lambda: 1, WINDOW_VERSIONS)
    qp = _positions(rt, q_pos, "q_pos")
    max_rank = min(int(rt.asnumpy(qp).max(initial=0)), window - 1)
    cos, sin = _tables(rt, rope, d, max_rank)
    xp = rt.xp
    kd, vd = (a if isinstance(a, xp.ndarray) else rt.asarray(a) for a in (k, v))
    kd, vd = xp.ascontiguousarray(kd), xp.ascontiguousarray(vd)
    out = xp.zeros((b, hq, d), dtype=np.float32)
    mass = xp.zeros((b, hkv, c) if want_mass else (1,), dtype=np.float32)
    if b and c:
        common = (_positions(rt, pos, "pos"), qp, cos, sin, out)
        scalars = (np.int32(hq), np.int32(hkv), np.int32(c), np.int32(window), np.int32(sinks), np.int32(mode),
                   np.float32(1.0 / np.sqrt(d))) + options
        qd = device_f32(rt, q, "q")
        if ver >= 3:
            kern = rt.kernel("window", f"window_decode_v{ver}", defines=decode_defines(defines, group))
            kern((b, hkv), (DECODE_THREADS,), (qd, kd, vd) + common + scalars)
        else:
            kern = rt.kernel("window", "window_decode_v1", defines=defines)
            kern((b, hkv), (32 * group,), (qd, kd, vd) + common + (mass, np.int32(bool(want_mass))) + scalars,
                 shared_mem=4 * group * d)
    return (out, mass) if want_mass else out


class Visible:
    """``visible(k_pos) -> [Hkv, T, K]`` as ``minikv.window.ring.attend_slots`` takes it, ``policy.visible(q_pos,
    k_pos)`` at the queries' positions, in a form the GPU can read: the policy (its window and sinks) and
    q_pos [T]. The NumPy function takes it as well, so one call runs on either side."""

    def __init__(self, policy, q_pos):
        self.policy, self.q_pos = policy, np.asarray(q_pos)

    def __call__(self, k_pos):
        return self.policy.visible(self.q_pos, k_pos)


def _batched(k, v, k_pos, t: int):
    """One query per "sequence": the slots [Hkv, K, ...] repeated for each of the T queries."""
    return tuple(np.ascontiguousarray(np.broadcast_to(a, (t,) + a.shape)) for a in (k, v, k_pos))


def attend_slots(q, tiles: list, visible, mass_rows=None, *, sinks=None, softcap: float | None = None,
                 version: int | None = None, runtime=None):
    """``minikv.window.ring.attend_slots`` on the GPU: q [T, Hq, D] over tiles of (k [Hkv, K, D], v, k_pos [Hkv, K]).

    visible: a ``Visible(policy, q_pos)`` (a window policy's rule, or the causal one of Policy, H2O, SnapKV);
    mass_rows: [T] bool or None, as the reference: then also each tile's mass and seen counts [Hkv, K],
    summed over the selected queries; sinks ([Hq] learned sink logits), softcap: as the reference's.
    Returns out [T, Hq, D] (, masses, seens) on the device.
    """
    if not isinstance(visible, Visible):
        raise ConfigError("the GPU attend_slots reads the visibility rule itself: pass "
                          "minikv_gpu.window.Visible(policy, q_pos) (NumPy's attend_slots takes it too)")
    window, sink_tokens = _policy_args(visible.policy)
    k, v, pos = (np.concatenate([np.asarray(tile[i]) for tile in tiles], axis=1) for i in range(3))
    t = q.shape[0]
    want = mass_rows is not None
    res = window_decode(q, *_batched(k, v, pos, t), visible.q_pos, window, sink_tokens, None, want, sink_logits=sinks,
                        softcap=softcap, version=version, runtime=runtime)
    if not want:
        return res
    rt, rows = get_runtime(runtime), np.asarray(mass_rows, bool)
    mass = rt.asnumpy(res[1])[rows].sum(0)                                    # [Hkv, K] over the selected queries
    seen = visible(pos)[:, rows].sum(1).astype(np.int64)                       # [Hkv, K]
    cuts = np.cumsum([tile[0].shape[1] for tile in tiles])[:-1]
    return res[0], np.split(mass, cuts, axis=1), np.split(seen, cuts, axis=1)


def attend_in_cache(q_pre, k_pre, v, k_pos, q_pos, visible, rope: tuple, *, version: int | None = None,
                    runtime=None):
    """``minikv.window.ring.attend_in_cache`` on the GPU: pre-RoPE q [T, Hq, D] over pre-RoPE k [Hkv, K, D], every
    visible key rotated by its rank, each query by its own. visible: a window policy's ``visible`` method
    (the kernel knows its rule in closed form); rope = (cos, sin, layout). Returns [T, Hq, D] on the device."""
    policy = getattr(visible, "__self__", None)
    if not isinstance(policy, _cpu.WindowPolicy):
        raise ConfigError("the GPU attend_in_cache ranks keys by the window policy's closed form: pass "
                          "policy.visible of a minikv.window.ring.WindowPolicy")
    t = q_pre.shape[0]
    return window_decode(q_pre, *_batched(k_pre, v, k_pos, t), np.asarray(q_pos), policy.window,
                         policy.sinks, rope, version=version, runtime=runtime)


def _policy_args(policy) -> tuple[int, int]:
    """(window, sinks) of the kernel's visibility for ``policy`` (the window's, else causal only)."""
    if isinstance(policy, _cpu.WindowPolicy):
        return policy.window, policy.sinks
    if type(policy).visible is not _cpu.Policy.visible:
        raise ConfigError(f"policy {policy.name!r} has its own visibility rule; the GPU kernel knows the window "
                          "policy's and the causal one")
    return 0, 0


class EvictingKVCache(_cpu.EvictingKVCache):
    """``minikv.window.ring.EvictingKVCache`` whose single-token decode steps run ``window_decode`` (v3, or v1 when the
    policy needs each key's mass, as H2O does).

    Arguments as the NumPy class, plus ``runtime`` (a backend name or Runtime; None: the default).
    A step in which every sequence brings exactly one token is attended on the device: the slots of
    the batch plus each sequence's new token as one more slot (so one launch for the batch), with
    the policy's masses (H2O) from the kernel's mass output. Prefill and multi-token steps fall back
    to the inherited NumPy ``attend``; the storage and all bookkeeping are the NumPy class's.
    ``attend`` returns host float32 arrays, as the NumPy class.
    """

    def __init__(self, *args, runtime=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.rt = get_runtime(runtime)
        self.window_args = _policy_args(self.policy)
        self.gpu_steps = 0  # how many attend calls ran on the kernel (tests check the routing)

    def attend(self, layer: int, q: np.ndarray, sinks: np.ndarray | None = None,
               softcap: float | None = None) -> np.ndarray:
        """q: [N, Hq, D] -> [N, Hq, D] host float32; sinks ([Hq] learned sink logits) and softcap as the NumPy
        class's (refused there for in-cache positions, so such a step takes its path)."""
        step = self._require_step()
        options = sinks is not None or softcap is not None
        if (step.num_tokens != len(step.seq_ids) or layer not in self._stash or self.dtype != np.float32
                or (options and self.rotates_in_cache)):
            return super().attend(layer, q, sinks=sinks, softcap=softcap)
        self._check_layer(layer)
        k_new, v_new, masses = self._stash[layer]
        seqs = [self._seqs[sid] for sid in step.seq_ids]
        width = max(s.pos.shape[-1] for s in seqs) + 1  # the widest sequence's slots + the new token
        shape = (len(seqs), self.num_kv_heads, width)
        k, v = np.zeros(shape + (self.head_dim,), self.dtype), np.zeros(shape + (self.head_dim,), self.dtype)
        pos = np.full(shape, -1, dtype=np.int64)
        for i, s in enumerate(seqs):
            c = s.pos.shape[-1]
            k[i, :, :c], v[i, :, :c], pos[i, :, :c] = s.k[layer], s.v[layer], s.pos[layer]
            k[i, :, -1], v[i, :, -1], pos[i, :, -1] = k_new[i], v_new[i], step.positions[i]
        rows = [self.policy.mass_queries(int(step.past[i]), 1) for i in range(len(seqs))]
        want = any(r is not None and r.any() for r in rows)
        window, sink_tokens = self.window_args
        res = window_decode(np.ascontiguousarray(q, dtype=np.float32), k, v, pos, step.positions, window, sink_tokens,
                            self.rope if self.rotates_in_cache else None, want, sink_logits=sinks, softcap=softcap,
                            runtime=self.rt)
        self.gpu_steps += 1
        out = self.rt.asnumpy(res[0] if want else res)
        if want:
            self._keep_masses(masses, seqs, rows, pos, step.positions, self.rt.asnumpy(res[1]))
        return out

    def _keep_masses(self, masses: dict, seqs: list, rows: list, pos, q_pos, mass) -> None:
        """Stash each sequence's (mass, seen) per tile (slots, new token), as the NumPy ``attend`` does."""
        for i, s in enumerate(seqs):
            if rows[i] is None:
                continue
            c, on = s.pos.shape[-1], bool(rows[i][0])
            seen = self.policy.visible(q_pos[i:i + 1], pos[i])[:, 0].astype(np.int64) * on  # [Hkv, width]
            m = mass[i].astype(np.float64) * on
            masses[i] = ((m[:, :c], m[:, -1:]), (seen[:, :c], seen[:, -1:]))
