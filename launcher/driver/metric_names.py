"""The keys of a step's metrics row (metrics.jsonl, TensorBoard, wandb), in one place: the driver
writes them (grpo, rollout), and the progress line (launcher.progress), the status view, the
summary and plot (driver.metrics), the start-up breakdown (driver.startup) and the retention
metric (`checkpointing.metric_name`, launcher.config.ranges) read them.

Torch-free and importing nothing: the shared data of every stage (tests/unit/test_import_rules.py);
no other module of launcher/ writes such a key as a string (tests/unit/test_one_home.py).
"""

from __future__ import annotations

STEP = "step"
SAMPLE = "sample"                                    # one generated text of the step
# the policy on the step's samples
REWARD = "train/reward"
GEN_KL_ERROR = "train/gen_kl_error"                  # trainer vs generator logprobs (driver.agreement)
TOKEN_MULT_PROB_ERROR = "train/token_mult_prob_error"
MEAN_RESPONSE_TOKENS = "train/mean_response_tokens"
TRAIN = "train/"                                     # + a key of the trainer's own (workers.trainer.actor.MegatronTrainer.train)
LOSS = TRAIN + "loss"
# greedy validation (every grpo.val_period steps; with AT_START appended: before the first step)
VAL = "val/"
VAL_REWARD = "val/reward"
VAL_ACCURACY = "val/accuracy"
VAL_REWARD_ERRORS = "val/reward_errors"
VAL_SAMPLE = "val/sample"
AT_START = "_at_start"
# the step's parts, in seconds
STEP_TIME = "timing/total_step"
REFIT_TIME = "timing/transfer_and_update_weights"
GENERATION_TIME = "timing/generation"
LOGPROBS_TIME = "timing/logprobs"
TRAINING_TIME = "timing/training"
VALIDATION_TIME = "timing/validation"
CHECKPOINT_TIME = "timing/checkpoint"
# the refit, the data and the rewards
REFIT_BYTES = "refit/bytes"
REFIT_TENSORS = "refit/tensors"
DROPPED_PROMPTS = "data/dropped_prompts"             # prompts longer than the limit, skipped
REWARD_ERRORS = "reward/errors"

# what checkpoint retention may rank by (checkpointing.metric_name)
RANKABLE = (REWARD, LOSS, TRAIN + "kl", TRAIN + "grad_norm", GEN_KL_ERROR, TOKEN_MULT_PROB_ERROR,
            MEAN_RESPONSE_TOKENS, TRAIN + "clip_fraction_low", TRAIN + "clip_fraction_high", TRAIN + "ratio_mean",
            VAL_REWARD, VAL_ACCURACY)
