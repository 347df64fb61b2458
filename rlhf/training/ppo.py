"""Proximal policy optimisation for language models (our own: TRL 1.16 has no PPO trainer).

The RLHF recipe of Ziegler et al. 2019 / Ouyang et al. 2022, written like torchtune's
`rlhf/loss` modules: one small function per step, each with its equation, so that each is
tested on numbers worked out by hand (tests/test_ppo.py). One PPO iteration:

1. sample a response per prompt from the policy, keep its log-probs (`generate_rollouts`);
2. score each completion with a caller's reward function (TRL's reward-function convention);
3. per-token reward: a KL penalty to the frozen reference at every token, plus the score at
   the last token (`per_token_kl`, `kl_adjusted_rewards`);
4. advantages by GAE over the value model's estimates, and returns = advantages + values
   (`td_errors`, `gae_advantages`, `whiten`);
5. `ppo_epochs` passes over shuffled mini-batches, each one AdamW step of the clipped policy
   loss and one of the clipped value loss (`clipped_policy_loss`, `clipped_value_loss`).

Alignment. A sequence is ``[query (left-padded) | response (right-padded after EOS)]``; the
response starts at column Q. The logits at position p predict token p+1, so response token t
(column Q+t) gets its log-prob from the logits at Q+t-1, and its value V_t is the value model's
output at that same position Q+t-1: the state *before* the token is emitted. The reward and
advantage of token t belong to the action "emit token t" from the state valued V_t.

Several processes (`torchrun`/`accelerate launch`, rlhf/cli/launch.py): each process takes a
contiguous slice of the iteration's prompts and samples, scores and values its own rows;
what spans the batch is summed across processes (`Ranks`): the whitening statistics, each
mini-batch's token count (a mini-batch is a set of rows of the whole batch, in an order
rank 0 draws), the gradients (averaged by hand after each backward, not by DDP, because a
process may hold no row of a mini-batch) and the logged metrics. So N processes take the
steps one process takes on the same batch, and with `keyed_sampling` they also sample the
same responses (tests/test_distributed.py). Rank 0 alone writes checkpoints.

Departures from the paper: the value model is a separate network (no shared trunk, no value
coefficient), dropout is off throughout (models stay in eval mode, so old and new log-probs
agree before the first update), and losses are means over all response tokens of a
mini-batch (TRL's convention), not per-sequence means.

Memory under LoRA: one copy of the weights, in the compute dtype. The policy with its
adapter disabled is the reference, and with `value_init: sft` the value model is a second
adapter and a head on the same weights (`SharedTrunkValue`: the frozen trunk is shared,
the trained parts are not, so it is the separate network above without a second copy).
With `value_init: rm` the value model is the reward model with adapters of its own. Without
LoRA a run holds policy and value model as float32 master weights with their gradients and
AdamW's moments, and a reference copy.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import GenerationConfig, get_scheduler

import rlhf.models.settings as model_settings
from rlhf.atomic import atomic_dir
from rlhf.models.compute import current, is_main, rank, world_size
from rlhf.models.generation import NEUTRAL_DECODING, NEUTRAL_SAMPLING, KeyedSampling, format_prompt, stop_token_ids
from rlhf.training.checkpoints import usable_checkpoint
from rlhf.training.ppo_value import (  # noqa: F401  (the value model's names, as before)
    VALUE_ADAPTER,
    SharedTrunkValue,
    ValueHeadModel,
    load_value_model,
    trained_parameters,
    unwrapped_value_model,
    value_adapters,
)
from rlhf.training.trainer_setup import NO_FUSED_CROSS_ENTROPY, merged_model

_STEP_DIR = re.compile(r"step-(\d+)")


# ----------------------------------------------------------------------------- processes


class Ranks:
    """This process's place among the training processes of a launch, and the sums across
    them (identity with one process). Starts torch.distributed (gloo on CPUs, NCCL on GPUs)
    when the launcher has not."""

    def __init__(self, device: torch.device):
        self.rank, self.world = rank(), world_size()
        if self.world > 1 and not torch.distributed.is_initialized():
            torch.distributed.init_process_group("nccl" if device.type == "cuda" else "gloo")

    def sum(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.world == 1:
            return tensor
        total = tensor.detach().clone()
        torch.distributed.all_reduce(total)
        return total

    def broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.world > 1:
            torch.distributed.broadcast(tensor, src=0)
        return tensor

    def average_gradients(self, parameters: list[torch.Tensor]) -> None:
        """Every process ends with the mean of the processes' gradients (one flat all-reduce)."""
        if self.world == 1:
            return
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in parameters]
        flat = torch.cat([g.reshape(-1) for g in grads])
        torch.distributed.all_reduce(flat)
        flat /= self.world
        offset = 0
        for p, g in zip(parameters, grads):
            p.grad = flat[offset : offset + g.numel()].view_as(g).clone()
            offset += g.numel()


# ----------------------------------------------------------------------------- rollouts


@dataclass
class Rollout:
    """One response per prompt. Tensors are (B, Q) for the query and (B, R) for the response."""

    prompts: list  # as given: strings or conversations
    query_ids: torch.Tensor  # left-padded
    response_ids: torch.Tensor  # pad after the first EOS
    attention_mask: torch.Tensor  # (B, Q + R)
    response_mask: torch.Tensor  # 1 for response tokens up to and including the first EOS
    completions: list[str]  # decoded responses, special tokens dropped
    logprobs: torch.Tensor  # log pi_old(token) of each response token, 0 where masked

    @property
    def input_ids(self) -> torch.Tensor:
        return torch.cat([self.query_ids, self.response_ids], dim=1)

    @property
    def response_start(self) -> int:
        return self.query_ids.shape[1]


def response_mask(response_ids: torch.Tensor, eos_token_id: int | Sequence[int]) -> torch.Tensor:
    """1 up to and including the first EOS of each row, 0 after it (all 1 with no EOS). Reads
    the EOS, not the pad id, so a tokenizer whose pad is its EOS is handled too."""
    eos = torch.as_tensor(eos_token_id, device=response_ids.device).reshape(-1)
    is_eos = torch.isin(response_ids, eos).long()
    eos_before = is_eos.cumsum(1) - is_eos  # EOS tokens strictly before each position
    return (eos_before == 0).long()


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions counted over real tokens, as `generate` counts them for left-padded prompts."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def token_logprobs(model, input_ids, attention_mask, response_start: int, temperature: float = 1.0, entropy=False):
    """log pi(y_t | x, y_<t) = log_softmax(z_{Q+t-1} / T)[y_t] for each response token t, where
    z_p are the logits at position p and T the sampling temperature. With `entropy`, also
    H_t = -sum_v pi(v) log pi(v) of the same tempered distribution. Returns (B, R) tensors."""
    if response_start < 1:
        raise ValueError("every sequence needs a non-empty query: the first response token is predicted from it")
    n_response = input_ids.shape[1] - response_start
    logits = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids(attention_mask),
        logits_to_keep=n_response + 1,
    ).logits[:, :-1]
    logp_all = (logits.float() / temperature).log_softmax(-1)
    logp = logp_all.gather(-1, input_ids[:, response_start:, None]).squeeze(-1)
    if not entropy:
        return logp
    return logp, -(logp_all.exp() * logp_all).sum(-1)


def token_values(value_model, input_ids, attention_mask, response_start: int) -> torch.Tensor:
    """V_t = the value model's output at position Q+t-1, the state before response token t
    is emitted (the same position whose logits give its log-prob). Returns (B, R)."""
    out = value_model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids(attention_mask))
    return out.logits[:, response_start - 1 : -1, 0].float()


@torch.no_grad()
def generate_rollouts(
    policy,
    tokenizer,
    prompts: Sequence,
    max_new_tokens: int,
    temperature: float = 1.0,
    max_prompt_length: int | None = None,
    eos_token_id: int | Sequence[int] | None = None,
    keyed: KeyedSampling | None = None,
) -> Rollout:
    """Sample y ~ pi(. | x)^(1/T) for each prompt x (pure softmax sampling: no top-k/top-p,
    so the log-probs are those of the distribution sampled from), and record log pi_old(y_t).
    With `keyed` (a `KeyedSampling` of this `temperature`) each row's draws come from its
    own keyed generator instead of the process's (greedy decoding of its one-hot output)."""
    eos_token_id = stop_token_ids(policy, tokenizer) if eos_token_id is None else eos_token_id
    tokenizer.padding_side = "left"
    tokenizer.truncation_side = "left"  # keep the end of a long prompt, where the answer starts
    texts = [format_prompt(tokenizer, p) for p in prompts]
    batch = tokenizer(
        texts,
        return_tensors="pt",
        padding=True,
        add_special_tokens=False,
        truncation=max_prompt_length is not None,
        max_length=max_prompt_length,
    ).to(policy.device)
    config = GenerationConfig(
        # no penalty or truncation a model's generation_config may hold
        **NEUTRAL_DECODING,
        **(NEUTRAL_SAMPLING if keyed is None else {}),
        do_sample=keyed is None,
        temperature=temperature if keyed is None else None,
        max_new_tokens=max_new_tokens,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=eos_token_id,
    )
    processors = {} if keyed is None else {"logits_processor": [keyed]}
    output = policy.generate(**batch, generation_config=config, **processors)
    query_ids = batch["input_ids"]
    response_ids = output[:, query_ids.shape[1] :]
    mask = response_mask(response_ids, eos_token_id)
    response_ids = response_ids.masked_fill(mask == 0, tokenizer.pad_token_id)
    attention_mask = torch.cat([batch["attention_mask"], mask], dim=1)
    input_ids = torch.cat([query_ids, response_ids], dim=1)
    logprobs = token_logprobs(policy, input_ids, attention_mask, query_ids.shape[1], temperature) * mask
    completions = tokenizer.batch_decode(response_ids, skip_special_tokens=True)
    return Rollout(list(prompts), query_ids, response_ids, attention_mask, mask, completions, logprobs)


def score_completions(reward_fn: Callable, prompts: Sequence, completions: list[str], row_fields: dict) -> torch.Tensor:
    """One float per completion from `reward_fn(prompts=, completions=, **row_fields)` (TRL's
    reward-function convention: conversational prompts get completions as assistant messages)."""
    if prompts and not isinstance(prompts[0], str):
        completions = [[{"role": "assistant", "content": c}] for c in completions]
    scores = list(reward_fn(prompts=list(prompts), completions=completions, **row_fields))
    name = getattr(reward_fn, "__name__", repr(reward_fn))
    if len(scores) != len(completions):
        raise ValueError(f"reward function {name} returned {len(scores)} scores for {len(completions)} completions")
    if any(s is None or not math.isfinite(s) for s in scores):
        raise ValueError(f"reward function {name} returned a None or non-finite score: {scores}")
    return torch.tensor(scores, dtype=torch.float32)


# ----------------------------------------------------------------------------- rewards and KL


def masked_mean(x: torch.Tensor, mask: torch.Tensor, count: torch.Tensor | float | None = None) -> torch.Tensor:
    """sum(x * mask) / count, `count` the number of masked positions by default (a caller
    whose positions are spread over processes gives the count of all of them)."""
    mask = mask.to(x.dtype)
    return (x * mask).sum() / (mask.sum() if count is None else torch.as_tensor(count, dtype=x.dtype)).clamp(min=1)


def per_token_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """k1 estimator of KL(pi || pi_ref) at each sampled token: KL_t = log pi(y_t) - log pi_ref(y_t).
    Unbiased for the sequence KL when summed over tokens sampled from pi, but a single token's
    value can be negative (Schulman, "Approximating KL divergence", 2020)."""
    return logprobs - ref_logprobs


def kl_adjusted_rewards(scores, kl, kl_coef: float, mask) -> torch.Tensor:
    """r_t = -beta * KL_t at every response token, + score(x, y) at the last real token T:
    r_T = score - beta * KL_T (Ziegler et al. 2019, eq. 2 spread over tokens). 0 where masked."""
    mask = mask.to(kl.dtype)
    rewards = -kl_coef * kl * mask
    last = (torch.arange(mask.shape[1], device=mask.device) * mask).argmax(dim=1)
    rewards[torch.arange(len(scores)), last] += scores.to(rewards)
    return rewards


class FixedKLController:
    """beta stays at `kl_coef`."""

    def __init__(self, kl_coef: float):
        self.value = kl_coef

    def update(self, current_kl: float, n_steps: int) -> None:
        pass


class AdaptiveKLController:
    """Ziegler et al. 2019, eq. 3: e = clip(KL / KL_target - 1, -0.2, 0.2);
    beta <- beta * (1 + e * n_steps / horizon), with n_steps the responses since the last update."""

    def __init__(self, init_kl_coef: float, target: float, horizon: int):
        self.value, self.target, self.horizon = init_kl_coef, target, horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        error = min(max(current_kl / self.target - 1, -0.2), 0.2)
        self.value *= 1 + error * n_steps / self.horizon


# ----------------------------------------------------------------------------- advantages


def td_errors(rewards, values, mask, gamma: float) -> torch.Tensor:
    """delta_t = r_t + gamma * V_{t+1} - V_t, with V = 0 after the last real token. 0 where masked."""
    mask = mask.to(values.dtype)
    next_values = torch.zeros_like(values)
    next_values[:, :-1] = values[:, 1:] * mask[:, 1:]
    return (rewards + gamma * next_values - values) * mask


def gae_advantages(rewards, values, mask, gamma: float, lam: float) -> torch.Tensor:
    """Generalised advantage estimation (Schulman et al. 2016, eq. 16):
    A_t = sum_l (gamma * lam)^l * delta_{t+l}, computed backwards as A_t = delta_t + gamma * lam * A_{t+1}.
    A masked (padding) position resets the sum to 0, so nothing flows back from padding."""
    deltas = td_errors(rewards, values, mask, gamma)
    mask = mask.to(values.dtype)
    advantages = torch.zeros_like(values)
    running = torch.zeros_like(values[:, 0])
    for t in reversed(range(values.shape[1])):
        running = (deltas[:, t] + gamma * lam * running) * mask[:, t]
        advantages[:, t] = running
    return advantages


def value_returns(advantages, values, mask) -> torch.Tensor:
    """The value target R_t = A_t + V_t. With lam = 1 the deltas telescope and R_t is the
    discounted reward-to-go sum_l gamma^l r_{t+l}; with lam < 1 it is the lambda-return."""
    return (advantages + values) * mask.to(values.dtype)


def whiten(x, mask, shift_mean: bool = True, eps: float = 1e-8, total=lambda t: t) -> torch.Tensor:
    """(x - mean) / sqrt(var + eps) over the masked positions (population variance); with
    `shift_mean=False` the mean is added back (only the scale changes). 0 where masked.
    `total` sums a tensor over the processes that hold the rest of the batch (`Ranks.sum`)."""
    mask = mask.to(x.dtype)
    count = total(mask.sum()).clamp(min=1)
    mean = total((x * mask).sum()) / count
    var = total(((x - mean) ** 2 * mask).sum()) / count
    out = (x - mean) * torch.rsqrt(var + eps)
    return (out if shift_mean else out + mean) * mask


# ----------------------------------------------------------------------------- losses


def clipped_policy_loss(logprobs, old_logprobs, advantages, mask, cliprange: float, count=None):
    """PPO-clip (Schulman et al. 2017, eq. 7), rho_t = exp(log pi(y_t) - log pi_old(y_t)):
    L = -E_t[min(rho_t A_t, clip(rho_t, 1 - eps, 1 + eps) A_t)], a mean over response tokens.
    Returns (loss, clipfrac = share of tokens where the clipped term is the min, approx_kl =
    E_t[(log pi - log pi_old)^2 / 2], the k2 estimator of KL(pi_old || pi)). Means divide by
    `count` when given (`masked_mean`)."""
    log_ratio = logprobs - old_logprobs
    ratio = log_ratio.exp()
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - cliprange, 1 + cliprange)
    loss = masked_mean(torch.maximum(unclipped, clipped), mask, count)
    clipfrac = masked_mean((clipped > unclipped).float(), mask, count)
    approx_kl = masked_mean(0.5 * log_ratio.detach() ** 2, mask, count)
    return loss, clipfrac.detach(), approx_kl


def clipped_value_loss(values, old_values, returns, mask, cliprange_value: float, count=None):
    """L_V = 1/2 E_t[max((V_t - R_t)^2, (clip(V_t, V_old - eps, V_old + eps) - R_t)^2)]: the value
    may not profit from moving further than eps from the rollout's estimate. Returns (loss,
    clipfrac = share of tokens where the clipped term is the larger)."""
    clipped_values = torch.clamp(values, old_values - cliprange_value, old_values + cliprange_value)
    unclipped_error, clipped_error = (values - returns) ** 2, (clipped_values - returns) ** 2
    loss = 0.5 * masked_mean(torch.maximum(unclipped_error, clipped_error), mask, count)
    return loss, masked_mean((clipped_error > unclipped_error).float(), mask, count).detach()


def mixed_precision(device: torch.device):
    """bfloat16 autocast where this process computes in it (params `compute.dtype`; a GPU's
    default): the matmuls in bf16 over float32 master weights and adapters, as the
    Trainer's mixed precision does for the TRL methods. Nothing on a float32 CPU. float16
    computes in the weights' dtype: autocast to it would need a gradient scaler."""
    if current().dtype != "bfloat16":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=torch.bfloat16)


def checkpointed_in_eval(model) -> None:
    """Gradient checkpointing (params `model.gradient_checkpointing`) for a model PPO keeps in
    eval mode (no dropout: module docstring). transformers recomputes a decoder layer only
    while that layer is training, so each checkpointing layer alone is marked training;
    its attention and MLP stay in eval mode, where dropout is off."""
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    for module in model.modules():
        if getattr(module, "gradient_checkpointing", False) is True:
            module.training = True


# ----------------------------------------------------------------------------- training


def prompt_batch(n_prompts: int, batch_size: int, seed: int, iteration: int) -> list[int]:
    """Indices of iteration `iteration`'s prompts: a stream of seeded shuffles of all prompts,
    one per pass, so the order depends only on (seed, iteration) and a resumed run sees the same."""
    indices, orders = [], {}
    for position in range(iteration * batch_size, (iteration + 1) * batch_size):
        epoch, offset = divmod(position, n_prompts)
        if epoch not in orders:
            orders[epoch] = torch.randperm(n_prompts, generator=torch.Generator().manual_seed(seed + epoch))
        indices.append(int(orders[epoch][offset]))
    return indices


def ppo_iteration(
    policy, ref_policy, value_model, tokenizer, prompts, row_fields, reward_fn, params, kl_coef, opts,
    ranks: Ranks | None = None, iteration: int = 0,
):  # fmt: skip
    """One rollout batch and its `ppo_epochs` of mini-batch updates. Returns its metrics.
    `prompts` are this process's rows of the batch (`ranks`: all processes hold equal shares)."""
    ranks = ranks or Ranks(policy.device)
    rows = len(prompts)
    first_row, batch_rows = ranks.rank * rows, ranks.world * rows
    keyed = KeyedSampling(params.seed, iteration, first_row, params.temperature) if params.keyed_sampling else None
    device = policy.device
    with mixed_precision(device):
        rollout = generate_rollouts(
            policy, tokenizer, prompts, params.max_new_tokens, params.temperature,
            params.max_length - params.max_new_tokens, keyed=keyed,
        )  # fmt: skip
    ids, attention, start = rollout.input_ids, rollout.attention_mask, rollout.response_start
    mask = rollout.response_mask
    with torch.no_grad(), mixed_precision(device):
        if ref_policy is None:  # LoRA: the policy with its adapters off is the initial policy
            with policy.disable_adapter():
                ref_logprobs = token_logprobs(policy, ids, attention, start, params.temperature)
        else:
            ref_logprobs = token_logprobs(ref_policy, ids, attention, start, params.temperature)
        values = token_values(value_model, ids, attention, start) * mask
    scores = score_completions(reward_fn, prompts, rollout.completions, row_fields).to(values.device)
    kl = per_token_kl(rollout.logprobs, ref_logprobs) * mask
    rewards = kl_adjusted_rewards(scores, kl, kl_coef, mask)
    advantages = gae_advantages(rewards, values, mask, params.gamma, params.lam)
    returns = value_returns(advantages, values, mask)
    if params.whiten_advantages:
        advantages = whiten(advantages, mask, total=ranks.sum)

    (policy_opt, policy_sched), (value_opt, value_sched) = opts
    trainable = {id(m): list(trained_parameters(m).values()) for m in (policy, value_model)}
    stats: dict[str, list[float]] = {}
    for _ in range(params.ppo_epochs):
        # Rows of the whole batch, in rank 0's order (the processes' generators differ
        # after sampling unless it was keyed); each process takes the rows it holds.
        order = ranks.broadcast(torch.randperm(batch_rows).to(ids.device))
        for mb in order.split(params.mini_batch_size):
            mine = mb[(mb >= first_row) & (mb < first_row + rows)] - first_row
            count = ranks.sum(mask[mine].sum().to(torch.float32))
            if len(mine):
                with mixed_precision(device):
                    logprobs, entropy = token_logprobs(
                        policy, ids[mine], attention[mine], start, params.temperature, entropy=True
                    )
                    new_values = token_values(value_model, ids[mine], attention[mine], start)
                policy_loss, clipfrac, approx_kl = clipped_policy_loss(
                    logprobs, rollout.logprobs[mine], advantages[mine], mask[mine], params.cliprange, count
                )
                value_loss, value_clipfrac = clipped_value_loss(
                    new_values, values[mine], returns[mine], mask[mine], params.cliprange_value, count
                )
                entropy = masked_mean(entropy.detach(), mask[mine], count)
            else:  # this process holds no row of the mini-batch: its share of every sum is 0
                policy_loss, value_loss = (sum(p.sum() for p in trainable[id(m)]) * 0.0 for m in (policy, value_model))
                clipfrac = value_clipfrac = approx_kl = entropy = torch.zeros((), device=ids.device)
            for loss, model, opt, sched in (
                (policy_loss, policy, policy_opt, policy_sched),
                (value_loss, value_model, value_opt, value_sched),
            ):
                opt.zero_grad(set_to_none=True)
                # Scaled by the process count: the mean of the processes' gradients is then
                # the gradient of the whole mini-batch's loss (a hook's own term, EWC's,
                # is added by every process and survives the mean unchanged).
                (loss * ranks.world).backward()
                ranks.average_gradients(trainable[id(model)])
                torch.nn.utils.clip_grad_norm_(trainable[id(model)], params.max_grad_norm)
                opt.step()
                sched.step()
            batch_stats = {
                "policy_loss": policy_loss, "value_loss": value_loss, "clipfrac": clipfrac,
                "value_clipfrac": value_clipfrac, "approx_kl": approx_kl, "entropy": entropy,
            }  # fmt: skip
            for key, value in batch_stats.items():
                stats.setdefault(key, []).append(float(ranks.sum(value.detach())))

    def batch_mean(per_row: torch.Tensor) -> float:
        return float(ranks.sum(per_row.float().sum()) / batch_rows)

    return {
        "score": batch_mean(scores),
        "kl": batch_mean(kl.sum(1)),
        "kl_coef": kl_coef,
        **{key: sum(values) / len(values) for key, values in stats.items()},
        "response_length": batch_mean(mask.sum(1)),
    }


def trainable_state(model) -> dict[str, torch.Tensor]:
    return {name: p.detach().contiguous() for name, p in trained_parameters(model).items()}


def latest_checkpoint(directory: Path) -> Path | None:
    """The newest whole checkpoint (a damaged one is discarded, naming it)."""
    return usable_checkpoint(directory, "step", "ppo")


def save_checkpoint(directory: Path, iteration: int, models, opts, kl_coef: float, history: list[dict]) -> None:
    """Everything a resumed run needs, written to a temporary folder and renamed into place;
    older checkpoints are removed after the new one is complete."""
    if not is_main():  # every process holds the same weights and optimizer states
        return
    target = directory / f"step-{iteration}"
    with atomic_dir(target) as tmp:
        for name, model in zip(("policy", "value"), models):
            save_file(trainable_state(model), str(tmp / f"{name}.safetensors"))
        rng = {"cpu": torch.get_rng_state()}
        if torch.cuda.is_available():
            rng["cuda"] = torch.cuda.get_rng_state_all()
        optim = [{"optimizer": opt.state_dict(), "scheduler": sched.state_dict()} for opt, sched in opts]
        torch.save({"optim": optim, "rng": rng}, tmp / "optim.pt")
        (tmp / "state.json").write_text(json.dumps({"iteration": iteration, "kl_coef": kl_coef, "history": history}))
    for old in directory.glob("step-*"):
        if old != target and _STEP_DIR.fullmatch(old.name):
            shutil.rmtree(old, ignore_errors=True)


def load_checkpoint(path: Path, models, opts) -> dict:
    for name, model in zip(("policy", "value"), models):
        state = load_file(str(path / f"{name}.safetensors"), device=str(next(model.parameters()).device))
        expected = set(trainable_state(model))
        if set(state) != expected:
            raise ValueError(
                f"checkpoint {path} does not fit the {name} model ({len(set(state) ^ expected)} parameter names "
                "differ): was it written with other params? Delete the folder to start afresh."
            )
        model.load_state_dict(state, strict=False)
    saved = torch.load(path / "optim.pt", weights_only=True)
    for (opt, sched), states in zip(opts, saved["optim"]):
        opt.load_state_dict(states["optimizer"])
        sched.load_state_dict(states["scheduler"])
    torch.set_rng_state(saved["rng"]["cpu"])
    if "cuda" in saved["rng"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(saved["rng"]["cuda"])
    return json.loads((path / "state.json").read_text())


def train_ppo(
    policy,
    ref_policy,
    value_model,
    tokenizer,
    prompts: list,
    row_fields: dict[str, list],
    reward_fn: Callable,
    params,
    checkpoint_dir: Path,
    log_fn: Callable[[dict, int], None] | None = None,
) -> list[dict]:
    """Train `policy` in place with PPO (`params`: rlhf.training.methods.ppo.Params); return
    one history row per iteration.

    `ref_policy` is frozen (pass a separate copy of the initial policy; with LoRA, None: the
    policy with its adapters disabled is the reference, no second copy); `value_model` is a
    `load_value_model` model, trained in full, or under LoRA with adapters of its own
    (`value_adapters`); with LoRA, None: a value adapter and head on the policy's own
    weights (`SharedTrunkValue`, no second copy). With LoRA the policy's adapter is merged
    into `policy` (and a separate value model's into it) before returning, so they are
    plain models afterwards. Forward passes
    run under bf16 autocast where the process computes in bf16 (`mixed_precision`), and
    with params `model.gradient_checkpointing` both trained models recompute their layers
    in the backward pass (`checkpointed_in_eval`).
    A checkpoint is kept in `checkpoint_dir` every `save_steps` iterations and at the end; a
    call that finds one resumes from it (choose the folder per run, e.g. by fingerprint).

    Under a launcher with N processes each samples rollout_batch_size / N prompts of an
    iteration (module docstring); every process returns the same history."""
    device = torch.device(current().device)
    if device.type == "cuda" and world_size() > 1:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    n = len(prompts)
    bad_fields = [k for k, v in row_fields.items() if len(v) != n]
    if not n or bad_fields:
        raise ValueError(f"need prompts, and row fields of the same length ({n}); wrong length: {bad_fields}")
    if params.rollout_batch_size % world_size():  # check_params says so first; here for a caller of its own
        raise ValueError(
            f"rollout_batch_size ({params.rollout_batch_size}) must be a multiple of the number of training "
            f"processes ({world_size()}, compute.processes): each process samples an equal share"
        )
    ranks = Ranks(device)
    model = policy
    if params.lora.enabled:
        from peft import get_peft_model

        torch.manual_seed(params.seed)  # the adapters' initialisation, whatever ran before in this process
        model = get_peft_model(policy, params.lora.peft_config())
        if value_model is None:  # the policy's weights, with an adapter and a head of its own
            value_model = SharedTrunkValue(model, params.lora)
        else:
            value_model = value_adapters(value_model, params.lora)
    if ref_policy is None and not params.lora.enabled:
        raise ValueError("ref_policy: None only with LoRA (the policy with its adapters off is the reference)")
    if value_model is None:
        raise ValueError("value_model: None only with LoRA (a value adapter and head on the policy's weights)")
    for m in (model, ref_policy, value_model):
        if m is not None:
            m.to(device).eval()  # no dropout anywhere: see the module docstring
    if model_settings.liger_kernels(model_settings.current(), device.type):  # Liger's layer kernels (model.kernels)
        from transformers.integrations.liger import apply_liger_kernel

        for m in (model, value_model.body if isinstance(value_model, ValueHeadModel) else value_model):
            if not isinstance(m, SharedTrunkValue):  # its trunk is the policy's
                apply_liger_kernel(m, dict(NO_FUSED_CROSS_ENTROPY))
    if model_settings.current().gradient_checkpointing:
        for m in (model, value_model.body if isinstance(value_model, ValueHeadModel) else value_model):
            if not isinstance(m, SharedTrunkValue):  # its trunk is the policy's
                checkpointed_in_eval(m)
    if ref_policy is not None:
        ref_policy.requires_grad_(False)
    updates = params.max_steps * params.ppo_epochs * (params.rollout_batch_size // params.mini_batch_size)
    opts = []
    for m, lr in ((model, params.learning_rate), (value_model, params.value_learning_rate or params.learning_rate)):
        opt = torch.optim.AdamW(
            list(trained_parameters(m).values()), lr=lr, weight_decay=params.weight_decay,
            fused=device.type == "cuda",  # one kernel for every tensor's update, as the TRL stages' adamw_torch_fused
        )  # fmt: skip
        warmup = math.ceil(params.warmup_ratio * updates)
        opts.append((opt, get_scheduler(params.lr_scheduler_type, opt, warmup, num_training_steps=updates)))
    kl_ctl = (
        AdaptiveKLController(params.kl_coef, params.target_kl, params.kl_horizon)
        if params.adaptive_kl
        else FixedKLController(params.kl_coef)
    )

    checkpoint_dir = Path(checkpoint_dir)
    start, history = 0, []
    if resume := latest_checkpoint(checkpoint_dir):
        state = load_checkpoint(resume, (model, value_model), opts)
        start, history, kl_ctl.value = state["iteration"], state["history"], state["kl_coef"]
        print(f"ppo: resuming from {resume} (iteration {start})")
    else:
        torch.manual_seed(params.seed)

    for iteration in range(start, params.max_steps):
        step = iteration + 1
        share = params.rollout_batch_size // ranks.world
        indices = prompt_batch(n, params.rollout_batch_size, params.seed, iteration)
        indices = indices[ranks.rank * share : (ranks.rank + 1) * share]
        fields = {key: [values[i] for i in indices] for key, values in row_fields.items()}
        metrics = ppo_iteration(
            model, ref_policy, value_model, tokenizer, [prompts[i] for i in indices], fields, reward_fn, params,
            kl_ctl.value, opts, ranks, iteration,
        )  # fmt: skip
        kl_ctl.update(metrics["kl"], params.rollout_batch_size)
        history.append({"step": step, **metrics})
        if (step % params.logging_steps == 0 or step == params.max_steps) and is_main():
            print(
                f"ppo {step}/{params.max_steps}: score {metrics['score']:.3f} kl {metrics['kl']:.3f} "
                f"beta {metrics['kl_coef']:.4f} policy_loss {metrics['policy_loss']:.4f} "
                f"value_loss {metrics['value_loss']:.4f} length {metrics['response_length']:.1f}"
            )
            if log_fn is not None:
                log_fn(metrics, step)
        if step % params.save_steps == 0 or step == params.max_steps:
            save_checkpoint(checkpoint_dir, step, (model, value_model), opts, kl_ctl.value, history)
    merged_model(model)  # the policy's adapter (the active one): a shared trunk's value adapter goes
    if params.lora.enabled and not isinstance(value_model, SharedTrunkValue):
        unwrapped_value_model(value_model)
    return history
