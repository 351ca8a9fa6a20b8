"""Builds a tiny Qwen3-MoE checkpoint locally (no hub): config.json, seeded random weights in
model.safetensors, and a word-level tokenizer (tokenizer.json + tokenizer_config.json) that
``AutoTokenizer.from_pretrained(DIR)`` loads offline.

    python model.py DIR

8 experts, top-2, 2 layers, hidden 128 (the CPU MoE kernel wants hidden and intermediate
sizes divisible by 32), vocabulary of 512 words ("w0" ... "w509" and two specials).
"""

import json
import os
import sys

VOCAB = 512
HIDDEN = 128
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 32
EXPERTS, TOPK = 8, 2
MOE_INTER = 64
LAYERS = 2
SEED = 1234
EOS = VOCAB - 1


def config():
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "vocab_size": VOCAB,
        "hidden_size": HIDDEN,
        "intermediate_size": 256,
        "moe_intermediate_size": MOE_INTER,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "num_experts": EXPERTS,
        "num_experts_per_tok": TOPK,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "hidden_act": "silu",
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "attention_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "bos_token_id": EOS,
        "eos_token_id": EOS,
    }


def weights():
    import torch

    g = torch.Generator().manual_seed(SEED)

    def rnd(*shape, scale=0.08):
        return (torch.randn(*shape, generator=g) * scale).to(torch.float32)

    def ones(n):
        return (1.0 + 0.1 * torch.randn(n, generator=g)).to(torch.float32)

    w = {"model.embed_tokens.weight": rnd(VOCAB, HIDDEN, scale=0.5)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = ones(HIDDEN)
        w[p + "post_attention_layernorm.weight"] = ones(HIDDEN)
        w[p + "self_attn.q_proj.weight"] = rnd(HEADS * HEAD_DIM, HIDDEN)
        w[p + "self_attn.k_proj.weight"] = rnd(KV_HEADS * HEAD_DIM, HIDDEN)
        w[p + "self_attn.v_proj.weight"] = rnd(KV_HEADS * HEAD_DIM, HIDDEN)
        w[p + "self_attn.o_proj.weight"] = rnd(HIDDEN, HEADS * HEAD_DIM)
        w[p + "self_attn.q_norm.weight"] = ones(HEAD_DIM)
        w[p + "self_attn.k_norm.weight"] = ones(HEAD_DIM)
        # A router with a wide spread, so tokens really go to different experts.
        w[p + "mlp.gate.weight"] = rnd(EXPERTS, HIDDEN, scale=0.5)
        for e in range(EXPERTS):
            q = f"{p}mlp.experts.{e}."
            w[q + "gate_proj.weight"] = rnd(MOE_INTER, HIDDEN, scale=0.2)
            w[q + "up_proj.weight"] = rnd(MOE_INTER, HIDDEN, scale=0.2)
            w[q + "down_proj.weight"] = rnd(HIDDEN, MOE_INTER, scale=0.2)
    w["model.norm.weight"] = ones(HIDDEN)
    w["lm_head.weight"] = rnd(VOCAB, HIDDEN, scale=0.5)
    return w


def tokenizer(path):
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders

    vocab = {f"w{i}": i for i in range(VOCAB - 2)}
    vocab["<unk>"] = VOCAB - 2
    vocab["<|endoftext|>"] = EOS
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({
            "tokenizer_class": "PreTrainedTokenizerFast",
            "unk_token": "<unk>",
            "eos_token": "<|endoftext|>",
            "pad_token": "<|endoftext|>",
            "model_max_length": 512,
        }, f, indent=1)


def build(path):
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config(), f, indent=1)
    save_file(weights(), os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    tokenizer(path)
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": EOS, "bos_token_id": EOS}, f)


if __name__ == "__main__":
    build(sys.argv[1])
    print(sys.argv[1])
