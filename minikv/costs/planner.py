"""The KV capacity planner: how much cache a model needs, per layer type, and what a budget buys.

Any config.json (a Hugging Face directory, a bare file, or one of ``PLANS``' real configs), or any of
``minikv.costs``' presets (``plan_from_shape``), becomes a ``KVPlan``: per layer, the values one token
stores (K and V: 2 x Hkv x D; an MLA layer caches one latent of kv_lora_rank + rope_dim) and the keys it
keeps (a full layer: the whole context C; a sliding layer: min(C, W)). From that, at a KV dtype of
``itemsize`` bytes and a block size b (a paged cache allocates whole blocks, so a layer holding n tokens
pays for ceil(n / b) * b):

    bytes_per_sequence(C) = sum_l  ceil(min(C, W_l) / b) * b * values_l * itemsize
    max_sequences(budget, C) = floor(budget / bytes_per_sequence(C))
    max_context(budget, N)   = the largest C with N * bytes_per_sequence(C) <= budget

and the **waste of all-full sizing**: an engine that gives every layer a full layer's C slots (vLLM
before its hybrid allocator) wastes 1 - per_layer / all_full of what it reserves. vLLM's RFC #11382
(https://github.com/vllm-project/vllm/issues/11382) states it for BLOCK_SIZE=1: "The memory waste can
be 79.6% in mllama, 25% in Gemma-2, and 56.25% in Ministral"; ``tests/test_planner.py`` reproduces
the last two (Gemma-2: half the layers slide over 4096 of an 8192 context; Ministral-8B: one full
layer per three sliding, windows of 32k in a 128k context).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from minikv.costs.presets import PRESETS
from minikv.costs.shape import ModelShape
from minikv.errors import ModelFileNotFoundError, ModelFormatError
from minikv.weights.families import qwen_layer_types
from minikv.weights.gemma import gemma3_layer_types

KV_ITEMSIZE = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1, "int8": 1}


@dataclass(frozen=True)
class KVPlan:
    """A model's cache geometry, layer by layer.

    layers:       tuple of (window or None, values per token) per layer: W of a sliding layer (None: full),
                  and the cached numbers one token adds to that layer (2 Hkv D, or the MLA latent's width)
    max_position: the longest context the model takes
    """

    name: str
    layers: tuple
    max_position: int
    source: str = ""

    def by_type(self, itemsize: int) -> dict:
        """{layer type: (layers, bytes per token per layer)}: "full" or "sliding W"."""
        out: dict = {}
        for w, values in self.layers:
            key = "full" if w is None else f"sliding {w}"
            n, b = out.get(key, (0, values * itemsize))
            out[key] = (n + 1, b)
        return out

    def bytes_per_sequence(self, context: int, itemsize: int, block_size: int = 1, all_full: bool = False) -> int:
        """Bytes one sequence of ``context`` tokens holds: each layer's kept tokens rounded up to whole blocks."""
        total = 0
        for w, values in self.layers:
            kept = context if (w is None or all_full) else min(context, w)
            total += -(-kept // block_size) * block_size * values * itemsize
        return total

    def waste_of_all_full(self, context: int, block_size: int = 1) -> float:
        """1 - per-layer / all-full: the share of an all-full reservation that sliding layers never use."""
        return 1.0 - self.bytes_per_sequence(context, 1, block_size) / self.bytes_per_sequence(context, 1, block_size,
                                                                                              all_full=True)

    def max_sequences(self, budget: int, context: int, itemsize: int, block_size: int = 1) -> int:
        return budget // self.bytes_per_sequence(context, itemsize, block_size)

    def max_context(self, budget: int, sequences: int, itemsize: int, block_size: int = 1) -> int:
        """The longest context (<= max_position) at which ``sequences`` sequences fit in ``budget``; 0 if none."""
        lo, hi = 0, self.max_position
        while lo < hi:  # bytes_per_sequence grows with the context: bisect
            mid = (lo + hi + 1) // 2
            if sequences * self.bytes_per_sequence(mid, itemsize, block_size) <= budget:
                lo = mid
            else:
                hi = mid - 1
        return lo


def _windows(cfg: dict, n: int) -> list:
    """Each layer's window (None: full) from config.json, as each family defines it (the loaders' rules:
    ``minikv.weights.families.qwen_layer_types``, ``minikv.weights.gemma.gemma3_layer_types``)."""
    w = cfg.get("sliding_window")
    kind = cfg.get("model_type", "")
    types = cfg.get("layer_types")
    if not types and kind in ("qwen2", "qwen3"):  # use_sliding_window defaults to False; then max_window_layers
        types = qwen_layer_types(n, w, cfg.get("use_sliding_window") is True, int(cfg.get("max_window_layers", 28)))
    if types:
        return [w if t == "sliding_attention" else None for t in types]
    if w is None or cfg.get("use_sliding_window") is False:
        return [None] * n
    if kind in ("gemma2", "gpt_oss"):  # even layers slide
        return [w if i % 2 == 0 else None for i in range(n)]
    if kind in ("gemma3", "gemma3_text"):  # every pattern-th layer is full
        return [w if t == "sliding_attention" else None
                for t in gemma3_layer_types(n, int(cfg.get("sliding_window_pattern", 6)))]
    return [w] * n  # Mistral: every layer


def plan_from_config(cfg: dict, name: str = "config.json", source: str = "") -> KVPlan:
    """A ``KVPlan`` from a config.json dict (``text_config`` of a multimodal one is read); ModelFormatError
    naming a missing field."""
    cfg = {**cfg, **cfg.get("text_config", {})}
    try:
        n = int(cfg["num_hidden_layers"])
        if cfg.get("kv_lora_rank"):  # MLA: one latent of r + dr per token and layer, K and V together
            values = int(cfg["kv_lora_rank"]) + int(cfg["qk_rope_head_dim"])
        else:
            heads = int(cfg["num_attention_heads"])
            d = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads)
            values = 2 * int(cfg.get("num_key_value_heads") or heads) * d
    except KeyError as e:
        raise ModelFormatError(f"{name} lacks {e.args[0]!r}, which the KV planner needs") from None
    try:
        windows = _windows(cfg, n)
    except (TypeError, ValueError) as e:  # e.g. a max_window_layers or sliding_window_pattern that is no integer
        raise ModelFormatError(f"{name}: its layer pattern cannot be read ({e}); fix layer_types, "
                               "max_window_layers or sliding_window_pattern") from None
    if len(windows) != n:
        raise ModelFormatError(f"{name}: layer_types names {len(windows)} layers, num_hidden_layers is {n}")
    return KVPlan(name, tuple((w, values) for w in windows), int(cfg.get("max_position_embeddings") or 4096),
                  source)


def plan_from_shape(shape: ModelShape, windows: Sequence | None = None, name: str | None = None,
                    max_position: int | None = None, source: str | None = None) -> KVPlan:
    """The ``KVPlan`` of a ``minikv.costs`` shape: per layer 2 Hkv D values a token (MLA: the latent's
    kv_lora_rank + rope_dim), each layer's window from ``windows`` (default: every layer full); the name,
    context (default ``max_context``, else 4096) and source are the shape's unless given."""
    values = shape.kv_lora_rank + shape.rope_dim if shape.kv_lora_rank else 2 * shape.num_kv_heads * shape.head_dim
    windows = [None] * shape.num_layers if windows is None else list(windows)
    return KVPlan(name or shape.name, tuple((w, values) for w in windows),
                  max_position or shape.max_context or 4096, shape.source if source is None else source)


def preset_names() -> list:
    """Every name ``plan_from_path`` knows: ``PLANS`` (the planner's own configs) and the ``minikv.costs``
    presets (``PRESETS``, ``HYBRID_PRESETS``), one model a name."""
    from minikv.costs.hybrid import HYBRID_PRESETS

    return [*PLANS, *(n for n in (*PRESETS, *HYBRID_PRESETS) if n not in PLANS)]


def _preset_plan(name: str) -> KVPlan | None:
    from minikv.costs.hybrid import HYBRID_PRESETS

    if name in PLANS:
        return PLANS[name]
    if name in PRESETS:
        return plan_from_shape(PRESETS[name])
    if name in HYBRID_PRESETS:
        return plan_from_shape(*HYBRID_PRESETS[name])
    return None


def plan_from_path(path) -> KVPlan:
    """A ``KVPlan`` from a Hugging Face directory, a bare config.json, a GGUF file, or a preset name
    (``preset_names``)."""
    plan = _preset_plan(str(path))
    if plan is not None:
        return plan
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        raise ModelFileNotFoundError(f"{path}: no such file, directory with config.json, or preset (presets: "
                                     f"{', '.join(preset_names())})")
    if p.suffix == ".gguf":
        return _plan_from_gguf(p)
    try:
        cfg = json.loads(p.read_text())
    except (OSError, ValueError) as e:
        raise ModelFormatError(f"{p} is not valid JSON: {e}") from None
    return plan_from_config(cfg, str(p))


def _plan_from_gguf(path: Path) -> KVPlan:
    """A GGUF file's metadata: {arch}.block_count, .attention.head_count(_kv), .attention.key_length,
    .attention.sliding_window, .context_length (gemma3: every 6th layer full, as its loader reads it)."""
    from minikv.weights.gguf import _field_value, _open_reader

    reader = _open_reader(path)
    meta = {k: _field_value(f) for k, f in reader.fields.items() if not k.startswith("tokenizer.")}  # vocab: slow
    arch = meta.get("general.architecture")
    g = lambda key, default=None: meta.get(f"{arch}.{key}", default)  # noqa: E731
    if g("block_count") is None:
        raise ModelFormatError(f"{path}: no {arch}.block_count in the GGUF metadata")
    heads = int(g("attention.head_count"))
    cfg = {"num_hidden_layers": int(g("block_count")), "num_attention_heads": heads,
           "num_key_value_heads": int(g("attention.head_count_kv", heads)),
           "head_dim": int(g("attention.key_length", int(g("embedding_length")) // heads)),
           "max_position_embeddings": int(g("context_length", 4096)), "sliding_window": g("attention.sliding_window"),
           "model_type": "gemma3" if arch == "gemma3" else arch}
    return plan_from_config(cfg, str(path))


def _preset(name, source, **cfg) -> KVPlan:
    return plan_from_config(cfg, name, source)


_HF = "https://huggingface.co/{}/blob/main/config.json"
PLANS = {p.name: p for p in (
    _preset("qwen2.5-7b", _HF.format("Qwen/Qwen2.5-7B"), num_hidden_layers=28, num_attention_heads=28,
            num_key_value_heads=4, hidden_size=3584, max_position_embeddings=131072, sliding_window=131072,
            use_sliding_window=False),
    _preset("qwen3-8b", _HF.format("Qwen/Qwen3-8B"), num_hidden_layers=36, num_attention_heads=32,
            num_key_value_heads=8, head_dim=128, max_position_embeddings=40960),
    # Llama 3.1 8B has Llama 3 8B's shapes (minikv.costs' llama3-8b) and a 128k context instead of 8k
    plan_from_shape(PRESETS["llama3-8b"], name="llama-3.1-8b", max_position=131072,
                    source=_HF.format("meta-llama/Llama-3.1-8B") + " (the shapes of llama3-8b, "
                    "max_position_embeddings 131072)"),
    _preset("mistral-7b-v0.1", _HF.format("mistralai/Mistral-7B-v0.1"), num_hidden_layers=32,
            num_attention_heads=32, num_key_value_heads=8, hidden_size=4096, max_position_embeddings=32768,
            sliding_window=4096, model_type="mistral"),
    _preset("gemma-2-9b", _HF.format("google/gemma-2-9b"), num_hidden_layers=42, num_attention_heads=16,
            num_key_value_heads=8, head_dim=256, max_position_embeddings=8192, sliding_window=4096,
            model_type="gemma2"),
    _preset("gemma-3-27b", _HF.format("google/gemma-3-27b-it") + " (text_config)", num_hidden_layers=62,
            num_attention_heads=32, num_key_value_heads=16, head_dim=128, max_position_embeddings=131072,
            sliding_window=1024, sliding_window_pattern=6, model_type="gemma3_text"),
    _preset("gpt-oss-20b", _HF.format("openai/gpt-oss-20b"), num_hidden_layers=24, num_attention_heads=64,
            num_key_value_heads=8, head_dim=64, max_position_embeddings=131072, sliding_window=128,
            model_type="gpt_oss"),
    _preset("gpt-oss-120b", _HF.format("openai/gpt-oss-120b"), num_hidden_layers=36, num_attention_heads=64,
            num_key_value_heads=8, head_dim=64, max_position_embeddings=131072, sliding_window=128,
            model_type="gpt_oss"),
    plan_from_shape(PRESETS["deepseek-v3"], source=_HF.format("deepseek-ai/DeepSeek-V3") + "; DeepSeek-V2 paper "
                    "(arXiv:2405.04434) section 2.1: MLA caches (d_c + d_h^R) values per token and layer"),
    _preset("ministral-8b", "transformers docs/source/en/model_doc/ministral.md (1 full attention layer, then 3 "
            "sliding, 128K context; 32k windows: vLLM PR #9414 caps max_model_len at the smallest window)",
            num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
            max_position_embeddings=131072, sliding_window=32768,
            layer_types=["full_attention" if i % 4 == 0 else "sliding_attention" for i in range(36)]),
)}
