"""The project's folders: where the stages read and write, and where the `rlhf` commands
look (the champion, the prepared prompts, the labelling page's file).

One small module, read by stages/ (which re-exports it) and by rlhf/cli; dvc.yaml names the
same paths as each stage's deps and outs. The library below them (training, models,
rewards, evaluation) takes paths from its callers and names none of these; of the data
library, rlhf/data/preparation.py, which assembles data/prepared, reads its shape here.
"""

from __future__ import annotations

from pathlib import Path

RAW_DIR = Path("data/raw")  # the user's own files (and the labelling page's)
FEEDBACK_FILE = RAW_DIR / "feedback_prefs.jsonl"  # the labelling page's pairs, which prepare adds to prefs
DATA_DIR = Path("data/prepared")
EVAL_DIR = DATA_DIR / "eval"  # one <suite>.parquet per eval suite
EVAL_PREFIX = "eval_"  # prepare.files.eval_<suite>: the user's file of eval suite <suite>
PROMPTS_FILE = DATA_DIR / "prompts.parquet"
MODELS_DIR = Path("models")
SFT_DIR = MODELS_DIR / "sft"
RM_DIR = MODELS_DIR / "rm"
PRM_DIR = MODELS_DIR / "prm"
POLICY_DIR = MODELS_DIR / "policy"
MERGED_DIR = MODELS_DIR / "merged"
CHAMPION_DIR = MODELS_DIR / "champion"
COMPRESSOR_DIR = MODELS_DIR / "compressor"  # stage compress: one context compressor per folder
# A gate run's verdict that its tracking store did not take, one file per run, until logged.
TRACKING_OWED_DIR = MODELS_DIR / ".tracking-owed"
# Outside DVC's outputs (DVC deletes those before a stage runs), so a killed stage resumes.
CHECKPOINTS_DIR = Path("checkpoints")
REF_LOGPS_CACHE = Path("cache/ref_logps")
REPORTS_DIR = Path("reports")
# Folders of the model-based rewards and scorers that name no `path` of their own.
REWARD_MODEL_DIRS = {"reward_model": RM_DIR, "prm": PRM_DIR}
