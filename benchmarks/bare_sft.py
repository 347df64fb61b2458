"""The baseline of benchmarks/sft_overhead.py and benchmarks/real_size.py: TRL's SFTTrainer
as a user would call it by hand, with the sft section of params.yaml (and its LoRA block,
the weights' dtype and mixed precision as params `model` and `compute` give the stage) and
nothing of ours (no validation, tracking,
checkpoints, merge, metrics or plots).

    python benchmarks/bare_sft.py PROJECT_DIR
"""

import sys
from pathlib import Path

import pandas as pd
import torch
import yaml
from datasets import Dataset
from peft import LoraConfig
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import SFTConfig, SFTTrainer

project = Path(sys.argv[1])
params = yaml.safe_load((project / "params.yaml").read_text())
p, lora = params["sft"], params["sft"].get("lora", {})
compute = params.get("compute", {}).get("dtype", "auto")
half = compute == "bfloat16"  # bf16 mixed precision (CPU autocast), as the stage trains with it
dtype = params.get("model", {}).get("dtype", "auto")
if dtype == "auto":  # as the stage loads: a LoRA base in the compute dtype, full fine-tuning in float32
    dtype = "bfloat16" if half and lora.get("enabled") else "float32"
base = project / "models/base"
if (base / "pointer.json").is_file():  # a model of the user's own: stage base points to it
    base = Path(yaml.safe_load((base / "pointer.json").read_text())["path"])
tokenizer = AutoTokenizer.from_pretrained(base)
model = AutoModelForCausalLM.from_pretrained(base, dtype=getattr(torch, dtype))
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
    bf16=half,
    activation_checkpointing=False,
    save_strategy="no",
    report_to=[],
)
peft_config = None
if lora.get("enabled"):
    peft_config = LoraConfig(
        r=lora.get("r", 8), lora_alpha=lora.get("alpha", 16), target_modules=lora.get("target_modules", "all-linear"),
        task_type="CAUSAL_LM",
    )  # fmt: skip
trainer = SFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer, peft_config=peft_config)
trainer.train()
trainer.save_model(str(project / "bare-out/final"))
