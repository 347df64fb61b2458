"""Evaluation: metrics of generated completions (`metrics`), confidence intervals and
paired tests over per-problem outcomes (`statistics`), the capability tests and the
promotion rule of the gate (`gate`), and lm-evaluation-harness as a backend (`harness`)."""
