"""TEST-ONLY: a tiny random Qwen2 HF model directory + a locally trained byte-level BPE tokenizer + a tiny chat
dataset, with no download: python make_tiny_qwen2.py OUT_DIR [moe]  ->  OUT_DIR/model/, OUT_DIR/train.jsonl
(`moe`: a tiny Qwen3-MoE instead: 4 experts, top-2, no shared expert)."""
import json
import os
import sys

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

out = sys.argv[1] if len(sys.argv) > 1 else "tiny-qwen2"
mdir = os.path.join(out, "model")
os.makedirs(mdir, exist_ok=True)

texts = [f"Question {i}: what is {i} plus {i + 1}? Answer: {2 * i + 1}. The quick brown fox jumps over the lazy dog."
         for i in range(200)]
special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
tok = Tokenizer(models.BPE())
tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tok.decoder = decoders.ByteLevel()
tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=384, special_tokens=special,
                                                   initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                 additional_special_tokens=["<|im_start|>", "<|im_end|>"])
hf_tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
hf_tok.save_pretrained(mdir)
vocab = 512  # >= tokenizer size, divisible by 128 (tp)
common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
              tie_word_embeddings=False, torch_dtype="float32",
              bos_token_id=None, eos_token_id=hf_tok.convert_tokens_to_ids("<|im_end|>"),
              pad_token_id=hf_tok.convert_tokens_to_ids("<|endoftext|>"))
torch.manual_seed(0)
if len(sys.argv) > 2 and sys.argv[2] == "moe":
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    cfg = Qwen3MoeConfig(**common, head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                         decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True)
    Qwen3MoeForCausalLM(cfg).save_pretrained(mdir, safe_serialization=True)
else:
    Qwen2ForCausalLM(Qwen2Config(**common)).save_pretrained(mdir, safe_serialization=True)
with open(os.path.join(out, "train.jsonl"), "w") as f:
    for i in range(64):
        f.write(json.dumps({"messages": [{"role": "user", "content": f"what is {i} plus {i + 1}?"},
                                         {"role": "assistant", "content": f"{2 * i + 1}"}]}) + "\n")
print("wrote", mdir, sorted(os.listdir(mdir)), "tokenizer size", len(hf_tok))
