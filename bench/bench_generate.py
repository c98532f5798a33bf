"""Generation speed with and without the KV cache (models/kv_cache.py), and that both give the
same tokens (greedy).

    python bench/bench_generate.py --preset gpt-mini --prompt-len 16 --tokens 200

Prints one table row per mode: new tokens per second (median of --repeats runs, one thread count
as torch chose it) and whether the greedy tokens equal the no-cache ones. Not a timed test.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from common import machine, reproduce, table, timed_steps
from shardlm.config.load import load_config
from shardlm.models.decoder import build_model, generate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="gpt-mini")
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    cfg = load_config(overrides={"model.preset": args.preset}).model
    if args.prompt_len + args.tokens > cfg.max_seq_len:
        raise SystemExit(f"--prompt-len + --tokens = {args.prompt_len + args.tokens} exceeds "
                         f"{args.preset}'s max_seq_len {cfg.max_seq_len}")
    model = build_model(cfg, "cpu", seed=0).eval()
    prompt = torch.randint(0, cfg.vocab_size, (args.batch, args.prompt_len),
                           generator=torch.Generator().manual_seed(0))
    outputs, rows = {}, []
    for use_cache in (False, True):
        def run(_: int, use_cache=use_cache) -> None:
            outputs[use_cache] = generate(model, prompt, args.tokens, temperature=0, use_cache=use_cache)

        times = timed_steps(run, 0, args.repeats)["seconds"]
        rows.append((use_cache, args.batch * args.tokens / statistics.median(times)))
    same = torch.equal(outputs[False], outputs[True])
    print(f"{machine()}; {args.preset}, prompt {args.prompt_len}, {args.tokens} new tokens, batch {args.batch}, "
          f"{torch.get_num_threads()} threads")
    print(table(("mode", "new tokens/s", "greedy tokens = no-cache"),
                [["KV cache" if use_cache else "recompute", f"{speed:,.0f}", same if use_cache else "-"]
                 for use_cache, speed in rows]))
    print(f"\n{reproduce()}")

if __name__ == "__main__":
    main()
