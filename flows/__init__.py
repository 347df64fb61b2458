"""The Prefect side of the pipeline: the flow over the dvc.yaml DAG (`pipeline`), the DAG
as DVC reads it (`dag`) and what a run shows (`summary`).

Importing the package sets the process environment first (`rlhf.environment`), before
any of its modules imports Prefect or MLflow, whatever order an import sorter gives them.
"""

import rlhf  # noqa: F401
