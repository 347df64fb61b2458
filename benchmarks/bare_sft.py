"""The baseline of benchmarks/sft_overhead.py: TRL's SFTTrainer as a user would call it by
hand, with the sft section of params.yaml and nothing of ours (no validation, tracking,
checkpoints, metrics or plots).

    python benchmarks/bare_sft.py PROJECT_DIR
"""

import sys
from pathlib import Path

import pandas as pd
import yaml
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import SFTConfig, SFTTrainer

project = Path(sys.argv[1])
p = yaml.safe_load((project / "params.yaml").read_text())["sft"]
tokenizer = AutoTokenizer.from_pretrained(project / "models/base")
model = AutoModelForCausalLM.from_pretrained(project / "models/base")
dataset = Dataset.from_pandas(pd.read_parquet(project / "data/prepared/sft.parquet"), preserve_index=False)
args = SFTConfig(
    output_dir=str(project / "bare-out"),
    max_steps=p["max_steps"],
    per_device_train_batch_size=p["per_device_train_batch_size"],
    learning_rate=p["learning_rate"],
    lr_scheduler_type=p["lr_scheduler_type"],
    warmup_steps=p["warmup_ratio"],
    max_length=p["max_length"],
    logging_steps=p["logging_steps"],
    seed=p["seed"],
    data_seed=p["seed"],
    use_cpu=True,
    bf16=False,
    activation_checkpointing=False,
    save_strategy="no",
    report_to=[],
)
trainer = SFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer)
trainer.train()
trainer.save_model(str(project / "bare-out/final"))
