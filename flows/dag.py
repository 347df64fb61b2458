"""dvc.yaml's DAG as DVC itself reads it (`Repo.index.graph`): the stage addresses in
dependency order and each stage's upstream stages. The flow draws its run graph from it,
and its summary finds the rounds in it."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def stage_graph(root: Path = ROOT) -> tuple[list[str], dict[str, list[str]]]:
    """Every stage address of dvc.yaml (foreach expanded), dependencies first, and for each
    the stages whose outputs it depends on (DVC's own graph: `dvc dag`)."""
    import networkx as nx
    from dvc.repo import Repo

    with Repo(str(root)) as repo:
        graph = repo.index.graph  # edges point from a stage to the stages it depends on
        stages = [stage for stage in reversed(list(nx.topological_sort(graph))) if getattr(stage, "cmd", None)]
        upstream = {
            stage.addressing: sorted(dep.addressing for dep in graph.successors(stage) if getattr(dep, "cmd", None))
            for stage in stages
        }
        return [stage.addressing for stage in stages], upstream


def stage_order(root: Path = ROOT) -> list[str]:
    """Every stage address of dvc.yaml (foreach expanded), dependencies first."""
    return stage_graph(root)[0]
