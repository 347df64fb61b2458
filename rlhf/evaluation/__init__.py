"""Evaluation: metrics of generated completions (`metrics`), confidence intervals and
paired tests over per-problem outcomes (`statistics`), and the capability tests and the
promotion rule of the gate (`gate`)."""
