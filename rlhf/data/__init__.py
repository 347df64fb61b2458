"""Data contracts (sft, preference, unpaired, prm, prompts) and the loaders that read a
user's files (JSONL, JSON, Parquet, CSV, `save_to_disk` folders) and validate every row
before any compute (`contracts`)."""
