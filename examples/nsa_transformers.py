"""Build a small transformers Llama whose attention layers are sparseattn's NSA, train it for a few steps on a
toy task, and generate with it.

    python examples/nsa_transformers.py            # CUDA when available (bf16), else the CPU (float32)
    python examples/nsa_transformers.py --steps 200

The toy task: sequences that repeat a random pattern of 8 tokens; after training, greedy generation continues the
pattern of a prompt it has not seen. The same weights serve training (full sequences) and generation (a prefill,
then one token per step against the cache).
"""
import argparse
import time

import torch

from sparseattn.hf import NSALlamaConfig, NSALlamaForCausalLM, SparseAttnCache


def batch_of_patterns(batch: int, length: int, vocab: int, period: int, device) -> torch.Tensor:
    pattern = torch.randint(1, vocab, (batch, period), device=device)
    return pattern.repeat(1, -(-length // period))[:, :length]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=24)
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    torch.manual_seed(0)

    # NSA at small scale: compressed blocks of 16 (stride 8), selection blocks of 32, 4 blocks per query, a
    # window of 64; 8 query heads sharing 2 KV heads of 64 dims.
    config = NSALlamaConfig(vocab_size=64, hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
                            num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=4096,
                            nsa_cmp_block=16, nsa_cmp_stride=8, nsa_sel_block=32, nsa_num_selected=4,
                            nsa_num_init=1, nsa_num_local=1, nsa_window=64, pad_token_id=0, bos_token_id=None,
                            eos_token_id=None)
    model = NSALlamaForCausalLM(config).to(device=device, dtype=dtype)
    print(f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters on {device} ({dtype})")

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model.train()
    started = time.time()
    for step in range(args.steps):
        ids = batch_of_patterns(8, args.length, config.vocab_size, 8, device)
        loss = model(ids, labels=ids).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % 25 == 0 or step == args.steps - 1:
            print(f"step {step:4d}  loss {loss.item():.3f}  ({time.time() - started:.0f} s)")

    model.eval()
    prompt = batch_of_patterns(1, 40, config.vocab_size, 8, device)
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=args.new_tokens, do_sample=False,
                             past_key_values=SparseAttnCache())
    continuation = prompt[0, :8].repeat(-(-args.new_tokens // 8))[: args.new_tokens].tolist()
    generated = out[0, 40:].tolist()
    print("prompt   ", prompt[0, :16].tolist(), "...")
    print("generated", generated)
    correct = sum(int(a == b) for a, b in zip(generated, continuation))
    print(f"{correct} of {args.new_tokens} generated tokens continue the pattern")


if __name__ == "__main__":
    main()
