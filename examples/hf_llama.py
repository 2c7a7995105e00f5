"""Generate and fine-tune a Hugging Face Llama with tritonattn, against sdpa and eager.

Builds a Llama from a config (random weights: no download), then for each attention backend runs
greedy generation and one fine-tuning step, and prints time and peak memory side by side.
On a GPU it uses a ~1B-parameter shape in bf16; without one, a tiny shape under the Triton
interpreter (a functional check, not a speed figure); ``--tiny`` takes that tiny fp32 shape on a
GPU too.

    python examples/hf_llama.py [--seqlen 4096] [--batch 2] [--tiny]
"""

from __future__ import annotations

import argparse
import os
import time

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import transformers  # noqa: E402

import tritonattn.integrations.transformers  # noqa: E402,F401 - registers attn_implementation="tritonattn"


def main() -> None:
    gpu = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true",
                   help="a 2-layer fp32 model (the default without a GPU; on a GPU: a quick end-to-end check)")
    p.add_argument("--seqlen", type=int)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--backends", nargs="+", default=["tritonattn", "sdpa", "eager"])
    args = p.parse_args()
    tiny = args.tiny or not gpu
    args.seqlen = args.seqlen or (48 if tiny else 4096)
    device, dtype = "cuda" if gpu else "cpu", torch.float32 if tiny else torch.bfloat16
    cfg = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2) if tiny else dict(hidden_size=2048, intermediate_size=5632,
                                                        num_hidden_layers=16, num_attention_heads=32,
                                                        num_key_value_heads=8)
    config = transformers.LlamaConfig(vocab_size=128 if tiny else 32000, max_position_embeddings=args.seqlen + 64,
                                      **cfg)
    ids = torch.randint(0, config.vocab_size, (args.batch, args.seqlen), device=device)
    print(f"Llama ({cfg['num_hidden_layers']} layers, hidden {cfg['hidden_size']}, GQA {cfg['num_attention_heads']}/"
          f"{cfg['num_key_value_heads']}) on {torch.cuda.get_device_name() if gpu else 'CPU (interpreter)'}, "
          f"batch {args.batch}, seqlen {args.seqlen}, {dtype}")
    print(f"{'backend':12} {'generate s':>10} {'train step s':>12} {'peak GiB':>9} {'loss':>8} {'first calls s':>13}")
    print(f"{'':12} (warm: the second call of each; first calls: generation + step, compilation included)")
    first_tokens = None

    def sync():
        if gpu:
            torch.cuda.synchronize()

    for attn in args.backends:
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(config).to(device=device, dtype=dtype)
        model.set_attn_implementation(attn)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        prompt = ids[:, :32]

        def generate():
            with torch.no_grad():
                return model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=16,
                                      do_sample=False, pad_token_id=0)[:, prompt.shape[1]:]  # the new tokens

        def train_step():
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss

        try:
            sync()
            t0 = time.perf_counter()
            generate()
            train_step()  # also creates the optimizer state
            sync()
            first_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            tokens = generate()
            sync()
            gen_s = time.perf_counter() - t0
            if gpu:
                torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            loss = train_step()
            sync()
            step_s = time.perf_counter() - t0
            peak = torch.cuda.max_memory_allocated() / 2**30 if gpu else float("nan")
            print(f"{attn:12} {gen_s:10.2f} {step_s:12.2f} {peak:9.2f} {loss.item():8.4f} {first_s:13.2f}")
        except torch.OutOfMemoryError:
            print(f"{attn:12} {'out of memory':>22}")
            tokens = None
        if tokens is not None:
            if first_tokens is None:
                first_tokens = tokens
            else:
                # random weights give near-uniform logits: in bf16 a near tie can flip one argmax,
                # and greedy decoding diverges from there on
                same = (tokens == first_tokens).float().mean().item() * 100
                differ = (tokens != first_tokens).any(0).nonzero()
                where = f", first difference at new token {differ[0].item()}" if len(differ) else ""
                print(f"{'':12} greedy tokens equal to {args.backends[0]}'s: {same:.1f}%{where}")
        model = opt = None  # free before the next backend
        if gpu:
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
