"""The MPI programs of tests/test_parallel.py: ``mpiexec -n W python tests/parallel_worker.py MODE ARGS``.

MODE cases CASES.json OUTDIR: run every case (a model, dtype, cache kind, tp, cp) on the first tp x cp
    ranks of the world (one sub-communicator per size), teacher-forced and greedy; the case's rank 0
    writes OUTDIR/<name>.npz (logits, tokens, cache bytes per rank) and <name>.json (the traces).
MODE faults: rank 1 feeds an out-of-range token (caught on every rank, printed, then a good step
    runs), then rank 2's cache is too small for the prompt (uncaught: every rank exits 1 with it).
MODE abort: rank 1 raises inside a layer, after the step's check: the backstop aborts every rank.

The pytest side builds the same models with ``build_model`` and runs them in one process.
"""

from __future__ import annotations

import json
import pickle
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from any folder: import this checkout's minikv
    sys.path.insert(0, str(ROOT))

from minikv.model import ModelWeights  # noqa: E402


class Weights:
    """A model's config, weights and dtype, as ``ParallelModel`` reads them (memory-mapped: a rank copies
    only its share)."""

    def __init__(self, config, weights, dtype):
        self.config, self.weights, self.dtype = config, weights, dtype


def dump_weights(model, folder: Path) -> Path:
    """Write a model's weights as .npy files (one per array) and its config, for ``load_weights``."""
    folder.mkdir(parents=True, exist_ok=True)
    w = model.weights
    arrays = {"embed": w.embed, "final_norm": w.final_norm}
    if w.lm_head is not None:
        arrays["lm_head"] = w.lm_head
    for i, lw in enumerate(w.layers):
        arrays.update({f"{i}.{k}": v for k, v in vars(lw).items() if v is not None})
    for k, v in arrays.items():
        np.save(folder / f"{k}.npy", v)
    layer_kind = type(w.layers[0])
    (folder / "meta.pkl").write_bytes(pickle.dumps((model.config, layer_kind, np.dtype(model.dtype).name)))
    return folder


def load_weights(folder: Path) -> Weights:
    config, layer_kind, dtype = pickle.loads((folder / "meta.pkl").read_bytes())
    get = lambda name: np.load(folder / f"{name}.npy", mmap_mode="r") if (folder / f"{name}.npy").exists() \
        else None  # noqa: E731
    names = layer_kind.__dataclass_fields__
    layers = [layer_kind(**{k: get(f"{i}.{k}") for k in names}) for i in range(config.num_layers)]
    return Weights(config, ModelWeights(get("embed"), layers, get("final_norm"), get("lm_head")), np.dtype(dtype).type)


def save_checkpoint(model, folder: Path) -> Path:
    """A Hugging Face checkpoint directory (config.json + model.safetensors) of a random minikv model:
    LlamaForCausalLM (half-split RoPE) or DeepseekV3ForCausalLM (plain q_proj, no biases), for the CLI."""
    from safetensors.numpy import save_file

    c, w = model.config, model.weights
    cfg = dict(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
               num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads, rms_norm_eps=c.rms_eps,
               max_position_embeddings=c.max_position, tie_word_embeddings=w.lm_head is None,
               rope_theta=c.rope_theta, eos_token_id=None, bos_token_id=None)
    t = {"model.embed_tokens.weight": w.embed, "model.norm.weight": w.final_norm}
    names = dict(w_gate="mlp.gate_proj", w_up="mlp.up_proj", w_down="mlp.down_proj", wo="self_attn.o_proj",
                 wq="self_attn.q_proj", wk="self_attn.k_proj", wv="self_attn.v_proj",
                 wkv_a="self_attn.kv_a_proj_with_mqa", wkv_b="self_attn.kv_b_proj")
    norms = dict(attn_norm="input_layernorm", mlp_norm="post_attention_layernorm", kv_a_norm="self_attn.kv_a_layernorm")
    for i, lw in enumerate(w.layers):
        for k, v in vars(lw).items():
            if v is not None:
                name = f"model.layers.{i}.{names.get(k) or norms[k]}.weight"
                t[name] = v.T if k in names else v  # torch's Linear stores [out, in]
    if c.mla is None:
        cfg.update(architectures=["LlamaForCausalLM"], num_key_value_heads=c.num_kv_heads, head_dim=c.head_dim)
    else:
        m = c.mla
        cfg.update(architectures=["DeepseekV3ForCausalLM"], kv_lora_rank=m.kv_lora_rank, q_lora_rank=None,
                   qk_nope_head_dim=m.qk_nope_head_dim, qk_rope_head_dim=m.qk_rope_head_dim,
                   v_head_dim=m.v_head_dim, rope_interleave=m.rope_interleave, first_k_dense_replace=c.num_layers)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg))
    save_file({k: np.ascontiguousarray(v, dtype=np.float32) for k, v in t.items()}, str(folder / "model.safetensors"))
    return folder


def build_model(spec: dict, dtype: str):
    """The model of a case: {"kind": "gqa"|"mla", **random_model kwargs} (mla: "mla" = default_mla kwargs)."""
    from minikv.weights.random_models import default_mla, random_mla_model, random_model

    spec = dict(spec)
    kind = spec.pop("kind")
    if kind == "weights":
        return load_weights(Path(spec["folder"]))
    if kind == "mla":
        return random_mla_model(mla=default_mla(**spec.pop("mla", {})), dtype=np.dtype(dtype).type, **spec)
    return random_model(dtype=np.dtype(dtype).type, **spec)


def teacher_forced(model, cache, ids: list[int], prefill: int) -> tuple[np.ndarray, list]:
    """Logits [len(ids), V] of ids fed through ``cache`` (a prefill, then one token a step), and the
    trace of the first and the last step (a ParallelModel's; [] for a Model)."""
    rows = [model.forward([ids[:prefill]], cache, all_logits=True)]
    traces = [list(getattr(model, "trace", []))]
    for t in ids[prefill:]:
        rows.append(model.forward([[t]], cache))
    traces.append(list(getattr(model, "trace", [])))
    return np.concatenate(rows), traces


def run_case(case: dict, comm, out: Path) -> None:
    from minikv.parallel import ParallelModel, generate

    model = build_model(case["model"], case["dtype"])
    pm = ParallelModel(model, tp=case["tp"], cp=case["cp"], comm=comm)
    opts, ids = case.get("options", {}), case["ids"]
    kv = pm.make_cache(case["cache"], len(ids), block_size=case.get("block_size", 16), **opts)
    kv.add_sequence(0)
    logits, traces = teacher_forced(pm, kv, ids, case["prefill"])
    tf_bytes = pm.cache_bytes_per_rank(kv)
    res = generate(pm, case["prompt"], case["new"], cache=case["cache"], block_size=case.get("block_size", 16),
                   **opts)
    if comm.Get_rank() == 0:
        np.savez(out / f"{case['name']}.npz", logits=logits, tokens=np.array(res.token_ids))
        trace = [[[c.kind, c.group, list(c.shape), c.dtype, c.bytes] for c in t] for t in traces]
        (out / f"{case['name']}.json").write_text(json.dumps({
            "trace": trace, "cache_bytes": pm.cache_bytes, "tf_cache_bytes": tf_bytes, **pm.describe()}))


def cases(path: str, outdir: str) -> None:
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    todo = json.loads(Path(path).read_text())
    sizes = sorted({c["tp"] * c["cp"] for c in todo})
    comms = {n: world.Split(0 if world.rank < n else MPI.UNDEFINED, world.rank) for n in sizes}
    for case in todo:
        comm = comms[case["tp"] * case["cp"]]
        if comm != MPI.COMM_NULL:
            run_case(case, comm, Path(outdir))


def _tiny():
    from minikv.weights.random_models import random_model

    return random_model(num_heads=9, num_kv_heads=3, hidden_size=36, intermediate_size=50, vocab_size=97,
                        dtype=np.float64)


def faults() -> None:
    from mpi4py import MPI

    from minikv.errors import MinikvError
    from minikv.parallel import ParallelModel

    world = MPI.COMM_WORLD
    pm = ParallelModel(_tiny(), tp=world.size)
    kv = pm.make_cache("contiguous", 8)
    kv.add_sequence(0)
    try:  # a bad input on one rank: every rank raises, and the step leaves every cache unchanged
        pm.forward([[1, 2, 97 if world.rank == 1 else 3]], kv)
    except MinikvError as e:
        print(f"caught on rank {world.rank}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
    pm.forward([[1, 2, 3]], kv)
    print(f"recovered on rank {world.rank}: length {kv.length(0)}", file=sys.stderr, flush=True)
    full = pm.make_cache("contiguous", 2 if world.rank == 2 else 8)  # a full cache on one rank
    full.add_sequence(0)
    try:
        pm.forward([[4, 5, 6]], full)
    except MinikvError as e:
        print(f"exiting on rank {world.rank}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        sys.exit(1)


def abort() -> None:
    from mpi4py import MPI

    from minikv.parallel import ParallelModel, abort_on_error

    world = MPI.COMM_WORLD
    pm = ParallelModel(_tiny(), tp=world.size)
    kv = pm.make_cache("contiguous", 8)
    kv.add_sequence(0)
    if world.rank == 1:  # fails inside layer 0, after the step's check: the others wait in an all-reduce
        kv.attend = lambda layer, q: (_ for _ in ()).throw(RuntimeError("attention broke on rank 1"))
    with abort_on_error(pm.world):
        pm.forward([[1, 2, 3]], kv)
    print(f"rank {world.rank} finished", flush=True)


def device(outdir: str) -> None:
    """tp = world size with each rank's share on its device (the simulator without a GPU); rank 0 writes
    the teacher-forced logits of a GQA and an MLA model."""
    from mpi4py import MPI

    from minikv_gpu.parallel import DeviceParallelModel

    world = MPI.COMM_WORLD
    gqa = dict(kind="gqa", num_heads=9, num_kv_heads=3, hidden_size=36, intermediate_size=50, vocab_size=97)
    mla = dict(kind="mla", mla=dict(kv_lora_rank=16, qk_rope_head_dim=8))  # the GPU kernel's multiples of 8
    for name, spec in (("device-gqa", gqa), ("device-mla", mla)):
        pm = DeviceParallelModel(build_model(spec, "float32"), tp=world.size, comm=world)
        kv = pm.new_cache(1, 8)
        kv.add_sequence(0)
        ids = [5, 17, 3, 88, 41, 9, 60, 2]
        rows = [pm.rt.asnumpy(pm.forward([ids[:5]], kv, all_logits=True))]
        rows += [pm.rt.asnumpy(pm.forward([[t]], kv)) for t in ids[5:]]
        if world.rank == 0:
            np.savez(Path(outdir) / f"{name}.npz", logits=np.concatenate(rows), ids=np.array(ids),
                     collectives=len(pm.trace))


if __name__ == "__main__":
    mode = sys.argv[1]
    try:
        {"cases": lambda: cases(*sys.argv[2:4]), "faults": faults, "abort": abort,
         "device": lambda: device(sys.argv[2])}[mode]()
    except Exception:  # a bug in a case: abort every rank rather than leave them in a collective
        import traceback

        from mpi4py import MPI

        traceback.print_exc()
        sys.stderr.flush()
        MPI.COMM_WORLD.Abort(1)
