"""Data preparation: a source planned in parts, a SentencePiece or HF tokenizer, token shards per part, meta.json.

Run `python -m data_prep.prepare --help`. prepare.py (the command and its stages), sources.py and readers.py
(documents), tokenizer.py, parts.py (one worker's part), plan.py (state on disk, resume), finalize.py
(meta.json), slurm.py (across nodes). DESIGN s3 (`data_prep/`), s6 (data modes), decision 23;
research/pretraining_ecosystem.md s2.
"""
