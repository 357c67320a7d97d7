"""A byte-level BPE tokenizer of Qwen's vocabulary size, trained offline on this machine's
CPython sources: a stand-in for the real Qwen tokenizer (which cannot be downloaded here) where
a benchmark's cost depends on the vocabulary's size and structure, e.g. a grammar's token mask
(bench/diagnostics/sampling_extras.py --shape qwen3-0.6b --tokenizer DIR).

    python tools/make_bpe_tokenizer.py OUT_DIR [--vocab-size 151643]
"""
from __future__ import annotations

import argparse
import json
import sysconfig
from pathlib import Path

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def corpus(limit_bytes: int):
    """The standard library's sources, then the installed packages' (a machine's stdlib alone
    may be too small: one GPU host's gave a BPE of only 59k tokens)."""
    paths = sysconfig.get_paths()
    seen = 0
    for root in dict.fromkeys(Path(paths[k]) for k in ("stdlib", "purelib", "platlib")):
        for p in sorted(root.rglob("*.py")):
            try:
                text = p.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue
            seen += len(text)
            yield text
            if seen >= limit_bytes:
                return


def main(argv=None) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--vocab-size", type=int, default=151_643)
    ap.add_argument("--corpus-mb", type=int, default=60)
    a = ap.parse_args(argv)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=a.vocab_size, min_frequency=1,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(corpus(a.corpus_mb << 20), trainer)
    if tok.get_vocab_size() != a.vocab_size:
        raise SystemExit(f"the corpus gave {tok.get_vocab_size()} BPE tokens, not {a.vocab_size}: "
                         "too little source text on this machine; build the tokenizer on "
                         "another machine and copy the directory")
    tok.add_special_tokens(SPECIALS)        # after the BPE: Qwen's ids 151643-151645
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>", "model_max_length": 40960}))
    print(f"{tok.get_vocab_size()} tokens -> {out}")


if __name__ == "__main__":
    main()
