"""Training: the params blocks of the training stages (`params`, no torch), what every TRL
trainer setup shares — configs, checkpoints, resume (`trainer_setup`), our PPO with a value
model and GAE (`ppo`), and the content-keyed cache of reference log-probs
(`ref_logprobs`)."""
