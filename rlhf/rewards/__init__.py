"""Rewards: the verifiable and rule rewards declared in params (`functions`), the reward
model ensemble (`ensemble`, with the likelihood kind in `likelihood_rm`), and the process
reward model — its shared step logic (`steps`), its two kinds (`prm_classifier`,
`prm_likelihood`), loading either (`prm`), and step labels derived by Math-Shepherd
rollouts for tasks whose answers can be checked (`prm_labels`). `likelihood` holds the
log-prob and logistic-fit code the likelihood RM and PRM share."""
