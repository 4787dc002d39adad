"""Offline inference, as DeepInfer users run it:

    python examples/offline_inference.py                  # the embedded tiny model
    DEEPINFER_HF_MODEL_DIR=/path/to/ckpt python examples/offline_inference.py

The embedded default is a random-weight DeepSeek-V4-architecture checkpoint, so its
text is noise; the point is the whole engine running end to end.
"""

from __future__ import annotations

import argparse

from deepinfer import LLM, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="checkpoint dir (default: DEEPINFER_HF_MODEL_DIR, else tiny)")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.0)
    args = parser.parse_args()

    llm = LLM(args.model, seed=0)
    prompts = [
        "Hello, my name is",
        "The capital of France is",
        "def fibonacci(n):",
        "In a hole in the ground there lived",
    ]
    params = [SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seq_seed=i)
              for i in range(len(prompts))]
    outputs = llm.generate(prompts, params)
    for out in outputs:
        m = out.metrics
        print(f"prompt: {out.prompt!r}\noutput: {out.text!r}\n  finish={out.finish_reason} "
              f"prompt_tokens={m.num_prompt_tokens} output_tokens={m.num_output_tokens} "
              f"ttft={m.ttft * 1e3:.1f} ms\n")


if __name__ == "__main__":
    main()
