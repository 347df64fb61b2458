"""Inference-time compute: the strategies' settings and their defaults (`settings`, no
torch), the strategies themselves — greedy, best-of-n, self-consistency, PRM-guided MCTS,
speculative decoding, ensembles (`strategies`) — and the `generate` command."""
