"""The user entry points, installed as console scripts (pyproject.toml [project.scripts]):

    distsparse-train    pretrain.py       one training run (`deepspeed launch/pretrain.py` in a checkout)
    distsparse-slurm    slurm.py          a run submitted to SLURM through submitit
    distsparse-prepare  data_prep.prepare tokenized shards from text, jsonl, parquet or a Hugging Face dataset
    distsparse-export   export_hf.py      a checkpoint as a Hugging Face folder
    distsparse-eval     eval_zeroshot.py  zero-shot tasks through lm-evaluation-harness

Every entry point that trains starts its process through launch_env.py (which rank, world and GPU it is).
"""
