"""Tiny configs of the architectures the engine supports, built offline (no model hub)."""

from __future__ import annotations

from typing import Any

VOCAB = 256
_DECODER = dict(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
)  # fmt: skip
_MOE = dict(num_experts_per_tok=2)


def configs() -> dict[str, Any]:
    """Architecture name -> a tiny ``transformers`` config."""
    import transformers as tf

    return {
        "llama": tf.LlamaConfig(**_DECODER),
        "mistral": tf.MistralConfig(**_DECODER, sliding_window=None),
        "qwen2": tf.Qwen2Config(**_DECODER, tie_word_embeddings=True),
        "gemma2": tf.Gemma2Config(**_DECODER, head_dim=8),
        "gemma3_text": tf.Gemma3TextConfig(**_DECODER, head_dim=8, sliding_window=16),
        "phi3": tf.Phi3Config(**_DECODER, pad_token_id=0, bos_token_id=1, eos_token_id=2),
        "gpt_neox": tf.GPTNeoXConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=64,
            bos_token_id=1,
            eos_token_id=2,
        ),  # fmt: skip
        "opt": tf.OPTConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            ffn_dim=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=64,
            word_embed_proj_dim=32,
        ),  # fmt: skip
        "falcon": tf.FalconConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=64,
            bos_token_id=1,
            eos_token_id=2,
        ),  # fmt: skip
        "gpt2": tf.GPT2Config(
            vocab_size=VOCAB,
            n_positions=64,
            n_embd=32,
            n_layer=2,
            n_head=4,
            bos_token_id=1,
            eos_token_id=2,
        ),  # fmt: skip
        "mixtral": tf.MixtralConfig(**_DECODER, num_local_experts=4, **_MOE),
        "qwen2_moe": tf.Qwen2MoeConfig(
            **_DECODER,
            num_experts=4,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=32,
            **_MOE,
        ),  # fmt: skip
        "olmoe": tf.OlmoeConfig(**_DECODER, num_experts=4, **_MOE),
        "qwen3_moe": tf.Qwen3MoeConfig(
            **_DECODER, num_experts=4, moe_intermediate_size=32, head_dim=8, **_MOE
        ),
    }


MOE = ("mixtral", "qwen2_moe", "olmoe", "qwen3_moe")
