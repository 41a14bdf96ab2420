"""SentencePiece tokenizer: training, loading, and exposure as a Hugging Face tokenizer directory.

Owns the tokenizer file layout of a prepared data directory (`DIR/tokenizer/`: `tokenizer.model`,
`tokenizer.json`, `tokenizer_config.json`) and the check that the HF view encodes like SentencePiece.
research/pretraining_ecosystem.md s2.2 (trainer flags, LLaMA-style settings) and s2.3 (HF exposure).

Settings and why:
- LLaMA id layout unk 0, bos 1, eos 2, plus pad 3 (LLaMA has none; truncate_pad needs one).
- `normalization_rule_name=identity`, `remove_extra_whitespaces=False`, `byte_fallback=True`, `"\\n"` as a
  user-defined piece and whitespace-only pieces allowed: decode(encode(text)) == text for any text, including
  newlines and code indentation (NFKC and whitespace folding would break the round trip).
- `split_digits=True` as LLaMA does.
The HF directory is written by transformers' own SentencePiece conversion (`from_pretrained` on a folder holding
only `tokenizer.model`, then `save_pretrained`), so loading it later needs no sentencepiece. The generic
`PreTrainedTokenizerFast` (in transformers 5 the `TokenizersBackend` that `AutoTokenizer` picks for this folder)
does it without importing torch, which `AutoTokenizer` would (seconds of start-up).
"""

from __future__ import annotations

import hashlib
import logging
import shutil
from pathlib import Path
from typing import Iterable

import sentencepiece as spm

log = logging.getLogger(__name__)

MODEL_FILE = "tokenizer.model"
TOKENIZER_TYPES = ("unigram", "bpe")
SPECIAL_IDS = {"unk_id": 0, "bos_id": 1, "eos_id": 2, "pad_id": 3}
# 4 special pieces + 256 byte pieces + "\n": sentencepiece needs room for learned pieces beyond them.
MIN_VOCAB_SIZE = 300


def train_sentencepiece(
    sentences: Iterable[str], model_file: Path, *, vocab_size: int, model_type: str, seed: int, num_threads: int,
) -> Path:
    """Train a SentencePiece model on `sentences` (lines of text) and write it to `model_file`."""
    if model_type not in TOKENIZER_TYPES:
        raise ValueError(f"--tokenizer-type: got {model_type!r}; allowed: {', '.join(TOKENIZER_TYPES)}")
    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(f"--vocab-size: got {vocab_size}; allowed: >= {MIN_VOCAB_SIZE} (256 byte pieces + specials)")
    model_file.parent.mkdir(parents=True, exist_ok=True)
    # The seed is process-global in sentencepiece; training reads every sentence given (no sampling), so this
    # only pins the trainer's internal tie-breaking.
    spm.set_random_generator_seed(seed)
    with open(model_file, "wb") as writer:
        try:
            spm.SentencePieceTrainer.train(
                sentence_iterator=iter(sentences), model_writer=writer, model_type=model_type,
                vocab_size=vocab_size, byte_fallback=True, normalization_rule_name="identity",
                remove_extra_whitespaces=False, allow_whitespace_only_pieces=True, split_digits=True,
                user_defined_symbols=["\n"], character_coverage=0.9995, num_threads=num_threads,
                minloglevel=2, **SPECIAL_IDS,
            )
        except RuntimeError as err:
            raise ValueError(f"--vocab-size: got {vocab_size}; sentencepiece refused it for this corpus "
                             f"(use a smaller vocab or more text): {err}") from err
    return model_file


def resolve_model_file(path: str | Path) -> Path:
    """A `.model` file, or a directory holding `tokenizer.model` (e.g. a prepared DIR/tokenizer)."""
    path = Path(path)
    candidate = path / MODEL_FILE if path.is_dir() else path
    if not candidate.is_file():
        raise ValueError(f"--tokenizer: got {str(path)!r}; allowed: a SentencePiece .model file or a directory "
                         f"containing {MODEL_FILE} (no such file: {candidate})")
    return candidate


def special_ids(processor: spm.SentencePieceProcessor) -> dict[str, int]:
    """bos/eos/pad/unk ids of a model; -1 where the model has none."""
    return {"bos_id": processor.bos_id(), "eos_id": processor.eos_id(), "pad_id": processor.pad_id(),
            "unk_id": processor.unk_id()}


def sha256_file(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def save_hf_tokenizer(model_file: Path, out_dir: Path) -> None:
    """Write `out_dir` so that `transformers.AutoTokenizer.from_pretrained(out_dir)` loads this model.

    No BOS/EOS is added on encode: the shards hold documents followed by EOS and nothing else.
    """
    from transformers import PreTrainedTokenizerFast

    model_bytes = Path(model_file).read_bytes()  # read first: model_file may live in out_dir
    # A stale tokenizer.json would be loaded instead of converting the new model: start from an empty folder.
    shutil.rmtree(out_dir, ignore_errors=True)
    out_dir.mkdir(parents=True)
    (out_dir / MODEL_FILE).write_bytes(model_bytes)
    processor = spm.SentencePieceProcessor(model_proto=model_bytes)
    # The model's own pieces, so that a given tokenizer with another layout (e.g. T5's pad 0, eos 1) maps right.
    tokens = {name.replace("_id", "_token"): processor.id_to_piece(index)
              for name, index in special_ids(processor).items() if index >= 0}
    hf = PreTrainedTokenizerFast.from_pretrained(str(out_dir), **tokens)
    hf.save_pretrained(str(out_dir))


def check_hf_tokenizer(out_dir: Path, processor: spm.SentencePieceProcessor, texts: list[str]) -> dict[str, int]:
    """Reload `out_dir` as a HF tokenizer and compare it with SentencePiece on `texts`.

    The HF tokenizer must decode SentencePiece's ids to the same string (RuntimeError otherwise). Returns counts:
    `id_mismatch`, texts HF encodes to other ids (only where a unigram model has two segmentations of equal
    score, e.g. runs of whitespace pieces: Viterbi tie-breaking differs between the libraries, and both decode
    alike), and `lossy`, texts that do not survive decode(encode(text)) (0 for tokenizers trained here; a given
    model with NFKC normalization or whitespace folding, like T5's, is lossy on newlines and spaces).
    """
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast.from_pretrained(str(out_dir))
    counts = {"checked": len(texts), "id_mismatch": 0, "lossy": 0}
    for text in texts:
        ids = processor.encode(text)
        decoded = processor.decode(ids)
        if hf.decode(ids) != decoded:
            raise RuntimeError(f"the HF tokenizer in {out_dir} decodes the ids of {text[:80]!r} to "
                               f"{hf.decode(ids)[:80]!r}, sentencepiece to {decoded[:80]!r}")
        counts["id_mismatch"] += hf.encode(text, add_special_tokens=False) != ids
        counts["lossy"] += decoded != text
    return counts
