"""The transformers side of tests/hf_llama_e2e_test.cc (run with the venv's python).

  make OUT_DIR TOKENS_FILE SEQ_LEN NUM_WINDOWS
      A tiny random LlamaForCausalLM (grouped-query attention, odd sizes, random norm weights,
      weights large enough that the logits are far from uniform) saved twice by transformers:
      OUT_DIR/single (model.safetensors) and OUT_DIR/sharded (model-0000N-of-0000M.safetensors
      + index); NUM_WINDOWS * SEQ_LEN + 1 random uint16 token ids; then `loss` of both folders
      over all the windows.
  loss SEQ_LEN TOKENS_FILE BEGIN NUM_WINDOWS MODEL_DIR...
      For each folder, loaded with LlamaForCausalLM.from_pretrained, the mean cross-entropy over
      windows w < NUM_WINDOWS of tokens [BEGIN + w * SEQ_LEN, + SEQ_LEN + 1) (inputs and
      shifted targets, as engine/data.h cuts them), in fp32, as one JSON line {dir: loss}.

Exits 3 when transformers cannot be imported, so that the test can skip with a message.
"""
import json
import sys

try:
    import numpy as np
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
except ImportError as e:  # the test skips on exit status 3
    print(f"cannot import transformers/torch/numpy: {e}", file=sys.stderr)
    sys.exit(3)

VOCAB = 97


def make(out_dir, tokens_file, seq_len, num_windows):
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=48, intermediate_size=80,
                         num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2,
                         max_position_embeddings=64, rms_norm_eps=1e-5, rope_theta=500.0,
                         tie_word_embeddings=False, initializer_range=0.25)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # norms at 1 would hide a swapped norm mapping
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn_like(p))
    model.save_pretrained(f"{out_dir}/single")
    model.save_pretrained(f"{out_dir}/sharded", max_shard_size="20KB")
    rng = np.random.default_rng(0)
    rng.integers(0, VOCAB, size=num_windows * seq_len + 1, dtype=np.uint16).tofile(tokens_file)
    loss(seq_len, tokens_file, 0, num_windows, [f"{out_dir}/single", f"{out_dir}/sharded"])


def loss(seq_len, tokens_file, begin, num_windows, dirs):
    tokens = torch.from_numpy(np.fromfile(tokens_file, dtype=np.uint16).astype(np.int64))
    windows = torch.stack([tokens[begin + w * seq_len: begin + w * seq_len + seq_len + 1]
                           for w in range(num_windows)])
    out = {}
    for d in dirs:
        model = LlamaForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
        with torch.no_grad():
            logits = model(windows[:, :-1]).logits
        out[d] = torch.nn.functional.cross_entropy(
            logits.flatten(0, 1).float(), windows[:, 1:].flatten()).item()
    print(json.dumps(out))


if __name__ == "__main__":
    if sys.argv[1] == "make":
        make(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
    elif sys.argv[1] == "loss":
        loss(int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), sys.argv[6:])
    else:
        sys.exit(f"unknown command {sys.argv[1]}")
