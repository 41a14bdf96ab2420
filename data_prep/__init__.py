"""Data preparation: documents from a source, a SentencePiece tokenizer, memmap token shards and meta.json.

Run `python -m data_prep.prepare --help`. DESIGN s3 (`data_prep/`), s6 (data modes);
research/pretraining_ecosystem.md s2.
"""
