"""The keys of a step's metrics row (metrics.jsonl, TensorBoard, wandb), in one place: the driver
writes them (grpo, rollout), and the progress line (launcher.progress), the status view, the
summary and plot (driver.metrics), the start-up breakdown (driver.startup) and the retention
metric (`checkpointing.metric_name`, its set in launcher.config.schema) read them.

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
EXPOSED_GENERATION_TIME = "timing/exposed_generation"   # the loop waited for generator work (pipeline)
IDLE_GENERATION_TIME = "timing/idle_generation"         # the engines waited for work (pipeline)
# the refit, the data and the rewards
REFIT_BYTES = "refit/bytes"
REFIT_TENSORS = "refit/tensors"
DROPPED_PROMPTS = "data/dropped_prompts"             # prompts longer than the limit, skipped
REWARD_ERRORS = "reward/errors"
TRUNCATED_FRACTION = "response/truncated_fraction"   # responses cut at grpo.max_new_tokens
# multi-turn episodes (env.fn; launcher.driver.episodes): means over the step's episodes
EPISODE_TURNS = "env/turns"
EPISODE_TOKENS = "env/episode_tokens"                # every token after the prompt: the model's and the environment's
ENV = "env/"                                         # + what the environment's respond() counts (env/tool_calls)
# DAPO dynamic sampling (grpo.dynamic_sampling.enabled)
KEPT_GROUPS = "dynamic_sampling/kept_groups"
GEN_BATCHES = "dynamic_sampling/gen_batches"
GENERATED_SAMPLES = "dynamic_sampling/generated_samples"
# the pipelined schedule (grpo.pipeline.enabled; launcher.driver.pipeline)
LAG = "pipeline/lag"                                 # steps between the generating weights and the trained ones
GENERATED_WITH = "pipeline/generated_with"           # the weights version that generated the step's rollout
OFF_POLICY_KL = "pipeline/off_policy_kl"             # generation vs the trainers' newer weights

# what checkpoint retention may rank by (checkpointing.metric_name)
RANKABLE = (REWARD, LOSS, TRAIN + "kl", TRAIN + "grad_norm", GEN_KL_ERROR, TOKEN_MULT_PROB_ERROR,
            MEAN_RESPONSE_TOKENS, TRAIN + "clip_fraction_low", TRAIN + "clip_fraction_high", TRAIN + "ratio_mean",
            VAL_REWARD, VAL_ACCURACY)
