"""Byte-level BPE tokenizer trained on the generated corpus (HuggingFace `tokenizers`).

The tokenizer is trained once, when a dataset is generated, with the backbone's vocabulary
size as its ceiling, and saved next to the shards as `tokenizer.json`. Id 0 is `<image>`:
the placeholder that fills image positions in a packed sequence.
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

TOKENIZER_FILE = "tokenizer.json"
SPECIAL_TOKENS = ("<image>", "<pad>", "<eos>")
IMAGE_TOKEN_ID = 0


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """Train a byte-level BPE whose ids (special tokens included) are all < `vocab_size`."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(alphabet) + len(SPECIAL_TOKENS) + 1:
        raise ValueError(f"vocab_size {vocab_size} too small for a byte-level BPE "
                         f"(needs more than {len(alphabet) + len(SPECIAL_TOKENS)})")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=alphabet, show_progress=False, min_frequency=2)
    tokenizer.train_from_iterator(texts, trainer=trainer)
    if tokenizer.token_to_id(SPECIAL_TOKENS[0]) != IMAGE_TOKEN_ID:
        raise AssertionError("the <image> token must have id 0")
    if tokenizer.get_vocab_size(with_added_tokens=True) > vocab_size:
        raise AssertionError(f"trained vocabulary {tokenizer.get_vocab_size()} exceeds {vocab_size}")
    return tokenizer


def save_tokenizer(tokenizer: Tokenizer, directory: str | Path) -> Path:
    path = Path(directory) / TOKENIZER_FILE
    tokenizer.save(str(path), pretty=False)
    return path


def load_tokenizer(directory: str | Path) -> Tokenizer:
    """Load `tokenizer.json` from a dataset directory (or a path to the file itself)."""
    path = Path(directory)
    if path.is_dir():
        path = path / TOKENIZER_FILE
    return Tokenizer.from_file(str(path))
