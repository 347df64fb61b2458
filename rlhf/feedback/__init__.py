"""Human feedback: a labelling page (FastAPI, `app`) that shows two sampled completions of
one model for a prompt and appends the person's choice as a preference pair, validated by
the preference contract, to the JSONL file the caller names."""
