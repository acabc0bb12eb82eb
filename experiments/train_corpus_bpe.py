"""The recipe of zephon_state's bundled ``corpus-bpe-4096`` tokenizer: a byte-level BPE of
4,096 tokens trained with ``tokenizers`` on flextrain's two bundled corpora (KJV prose and
CPython stdlib code, every document of both), for the ``blocks`` preset, whose model is
mostly matrices because its vocabulary is small.

    python3 dev.py shell python experiments/train_corpus_bpe.py           # rebuild the asset (~10 s)
    python3 dev.py shell python experiments/train_corpus_bpe.py --check   # retrain in memory, compare with it

GPT-2's pre-tokenizer and decoder (``ByteLevel``, no prefix space, its regex), no
normalizer, 4,095 merged tokens from the 256 byte symbols, then ``<|endoftext|>`` as the
last id (4095) of the model's vocabulary and not an added token, as in GPT-2's own files:
the text "<|endoftext|>" inside a document stays text, and zephon's cuts at spaces between
letters keep a document's tokens (``zephon_state.tokenize.cuts_at_spaces``).
"""
from __future__ import annotations

import argparse
import hashlib
import io
import json
import sys
from pathlib import Path

import zstandard
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from flextrain.config import DataConfig  # noqa: E402  (the corpora's paths, wherever they are installed)

VOCAB = 4096
EOS = "<|endoftext|>"
ASSET = ROOT / "src" / "zephon_state" / "assets" / "corpus-bpe-4096" / "tokenizer.json"


def documents(paths: list[str]):
    for path in paths:
        with open(path, "rb") as fh:
            for line in io.TextIOWrapper(zstandard.ZstdDecompressor().stream_reader(fh), encoding="utf-8"):
                yield json.loads(line)["text"]


def train(paths: list[str]) -> str:
    """The tokenizer's JSON description."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB - 1, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(documents(paths), trainer)
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    if len(vocab) != VOCAB - 1 or EOS in vocab:
        raise SystemExit(f"trained {len(vocab)} tokens, wanted {VOCAB - 1} without {EOS!r}")
    vocab[EOS] = VOCAB - 1
    return json.dumps(spec, ensure_ascii=False, indent=1) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="retrain and compare with the shipped asset; write nothing")
    args = ap.parse_args()
    sources = DataConfig().sources
    text = train([sources["prose"], sources["code"]])
    digest = hashlib.sha256(text.encode()).hexdigest()
    if args.check:
        same = ASSET.read_text(encoding="utf-8") == text
        print(f"retrained sha256 {digest}: {'the same as' if same else 'DIFFERS from'} {ASSET}")
        return 0 if same else 1
    ASSET.parent.mkdir(parents=True, exist_ok=True)
    ASSET.write_text(text, encoding="utf-8")
    print(f"wrote {ASSET} ({len(text.encode()):,} bytes, sha256 {digest})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
