"""Model presets: the shapes of models the seed articles discuss, each with its source.

``PRESETS`` maps a name to a ``ModelShape``; every field cites the config file
or paper it comes from (``ModelShape.source``), so a claim about "Llama-2 13B"
can be checked against the real numbers rather than the article's.
"""

from __future__ import annotations

from minikv.costs.shape import ModelShape
from minikv.errors import ConfigError

_PRESET_LIST = (
    ModelShape(
        name="gpt3-175b", num_layers=96, hidden_size=12288, num_heads=96, num_kv_heads=96, head_dim=128,
        intermediate_size=4 * 12288, vocab_size=50257, mlp="gelu", tie_embeddings=True, bias=True,
        norm="layer", learned_positions=2048, max_context=2048, published_params=175_000_000_000,
        source=("Brown et al. 2020, 'Language Models are Few-Shot Learners', arXiv:2005.14165, Table 2.1 "
                "(n_layers 96, d_model 12288, n_heads 96, d_head 128, n_ctx 2048); GPT-2 architecture "
                "(Radford et al. 2019): d_ff = 4 d_model, GELU MLP, LayerNorm, biases, learned positions, "
                "50257-token BPE vocabulary with tied input/output embeddings")),
    ModelShape(
        name="llama2-7b", num_layers=32, hidden_size=4096, num_heads=32, num_kv_heads=32, head_dim=128,
        intermediate_size=11008, vocab_size=32000, max_context=4096, published_params=7_000_000_000,
        source=("https://huggingface.co/meta-llama/Llama-2-7b-hf/blob/main/config.json; Touvron et al. 2023, "
                "'Llama 2', arXiv:2307.09288, Table 1 (7B: MHA, context 4k)")),
    ModelShape(
        name="llama2-13b", num_layers=40, hidden_size=5120, num_heads=40, num_kv_heads=40, head_dim=128,
        intermediate_size=13824, vocab_size=32000, max_context=4096, published_params=13_000_000_000,
        source=("https://huggingface.co/meta-llama/Llama-2-13b-hf/blob/main/config.json; "
                "Touvron et al. 2023, 'Llama 2', arXiv:2307.09288, Table 1 (13B: MHA, context 4k)")),
    ModelShape(
        name="llama3-8b", num_layers=32, hidden_size=4096, num_heads=32, num_kv_heads=8, head_dim=128,
        intermediate_size=14336, vocab_size=128256, max_context=8192, published_params=8_000_000_000,
        source=("https://huggingface.co/meta-llama/Meta-Llama-3-8B/blob/main/config.json "
                "(32 layers, 32 query heads, 8 KV heads: GQA); Llama Team 2024, "
                "'The Llama 3 Herd of Models', arXiv:2407.21783, Table 3")),
    ModelShape(
        name="llama3-70b", num_layers=80, hidden_size=8192, num_heads=64, num_kv_heads=8, head_dim=128,
        intermediate_size=28672, vocab_size=128256, max_context=131072, published_params=70_000_000_000,
        source=("https://huggingface.co/meta-llama/Meta-Llama-3-70B/blob/main/config.json (80 layers, hidden "
                "8192, 64 query heads, 8 KV heads: GQA, head_dim 8192/64 = 128, intermediate 28672, vocab "
                "128256, untied); Llama-3.1-70B's config.json has the same shapes with "
                "max_position_embeddings 131072 (128k context; Llama-3-70B: 8192); Llama Team 2024, "
                "'The Llama 3 Herd of Models', arXiv:2407.21783, Table 3")),
    ModelShape(
        name="llama3-405b", num_layers=126, hidden_size=16384, num_heads=128, num_kv_heads=8, head_dim=128,
        intermediate_size=53248, vocab_size=128256, max_context=131072, published_params=405_000_000_000,
        source=("https://huggingface.co/meta-llama/Llama-3.1-405B/blob/main/config.json (126 layers, hidden "
                "16384, 128 query heads, 8 KV heads: GQA, head_dim 16384/128 = 128, intermediate 53248, "
                "vocab 128256, untied, max_position_embeddings 131072); Llama Team 2024, "
                "'The Llama 3 Herd of Models', arXiv:2407.21783, Table 3 (405B: 126 layers, model "
                "dimension 16384, FFN dimension 53248, 128 attention heads, 8 key/value heads)")),
    ModelShape(
        name="deepseek-7b", num_layers=30, hidden_size=4096, num_heads=32, num_kv_heads=32, head_dim=128,
        intermediate_size=11008, vocab_size=102400, max_context=4096, published_params=7_000_000_000,
        source=("https://huggingface.co/deepseek-ai/deepseek-llm-7b-base/blob/main/config.json "
                "(num_hidden_layers 30, hidden 4096, 32 heads, 32 KV heads, max_position_embeddings 4096); "
                "DeepSeek-AI 2024, 'DeepSeek LLM', arXiv:2401.02954, Table 2. "
                "Note: 30 layers, not the 32 some articles assume")),
    ModelShape(
        name="deepseek-v2", num_layers=60, hidden_size=5120, num_heads=128, num_kv_heads=128, head_dim=128,
        intermediate_size=12288, vocab_size=102400, kv_lora_rank=512, rope_dim=64, q_lora_rank=1536,
        v_head_dim=128, num_experts=160, experts_per_token=6, shared_experts=2, moe_intermediate_size=1536,
        first_dense_layers=1, max_context=163840, published_params=236_000_000_000,
        source=("https://huggingface.co/deepseek-ai/DeepSeek-V2/blob/main/config.json and DeepSeek-V3's "
                "inference/configs/config_236B.json (60 layers, hidden 5120, 128 heads, kv_lora_rank 512, "
                "qk_rope_head_dim 64, qk_nope_head_dim 128, v_head_dim 128, q_lora_rank 1536, 160 routed + 2 "
                "shared experts of width 1536, 6 active, first layer dense of width 12288, vocab 102400, "
                "max_position_embeddings 163840); DeepSeek-AI 2024, 'DeepSeek-V2', arXiv:2405.04434 "
                "(236B total, 21B active, 128k context)")),
    ModelShape(
        name="deepseek-v2-lite", num_layers=27, hidden_size=2048, num_heads=16, num_kv_heads=16, head_dim=128,
        intermediate_size=10944, vocab_size=102400, kv_lora_rank=512, rope_dim=64, q_lora_rank=0,
        v_head_dim=128, num_experts=64, experts_per_token=6, shared_experts=2, moe_intermediate_size=1408,
        first_dense_layers=1, max_context=32768, published_params=15_700_000_000,
        source=("https://huggingface.co/deepseek-ai/DeepSeek-V2-Lite/blob/main/config.json and DeepSeek-V3's "
                "inference/configs/config_16B.json (27 layers, hidden 2048, 16 heads, kv_lora_rank 512, "
                "qk_rope_head_dim 64, qk_nope_head_dim 128, v_head_dim 128, no query compression "
                "(q_lora_rank null), 64 routed + 2 shared experts of width 1408, 6 active, first layer dense "
                "of width 10944, vocab 102400); the model card: 15.7B total, 2.4B active, 32k context")),
    ModelShape(
        name="deepseek-v3", num_layers=61, hidden_size=7168, num_heads=128, num_kv_heads=128, head_dim=128,
        intermediate_size=18432, vocab_size=129280, kv_lora_rank=512, rope_dim=64, q_lora_rank=1536,
        v_head_dim=128, num_experts=256, experts_per_token=8, shared_experts=1, moe_intermediate_size=2048,
        first_dense_layers=3, max_context=163840, published_params=671_000_000_000,
        source=("https://huggingface.co/deepseek-ai/DeepSeek-V3/blob/main/config.json and "
                "inference/configs/config_671B.json (61 layers, hidden 7168, 128 heads, kv_lora_rank 512, "
                "qk_rope_head_dim 64, qk_nope_head_dim 128, v_head_dim 128, q_lora_rank 1536, 256 routed + 1 "
                "shared experts of width 2048, 8 active, first 3 layers dense of width 18432); DeepSeek-AI "
                "2024, 'DeepSeek-V3 Technical Report', arXiv:2412.19437, Sec. 2.1 and 4.2 (671B total, 37B "
                "active; the 14B multi-token-prediction module is not counted)")),
    ModelShape(
        name="smollm2-135m", num_layers=30, hidden_size=576, num_heads=9, num_kv_heads=3, head_dim=64,
        intermediate_size=1536, vocab_size=49152, tie_embeddings=True, max_context=8192,
        published_params=135_000_000,
        source=("https://huggingface.co/HuggingFaceTB/SmolLM2-135M/blob/main/config.json; "
                "the same shapes are in the SmolLM2-135M-Instruct GGUF that minikv runs "
                "(llama.block_count 30, head_count 9, head_count_kv 3, embedding_length 576, "
                "feed_forward_length 1536)")),
)
PRESETS: dict[str, ModelShape] = {shape.name: shape for shape in _PRESET_LIST}


def get_preset(name: str) -> ModelShape:
    """The preset called ``name`` (see ``PRESETS``); ConfigError lists the choices otherwise."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)} "
                          "or build a ModelShape with its fields") from None

