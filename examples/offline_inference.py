"""Offline inference, as DeepInfer users run it:

    python examples/offline_inference.py                  # the embedded trained tiny model
    python examples/offline_inference.py --model deepinfer-tiny-dspark --speculative 5
    DEEPINFER_HF_MODEL_DIR=/path/to/ckpt python examples/offline_inference.py

The embedded default (`deepinfer-tiny`, datasets/models/deepinfer-tiny) is a 19.8M-parameter
DeepSeek-V4-architecture model trained by deepinfer/train on public-domain books, Python's
standard library and synthetic chats: it continues prose and code in their style and
answers in the chat format, without much sense.
"""

from __future__ import annotations

import argparse

from deepinfer import LLM, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None,
                        help="checkpoint dir or embedded name (default: DEEPINFER_HF_MODEL_DIR, else deepinfer-tiny)")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--speculative", type=int, default=0, help="draft tokens per step (MTP or DSpark)")
    args = parser.parse_args()

    llm = LLM(args.model, seed=0, num_speculative_tokens=args.speculative)
    prompts = [
        "KING HENRY.\nNow, lords,",
        "And it came to pass",
        "def read_lines(path):\n    \"\"\"",
        "The first thing to know about Python is",
    ]
    params = [SamplingParams(temperature=args.temperature, top_p=0.95, max_tokens=args.max_tokens, seq_seed=i)
              for i in range(len(prompts))]
    outputs = llm.generate(prompts, params)
    for out in outputs:
        m = out.metrics
        print(f"prompt: {out.prompt!r}\noutput: {out.text!r}\n  finish={out.finish_reason} "
              f"prompt_tokens={m.num_prompt_tokens} output_tokens={m.num_output_tokens} "
              f"ttft={m.ttft * 1e3:.1f} ms\n")


if __name__ == "__main__":
    main()
