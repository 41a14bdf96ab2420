"""The tokenizer of a prepared data directory: SentencePiece training, a given SentencePiece or HF tokenizer,
the encoder the workers run, and the checks.

Owns the tokenizer file layout of a prepared data directory (`DIR/tokenizer/`, which `AutoTokenizer` loads for
training, evaluation and export) and its two kinds:
- `sentencepiece`: a `.model` trained here or given (a file, or a directory holding `tokenizer.model`, such as a
  prepared DIR/tokenizer); `DIR/tokenizer/` holds it plus its HF conversion; workers encode with sentencepiece.
- `hf`: any Hugging Face tokenizer by directory (`tokenizer.json`, or files transformers converts to one) or hub
  name (LLaMA-3, GPT-2, Mistral, ...), loaded from the local cache first; `save_pretrained` writes it into
  `DIR/tokenizer/` and workers encode with `tokenizers` from its `tokenizer.json`.
BOS/EOS/pad/unk ids come from the tokenizer (-1 where it has none); EOS is required (documents are separated by
it). research/pretraining_ecosystem.md s2.2 (trainer flags, LLaMA-style settings) and s2.3 (HF exposure).

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

import functools
import hashlib
import logging
import os
import shutil
from pathlib import Path
from typing import Callable, Iterable

import sentencepiece as spm

log = logging.getLogger(__name__)

MODEL_FILE = "tokenizer.model"
HF_FILE = "tokenizer.json"
KINDS = ("sentencepiece", "hf")
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


def _is_sentencepiece(path: Path) -> bool:
    try:
        spm.SentencePieceProcessor(model_file=str(path))
    except (OSError, RuntimeError):
        return False
    return True


def given_kind(spec: str) -> str:
    """The kind of a `--tokenizer` value: `sentencepiece` for a loadable .model (or a directory holding one),
    `hf` for a directory with tokenizer.json / tokenizer_config.json or a hub name (checked when installed)."""
    path = Path(spec).expanduser()
    allowed = ("allowed: a SentencePiece .model, a directory holding tokenizer.model or tokenizer.json, or a "
               "Hugging Face hub name such as gpt2")
    if path.is_file():
        if path.name == HF_FILE:
            return "hf"
        if _is_sentencepiece(path):
            return "sentencepiece"
        raise ValueError(f"--tokenizer: got {spec!r}, which sentencepiece cannot load; {allowed}")
    if path.is_dir():
        if (path / MODEL_FILE).is_file() and _is_sentencepiece(path / MODEL_FILE):
            return "sentencepiece"
        if any((path / name).is_file() for name in (HF_FILE, "tokenizer_config.json")):
            return "hf"
        raise ValueError(f"--tokenizer: got {spec!r}, a directory with neither {MODEL_FILE} nor {HF_FILE}; {allowed}")
    if spec.startswith(("/", "./", "../", "~")) or spec.endswith((".model", ".json")) or spec.count("/") > 1:
        raise ValueError(f"--tokenizer: got {spec!r}; no such file or directory; {allowed}")
    return "hf"


def load_hf_tokenizer(spec: str):
    """`AutoTokenizer.from_pretrained(spec)`, from the local cache first; a ValueError that says what to do when
    the tokenizer is neither here nor cached and the hub cannot be reached."""
    from transformers import AutoTokenizer

    path = Path(spec).expanduser()
    source = str(path.parent if path.name == HF_FILE else path) if path.exists() else spec
    try:
        return AutoTokenizer.from_pretrained(source, local_files_only=True)
    except (OSError, ValueError) as cached_err:
        if path.exists():
            raise ValueError(f"--tokenizer: got {spec!r}; transformers cannot load it ({cached_err})") from None
    try:
        return AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError) as err:
        from huggingface_hub.constants import HF_HUB_CACHE
        raise ValueError(f"--tokenizer: got {spec!r}: not a file or directory here, and not in the Hugging Face "
                         f"cache ({HF_HUB_CACHE}); the hub could not provide it ({type(err).__name__}: "
                         f"{str(err).splitlines()[0][:200]}); allowed: a local tokenizer directory, or a hub name "
                         f"fetched beforehand on a machine with network: huggingface-cli download {spec} "
                         f"(gated models need huggingface-cli login first)") from None


def install_given(spec: str, out_dir: Path) -> str:
    """Write `out_dir` (the prepared directory's tokenizer/) from a given tokenizer; return its kind."""
    kind = given_kind(spec)
    if kind == "sentencepiece":
        save_hf_tokenizer(resolve_model_file(spec), out_dir)
        return kind
    tokenizer = load_hf_tokenizer(spec)
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError(f"--tokenizer: got {spec!r}, which transformers loads only as a slow tokenizer; allowed: one "
                         f"with a {HF_FILE} (or one transformers converts to it)")
    shutil.rmtree(out_dir, ignore_errors=True)
    tokenizer.save_pretrained(str(out_dir))
    return kind


def tokenizer_facts(tok_dir: Path, kind: str) -> dict:
    """vocab_size, the special ids (-1 where none) and the sha256 of the file that defines the tokenizer."""
    if kind == "sentencepiece":
        processor = spm.SentencePieceProcessor(model_file=str(tok_dir / MODEL_FILE))
        return {"vocab_size": processor.get_piece_size(), **special_ids(processor),
                "tokenizer_sha256": sha256_file(tok_dir / MODEL_FILE)}
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast.from_pretrained(str(tok_dir))
    # len() counts added tokens; the largest id + 1 covers a vocabulary with holes.
    vocab_size = max(len(hf), max(hf.get_vocab().values()) + 1)
    ids = {f"{name}_id": getattr(hf, f"{name}_token_id") for name in ("bos", "eos", "pad", "unk")}
    return {"vocab_size": vocab_size, **{k: -1 if v is None else int(v) for k, v in ids.items()},
            "tokenizer_sha256": sha256_file(tok_dir / HF_FILE)}


@functools.lru_cache(maxsize=2)   # one load per worker process and tokenizer
def load_encoder(tok_dir: str, kind: str) -> Callable[[list[str]], list[list[int]]]:
    """texts -> token ids (no BOS/EOS added), on one thread: a preparation runs one worker per core."""
    if kind == "sentencepiece":
        processor = spm.SentencePieceProcessor(model_file=str(Path(tok_dir) / MODEL_FILE), num_threads=1)
        return processor.encode
    os.environ["TOKENIZERS_PARALLELISM"] = "false"   # read by tokenizers at each batch call
    from tokenizers import Tokenizer

    backend = Tokenizer.from_file(str(Path(tok_dir) / HF_FILE))
    return lambda texts: [e.ids for e in backend.encode_batch_fast(texts, add_special_tokens=False)]


def special_ids(processor: spm.SentencePieceProcessor) -> dict[str, int]:
    """bos/eos/pad/unk ids of a model; -1 where the model has none."""
    return {"bos_id": processor.bos_id(), "eos_id": processor.eos_id(), "pad_id": processor.pad_id(),
            "unk_id": processor.unk_id()}


def sha256_file(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def tokenizer_check(tok_dir: Path, kind: str, texts: list[str]) -> dict[str, int]:
    """`check_hf_tokenizer` for sentencepiece; for HF tokenizers the count of texts that decode(encode(text))
    does not reproduce (`lossy`: normalizers such as lowercasing)."""
    if kind == "sentencepiece":
        processor = spm.SentencePieceProcessor(model_file=str(tok_dir / MODEL_FILE))
        return check_hf_tokenizer(tok_dir, processor, texts)
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast.from_pretrained(str(tok_dir))
    encode = load_encoder(str(tok_dir), kind)
    lossy = sum(hf.decode(ids) != text for ids, text in zip(encode(texts), texts))
    return {"checked": len(texts), "lossy": lossy}


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
