"""Tracking: MLflow runs of the stages and the flow (`runs`), and the champion on disk and
in the model registry (`champion`)."""
