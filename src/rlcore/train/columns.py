"""The trainer's dock columns: every column its stages, recipes, prompt sources and agent rollout exchange.

:data:`COLUMNS` is the :class:`rlcore.dataflow.Schema` the trainer builds its
:class:`rlcore.dataflow.StageGraph` with: a stage that names an undeclared column is
refused when the graph is built, and a column put with another dtype when the data flows
(naming the stage, the column, the dtype it got and the one declared here). The name
lists the stages and loaders use (:data:`rlcore.train.PROMPT_COLUMNS`,
:data:`rlcore.train.PAIR_TOKEN_COLUMNS`, :data:`rlcore.train.ROLLOUT_COLUMNS`) are
selected from it.

Two masks, one name and one dtype each:

* ``mask`` (float32, over the response positions) is the **policy-token mask**: 1.0 on
  the tokens the policy sampled, which the recipes read as their ``mask`` (losses weight
  tokens by it, and the advantages stage passes it to the recipe as it is);
* ``prompt_mask`` (int64, over the left-padded prompt) is the **prompt mask**, the
  prompt's attention mask (the ids' ``[N, P]`` companion, as a Hugging Face attention
  mask is int64).

A multi-turn trajectory's other response tokens (observations) are in ``trajectory_mask``
(float32): what the forwards attend, not what the recipes train on. ``loss_mask`` is the
recipe's ``mask`` after its shaping (DAPO's dynamic sampling zeroes whole rows). The pair
columns of DPO (``chosen_*`` / ``rejected_*``) hold whole sequences, prompt included,
in the int64 layout of :func:`rlcore.train.response_sequences`.
"""

from __future__ import annotations

import torch

from rlcore.dataflow import Column, Schema

__all__ = ["COLUMNS"]

_F, _I = torch.float32, torch.int64

COLUMNS = Schema(
    [
        # What a prompt loader puts (rlcore.train.prompts).
        Column("prompts", _I, "token", "prompt token ids, left-padded (the padding is where prompt_mask is 0)"),
        Column("prompt_mask", _I, "token", "the prompt mask: 1 on the prompt's tokens, 0 on its left padding"),
        Column("answers", _I, "ragged", "token ids of the reference answer (read with the dock's bool answers_mask)"),
        Column("group", _I, "scalar", "the prompt's index in the step: the rows of one prompt form a group"),
        Column("iteration", _I, "scalar", "the training step the row belongs to"),
        Column("row", _I, "scalar", "the row's index in the step's global batch (keys its random streams)"),
        Column("prompt_step", _I, "scalar", "deploy.carry_over: the step whose prompts the row answers (its key)"),
        Column("index", _I, "scalar", "the dataset row of the prompt or pair (prompt and preference datasets)"),
        # The rollout.
        Column("responses", _I, "token", "response token ids, right-padded (multi-turn: policy and observation ids)"),
        Column("mask", _F, "token", "the policy-token mask: 1.0 on the tokens the policy sampled (to <eos>), else 0.0"),
        Column("trajectory_mask", _F, "token", "multi-turn: 1.0 on every response token, policy and observation"),
        Column("version", _I, "scalar", "the policy version the row was sampled with"),
        Column(
            "token_version",
            _I,
            "token",
            "the policy version that sampled each policy token (an interrupted rollout's change mid-row), 0 elsewhere",
        ),
        Column("policy_version", _I, "scalar", "the weights version of a rollout stage's call (the scheduler's)"),
        Column(
            "rollout_logp",
            _F,
            "token",
            "the sampler's log-prob of each policy token (the behaviour policy's), 0 elsewhere",
        ),
        Column("rewards", _F, "token", "multi-turn: each turn's reward on its last policy token"),
        Column("num_turns", _I, "scalar", "multi-turn: the trajectory's turns"),
        Column("num_tool_calls", _I, "scalar", "multi-turn: the tool calls it made"),
        Column("num_tool_errors", _I, "scalar", "multi-turn: the tool calls that failed"),
        Column("tool_latency", _F, "scalar", "multi-turn: seconds spent in tools"),
        Column("num_env_errors", _I, "scalar", "multi-turn: environment errors (one ends the trajectory)"),
        Column("truncated", torch.bool, "scalar", "multi-turn: the trajectory hit a token or turn budget"),
        # The reward and the scoring forwards.
        Column("scores", _F, "scalar", "the row's outcome reward"),
        Column(
            "score_parts",
            _F,
            "token",
            "GDPO: each reward component's unweighted score [N, K], one per entry of the rewards list",
        ),
        Column("old_logp", _F, "token", "log-probs of the response tokens under the policy that sampled them"),
        Column("entropy", _F, "token", "the policy's entropy at each response position"),
        Column(
            "sum_pi_squared",
            _F,
            "token",
            "the old policy's sum_v pi(v)^2 at each response position (the optimal token baseline reads it)",
        ),
        Column("ref_logp", _F, "token", "log-probs of the response tokens under the reference policy"),
        Column("old_values", _F, "token", "the critic's values before each response token (PPO)"),
        # The recipe's advantages stage.
        Column("advantages", _F, "token", "the recipe's advantages"),
        Column("loss_mask", _F, "token", "the recipe's mask after its shaping: the tokens the update trains on"),
        Column("returns", _F, "token", "GAE's returns, the critic's targets (PPO)"),
        # Preference pairs (DPO): each side's whole sequence, prompt included.
        Column("chosen_input_ids", _I, "ragged", "DPO: the chosen side's prompt + response ids"),
        Column("chosen_attention_mask", _I, "ragged", "DPO: 1 on each token of the chosen sequence"),
        Column("chosen_mask", _I, "ragged", "DPO: 1 on the chosen response's tokens (the ones scored)"),
        Column("rejected_input_ids", _I, "ragged", "DPO: the rejected side's prompt + response ids"),
        Column("rejected_attention_mask", _I, "ragged", "DPO: 1 on each token of the rejected sequence"),
        Column("rejected_mask", _I, "ragged", "DPO: 1 on the rejected response's tokens (the ones scored)"),
        Column("ref_chosen_logps", "float", "scalar", "DPO: the reference's summed log-prob of the chosen response"),
        Column("ref_rejected_logps", "float", "scalar", "DPO: the reference's summed log-prob of the rejected one"),
        # Supervised demonstrations (SFT): each row's whole sequence, prompt included.
        Column("sft_input_ids", _I, "ragged", "SFT: the prompt + response ids"),
        Column("sft_attention_mask", _I, "ragged", "SFT: 1 on each token of the sequence"),
        Column("sft_mask", _I, "ragged", "SFT: 1 on the response's tokens and its EOS (the ones trained on)"),
        # The update.
        Column("loss", _F, "scalar", "the loss of the update that trained on the row"),
    ],
    declared_in="rlcore.train.columns.COLUMNS",
)
