"""The multi-turn episode loop (launcher.driver.episodes) against its anchors' conventions, run on the
inputs their own tests publish. Where our convention differs on purpose, a test shows both side by side.

Sources (each vector names its file and test beside it):
  NEMO = NVIDIA-NeMo/RL at 7ea279abfbeb698b092856d0dab61e7cf39bc909:
         nemo_rl/experience/rollouts.py (run_multi_turn_rollout, run_sample_multi_turn_rollout),
         tests/unit/experience/test_rollouts.py, tests/unit/test_envs.py (the multi-step calculator),
         nemo_rl/environments/games/sliding_puzzle.py, nemo_rl/algorithms/grpo.py (the loss mask),
         nemo_rl/models/generation/vllm/vllm_worker_async.py (a turn's max_tokens)
  VERL = volcengine/verl at b178a3cd56f58b2d502255daba591e92833930a7 (v0.7.0-125):
         verl/experimental/agent_loop/tool_agent_loop.py, agent_loop.py (apply_chat_template with
         remove_system_prompt), tool_parser.py (HermesToolParser), verl/utils/chat_template.py
         (initialize_system_prompt), verl/interactions/gsm8k_interaction.py,
         tests/experimental/agent_loop/test_basic_agent_loop.py, tests/interactions/test_gsm8k_interaction.py

Their rollout tests run a real model (Qwen2.5-1.5B-Instruct in verl's, a vLLM-served model in NeMo RL's);
here the model is scripted with the replies those tests expect of it, and the tokenizer is the lossless
byte-level one with the published Qwen2.5 template (tests/helpers/byte_tokenizer.py), or the word-level
ChatML one of tests/unit/test_episodes.py.
"""

from __future__ import annotations

import json
import re
import textwrap
from types import SimpleNamespace

import pytest

from launcher.config.compose import compose
from launcher.config.schema import typed
from launcher.driver import episodes, tool_calls
from launcher.driver.data import Example
from launcher.driver.environments import Environments
from tests.helpers.byte_tokenizer import make
from tests.unit.test_episodes import CALL, TOK, ScriptedTurns, run, run_tools

BYTES = make()   # byte-level, the published Qwen2.5 chat template (tools, <tool_response>, default system prompt)
SLOW = "reward.timeout_s=120"   # per environment call: a loaded machine's worker can be slow


class ScriptByPrompt(ScriptedTurns):
    """ScriptedTurns, each episode with its own replies: {a phrase of its prompt: [turn 0's reply, ...]}."""

    def __init__(self, tok, scripts: dict[str, list[str]]):
        super().__init__(tok, [""])
        self.scripts = scripts

    def generate(self, prompts, temperature, top_p, max_tokens, seeds):
        self.calls.append({"prompts": [list(p) for p in prompts], "max_tokens": list(max_tokens)})
        outs = []
        for prompt, limit in zip(prompts, max_tokens):
            text = self.tok.decode(prompt)
            replies = next(r for phrase, r in self.scripts.items() if phrase in text)
            turn = text.count("<|im_start|>assistant") - 1
            ids = self.tok(replies[min(turn, len(replies) - 1)], add_special_tokens=False)["input_ids"]
            ids = (ids + [self.tok.eos_token_id])[:limit]
            outs.append(SimpleNamespace(token_ids=ids, text=self.tok.decode(ids, skip_special_tokens=True),
                                        logprobs=[-0.1] * len(ids),
                                        finish_reason="stop" if self.tok.eos_token_id in ids else "length"))
        return outs


def run_env(tmp_path, source: str, records: list[dict], engine, *overrides, tok=BYTES):
    """episodes.sample of `records` with the environment `source` (an Env class, written to env.py)."""
    (tmp_path / "env.py").write_text(textwrap.dedent(source))
    cfg = typed(compose([f"env.fn={tmp_path / 'env.py'}:Env", "grpo.num_generations_per_prompt=2", "reward.workers=1",
                         "grpo.max_total_sequence_length=4096", "vllm.max_model_len=4096", "grpo.max_new_tokens=64",
                         SLOW, *overrides]))
    envs = Environments(cfg, tmp_path / "run")
    try:
        return episodes.sample(cfg, engine, envs, tok,
                               [Example(i, r, where=f"line {i + 1}") for i, r in enumerate(records)], step=1)
    finally:
        envs.close()


def split(tok, r, i: int) -> tuple[str, str]:
    """(the model's tokens, the environment's tokens) of episode i, each decoded as one text."""
    pairs = list(zip(r.response_ids[i], r.response_mask[i]))
    return (tok.decode([t for t, m in pairs if m], skip_special_tokens=False),
            tok.decode([t for t, m in pairs if not m], skip_special_tokens=False))


# ================================================================================ NeMo RL
# NEMO tests/unit/test_envs.py: _MultiStepCalculatorLogic.process_turn, as an env.fn class. One change:
# the observation's role is "user", not NeMo RL's "environment" (NeMo RL appends the observation's
# content as raw tokens, so the role is never rendered; the Qwen2.5 template renders no "environment"
# message: see test_a_message_the_template_does_not_render_is_not_lost_silently).
CALCULATOR = '''
    class Env:
        def __init__(self, example):
            self.problem, self.expected = example["problem"], example["answer"]
            self.max_steps, self.current_step = 5, 0

        def first_messages(self):
            tool_instructions = (  # NEMO test_rollouts.py initial_multi_step_calculator_batch, verbatim
                "You have a calculator tool. To use it, respond with:\\n"
                "'[operand1, operand2, operation_name]<call: calculator>'\\n"
                "The valid 'operation_name' values are exactly: 'sum', 'diff', 'prod', 'div'.\\n"
                "Example: [5, 3, sum]<call: calculator>\\n"
                "You will receive the result of your calculation as <result>...</result>\\n"
                "Use this result to make the next calculation if needed.\\n"
                "IMPORTANT: Only perform one calculation step (one tool call) before waiting for a result "
                "and making a new tool call.\\n"
                "IMPORTANT: Do not perform any other calculations or operations aside from the tool call and "
                "result. Doing so will result in failure.\\n"
                "To give the final answer, just output the number. numbers inside of <result> don't count, so "
                "output just the final number yourself outside of this.\\n"
                "Example full output: [2, 4, sum]<call: calculator>\\n<result>6.0</result>\\n[6, 6, diff]"
                "<call: calculator>\\n<result>0.0</result> 0\\n(note how you have to output the final 0 outside "
                "of the tags)"
                "------\\n"
                f"Solve: {self.problem}"
            )
            return [{"role": "user", "content": tool_instructions}]

        def _parse_tool_call(self, text):
            suffix = "<call: calculator>"
            if not text.strip().endswith(suffix):
                return None
            content = text.strip()[: -len(suffix)].strip()
            if not (content.startswith("[") and content.endswith("]")):
                return None
            parts = content[1:-1].split(",")
            if len(parts) != 3:
                return None
            try:
                return float(parts[0].strip()), float(parts[1].strip()), parts[2].strip().lower()
            except ValueError:
                return None

        def _calculate(self, a, b, op):
            if op == "sum":
                return a + b
            if op == "diff":
                return a - b
            if op == "prod":
                return a * b
            if op == "div":
                return None if abs(b) < 1e-6 else a / b
            return None

        def _is_final_answer(self, text):
            t = text.strip()
            if t.startswith("<final_answer>") and t.endswith("</final_answer>"):
                t = t[len("<final_answer>"):-len("</final_answer>")]
            try:
                return float(t)
            except ValueError:
                return None

        def respond(self, reply):
            reply = reply.strip()
            if self.current_step >= self.max_steps:
                return self._say("<error>Maximum steps reached.", 0.0, True)
            final = self._is_final_answer(reply)
            if final is not None:
                if abs(final - self.expected) < 1e-6:
                    return self._say(f"Correct! The final answer is {final:.2f}.", 1.0, True)
                return self._say(f"Incorrect final answer. Expected {self.expected:.2f}, got {final:.2f}.", 0.0, True)
            call = self._parse_tool_call(reply)
            if call is None:
                return self._say("<error>Invalid response. Expected tool call or final answer.", 0.0, True)
            result = self._calculate(*call)
            if result is None:
                return self._say("<error>Calculation failed.", 0.0, True)
            self.current_step += 1
            return self._say(f"<result>{result:.5f}</result>", 0.0, False)

        def _say(self, content, reward, done):
            return {"messages": [{"role": "user", "content": content}], "reward": reward, "done": done}
'''

# NEMO tests/unit/experience/test_rollouts.py initial_multi_step_calculator_batch: the problems and answers
PROBLEMS = [{"problem": "(5 + 3) * 2", "answer": 16.0}, {"problem": "(1 * 9) + 2", "answer": 11.0}]
# the replies test_run_multi_step_calculator_vllm_sync expects of the model: tool calls, then the number
SOLVED = {"Solve: (5 + 3) * 2": ["[5, 3, sum]<call: calculator>", "[8, 2, prod]<call: calculator>", "16"],
          "Solve: (1 * 9) + 2": ["[1, 9, prod]<call: calculator>", "[9, 2, sum]<call: calculator>", "11"]}


def test_nemo_rl_multi_step_calculator_total_reward_is_the_sum_of_its_turns(tmp_path):
    """NEMO test_rollouts.py test_run_multi_step_calculator_vllm_sync: max_rollout_turns = max_steps + 1 = 6,
    every sample makes at least one tool call (an assistant message ending "<call: calculator>"), its
    final answer parses to the expected number, and total_reward == 1.0 (run_multi_turn_rollout sums the
    environment's per-turn rewards: 0 + 0 + 1). NEMO's turn count (sample_turn_counts, one per
    generation + environment step) is 3 here, ours env/turns likewise."""
    r = run_env(tmp_path, CALCULATOR, PROBLEMS, ScriptByPrompt(BYTES, SOLVED), "grpo.max_turns=6")
    assert r.rewards == [1.0] * 4 and r.reward_errors == 0
    assert [m["env/turns"] for m in r.episodes] == [3] * 4
    for i, (p, answer) in enumerate([(p, p["answer"]) for p in PROBLEMS for _ in range(2)]):
        model, env = split(BYTES, r, i)
        assert model.count("<call: calculator><|im_end|>") == 2          # tool_call_count >= 1
        assert float(r.texts[i]) == answer                               # the final answer, parsed
        assert env.count("<result>") == 2 and "Correct!" not in env      # the terminating message: see below
    model, env = split(BYTES, r, 0)
    assert "<result>8.00000</result>" in env and "<result>16.00000</result>" in env


def test_nemo_rl_calculator_at_max_steps_ends_on_the_last_allowed_turn(tmp_path):
    """NEMO tests/unit/test_envs.py process_turn: once current_step >= max_steps (5) the environment ends
    the episode ("<error>Maximum steps reached.", reward 0). With max_rollout_turns = max_steps + 1 (6,
    as the NEMO test sets it) a model that only calls the tool has 5 results and is stopped on turn 6:
    the environment is asked on the last turn too (its reward counts), as run_multi_turn_rollout asks it."""
    r = run_env(tmp_path, CALCULATOR, PROBLEMS[:1], ScriptByPrompt(BYTES, {"Solve": ["[1, 1, sum]<call: calculator>"]}),
                "grpo.max_turns=6")
    assert [m["env/turns"] for m in r.episodes] == [6, 6] and r.rewards == [0.0, 0.0]
    assert split(BYTES, r, 0)[1].count("<result>2.00000</result>") == 5


def test_observations_are_rendered_by_the_template_where_nemo_rl_appends_raw_content(tmp_path):
    """NEMO test_rollouts.py test_sync_vlm_multiturn_drops_stale_native_content: a prompt of token [1],
    a model that generates token 9, an environment whose observation "next" tokenizes to [7] and that
    terminates on its 2nd step, max_rollout_turns=2: two generation calls, the second given [1, 9, 7]:
    NeMo RL appends `tokenizer(observation["content"])` as it is (rollouts.py: "TODO @sahilj: handle if
    we want these subsequent messages to have a chat template").

    Ours differs on purpose (the issue: "observation tokens appended as the chat template renders
    them"): after the model's reply come the rest of its assistant turn (ChatML's newline after the
    <|im_end|> it generated), the observation as a user turn, and the next generation prompt, so the
    second prompt is exactly what the chat template renders for the conversation so far: what the
    model is trained on is what it is served."""
    env = '''
        class Env:
            def __init__(self, example):
                self.steps = 0
            def first_messages(self):
                return [{"role": "user", "content": ""}]
            def respond(self, reply):
                self.steps += 1
                return {"messages": [{"role": "user", "content": "next"}], "reward": 0.0, "done": self.steps >= 2}
    '''
    engine = ScriptedTurns(BYTES, ["ok"])
    r = run_env(tmp_path, env, [{}], engine, "grpo.max_turns=2")
    assert len(engine.calls) == 2                                      # NEMO: len(generation.calls) == 2
    first, second = engine.calls[0]["prompts"][0], engine.calls[1]["prompts"][0]
    reply = BYTES("ok", add_special_tokens=False)["input_ids"] + [BYTES.eos_token_id]
    ids = BYTES.encode
    nemo = first + reply + ids("next", add_special_tokens=False)       # NEMO's [1, 9, 7]
    ours = first + reply + ids("\n<|im_start|>user\nnext<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    assert second == ours and second != nemo
    conversation = [{"role": "user", "content": ""}, {"role": "assistant", "content": "ok"},
                    {"role": "user", "content": "next"}]
    assert second == ids(BYTES.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True),
                         add_special_tokens=False)
    assert r.rewards == [0.0, 0.0]


def test_the_terminating_observation_is_not_kept_where_both_anchors_keep_it(tmp_path):
    """NEMO rollouts.py run_multi_turn_rollout appends the environment's observation for every active
    sample before it filters the terminated ones ("This must happen BEFORE filtering based on done
    flags"), and VERL tool_agent_loop.py _handle_interacting_state appends the interaction's last user
    message before it checks should_terminate_sequence (VERL test_basic_agent_loop.py
    test_tool_agent_with_interaction: "[user, assistant, user]" is num_turns 3). Both end an episode
    with environment tokens that carry no loss.

    Ours ends with the model's last token: nothing after it changes the loss (those tokens are masked
    and, attention being causal, no earlier logprob sees them), so they would only cost compute. The
    terminating message stays in the environment's conversation (reward.fn does not see it either)."""
    r, _, _ = run(tmp_path, [{"q": "what is 2 + 3 ?", "turns": 2}], SLOW)
    assert r.response_mask[0][-1] == 1 and r.response_ids[0][-1] == TOK.eos_token_id
    assert TOK.decode(r.response_ids[0]).count("<|im_start|> user") == 1   # turn 1's message, not turn 2's


def test_a_turns_max_tokens_and_the_budget_as_nemo_rl_and_verl_spend_them(tmp_path):
    """A turn's max_tokens: NEMO vllm_worker_async.py `allowed_new_tokens = max(0, min(max_new_tokens,
    max_model_len - input_length))`, ours min(grpo.max_new_tokens, grpo.max_total_sequence_length - the
    episode's length), on NEMO test_rollouts.py's numbers (test_max_seqlen_respected_sync: max_seq_len 290;
    base_vllm_test_config: max_new_tokens 50).

    An observation that does not fit: NEMO cuts it to the tokens left and ends the episode, so that
    test asserts the flattened episode is exactly max_seq_len (290) long. VERL tool_agent_loop.py
    `if len(response_mask) + len(response_ids) >= response_length: return AgentState.TERMINATED` drops it
    whole. Ours drops it whole, as verl does (a cut observation is not what the template renders, and the
    model would never answer it): the episode ends with the model's last reply, under 290, truncated."""
    r, engine, _ = run(tmp_path, [{"q": "what is 2 + 3 ?", "turns": 64}], "grpo.max_turns=64",
                       "grpo.max_total_sequence_length=290", "vllm.max_model_len=290", "grpo.max_new_tokens=50", SLOW)
    assert all(c["max_tokens"] == [min(50, 290 - len(p)) for p in c["prompts"]] for c in engine.calls)
    assert any(t < 50 for c in engine.calls for t in c["max_tokens"])   # the budget did bind
    for p, s, m in zip(r.prompt_ids, r.response_ids, r.response_mask):
        assert len(p) + len(s) < 290 and m[-1] == 1    # NEMO: == 290, its last tokens the cut observation
    assert r.truncated == [True, True]


def test_loss_mask_covers_the_generated_tokens_end_of_turn_included(tmp_path):
    """NEMO grpo.py: token_loss_mask is 1 on generated assistant messages (their token_ids are vLLM's
    output, the end-of-turn token included) and 0 on everything else, whose generation_logprobs are
    zero-filled; VERL tool_agent_loop.py: response_mask += [1] * len(output.token_ids) for the model,
    [0] * len(...) for tool/user messages, response_logprobs += [0.0] for them. Ours the same: here the
    loss covers "<tool_call>...</tool_call><|im_end|>" and "5<|im_end|>" exactly, and the template's
    newline after each <|im_end|> is the environment's (loss 0), as VERL test_basic_agent_loop.py
    test_tool_agent checks: no "<tool_response>" in the tokens under the mask."""
    r, tok, _ = run_tools(tmp_path, [CALL, "5"], SLOW)
    model, env = split(tok, r, 0)
    assert model == CALL + "<|im_end|>" + "5<|im_end|>"
    assert "<tool_response>" not in model and "</tool_response>" not in model and "<tool_response>" in env
    assert all(lp == 0.0 for lp, m in zip(r.generation_logprobs[0], r.response_mask[0]) if not m)
    assert all(lp == -0.1 for lp, m in zip(r.generation_logprobs[0], r.response_mask[0]) if m)


# ================================================================================ verl
WEATHER = '''
    def get_current_temperature(location: str, unit: str = "celsius"):
        """Get current temperature at a location.

        Args:
            location: The location to get the temperature for, in the format "City, State, Country".
            unit: The unit to return the temperature in. Defaults to "celsius". (choices: ["celsius", "fahrenheit"])

        Returns:
            the temperature, the location, and the unit in a dict
        """
        return {"temperature": 26.1, "location": location, "unit": unit}


    def get_temperature_date(location: str, date: str, unit: str = "celsius"):
        """Get temperature at a location and date.

        Args:
            location: The location to get the temperature for, in the format "City, State, Country".
            date: The date to get the temperature for, in the format "Year-Month-Day".
            unit: The unit to return the temperature in. Defaults to "celsius". (choices: ["celsius", "fahrenheit"])

        Returns:
            the temperature, the location, the date and the unit in a dict
        """
        return {"temperature": 25.9, "location": location, "date": date, "unit": unit}
'''

# VERL test_basic_agent_loop.py test_tool_agent: raw_prompts, verbatim
VERL_PROMPTS = [
    [{"role": "user", "content": "How are you?"}],
    [{"role": "user", "content": "What's the temperature in Los Angeles now?"}],
    [{"role": "user", "content": "What's the temperature in New York now?"}],
    [{"role": "system", "content": "You are Qwen, created by Alibaba Cloud. You are a helpful assistant.\n\n"
                                   "Current Date: 2024-09-30"},
     {"role": "user", "content": "What's the temperature in San Francisco now? How about tomorrow?"}],
]
# VERL test_tool_agent's expected __num_turns__: "[user, assistant]" 2 for the first prompt,
# "[user, assistant, tool, assistant]" 4 for the others
VERL_NUM_TURNS = [2, 4, 4, 4]


def _call(name: str, **arguments) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


# what a Qwen2.5 model answers to VERL_PROMPTS (test_tool_agent sets max_parallel_calls = 2: San
# Francisco's two questions are two calls of one reply)
WEATHER_REPLIES = {
    "How are you?": ["I'm fine, thank you."],
    "Los Angeles": [_call("get_current_temperature", location="Los Angeles, CA, USA"), "It is 26.1 °C."],
    "New York": [_call("get_current_temperature", location="New York, NY, USA"), "It is 26.1 °C."],
    "San Francisco": [_call("get_current_temperature", location="San Francisco, CA, USA") + "\n"
                      + _call("get_temperature_date", location="San Francisco, CA, USA", date="2024-10-01"),
                      "26.1 °C now, 25.9 °C tomorrow."],
}


def test_verl_tool_agent_prompts_turns_and_response_mask(tmp_path):
    """VERL test_basic_agent_loop.py test_tool_agent, through env.fn=tools with its two weather tools:
    __num_turns__ is 2 for "How are you?" and 4 for the weather questions, and the tokens under
    response_mask hold no "<tool_response>" / "</tool_response>".

    The counts differ by definition: VERL's num_turns = user_turns + assistant_turns + 1 (every
    message, the prompt as one), ours env/turns counts the model's turns (NEMO's turn_count does the
    same): 1 and 2 here, so VERL's = 1 + env/turns + the environment's turns in between. Each tool's
    answer is the JSON text of its result, as VERL's WeatherTool.execute returns json.dumps(result)."""
    (tmp_path / "weather.py").write_text(textwrap.dedent(WEATHER))
    weather = tmp_path / "weather.py"
    tools = f"env.tools=[{weather}:get_current_temperature,{weather}:get_temperature_date]"
    cfg = typed(compose(["env.fn=tools", tools, "data.messages_key=messages", "grpo.num_generations_per_prompt=2",
                         "reward.workers=1", "grpo.max_total_sequence_length=4096", "vllm.max_model_len=4096",
                         "grpo.max_new_tokens=256", SLOW]))
    envs = Environments(cfg, tmp_path / "run")
    try:
        r = episodes.sample(cfg, ScriptByPrompt(BYTES, WEATHER_REPLIES), envs, BYTES,
                            [Example(i, {"messages": m}) for i, m in enumerate(VERL_PROMPTS)], step=1)
    finally:
        envs.close()
    assert r.reward_errors == 0
    for i, ep in enumerate(r.episodes):
        verl_turns = VERL_NUM_TURNS[i // 2]
        assert 1 + ep["env/turns"] + (ep["env/turns"] - 1) == verl_turns      # prompt + model turns + tool turns
        assert ep["env/tool_calls"] == [0, 1, 1, 2][i // 2] and ep["env/tool_errors"] == 0
        model, env = split(BYTES, r, i)
        assert "<tool_response>" not in model and "</tool_response>" not in model
        if verl_turns == 4:
            assert env.count("<|im_start|>user\n<tool_response>") == 1          # parallel calls: one user turn
    la = split(BYTES, r, 2)[1]
    assert '<tool_response>\n{"temperature": 26.1, "location": "Los Angeles, CA, USA", "unit": "celsius"}\n' \
           '</tool_response>' in la
    sf = split(BYTES, r, 6)[1]
    assert sf.count("<tool_response>") == 2 and '"date": "2024-10-01"' in sf
    assert "Current Date: 2024-09-30" in BYTES.decode(r.prompt_ids[6])     # the record's system message, kept


def _verl_system_prompt(tok) -> list[int]:
    """VERL verl/utils/chat_template.py initialize_system_prompt, as written there."""
    token1 = tok.apply_chat_template([{"role": "user", "content": ""}], add_generation_prompt=False, tokenize=False)
    token2 = tok.apply_chat_template([{"role": "user", "content": ""}] * 2, add_generation_prompt=False, tokenize=False)
    token1, token2 = tok.encode(token1, add_special_tokens=False), tok.encode(token2, add_special_tokens=False)
    return token1[: -(len(token2) - len(token1))]


def _verl_observation(tok, messages: list[dict]) -> list[int]:
    """VERL agent_loop.py apply_chat_template(add_messages, remove_system_prompt=True) for a text-only
    tokenizer: the new messages rendered alone with the generation prompt, less the system prompt prefix."""
    ids = tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
                     add_special_tokens=False)
    return ids[len(_verl_system_prompt(tok)):]


def test_observation_tokens_keep_the_templates_newline_after_the_turn_where_verl_drops_it(tmp_path):
    """VERL tool_agent_loop.py _handle_processing_tools_state renders the tool messages alone
    (apply_chat_template(add_messages, remove_system_prompt=True)) and appends them right after the
    model's tokens: "<|im_end|>" then "<|im_start|>user\\n<tool_response>...". The Qwen2.5 template puts
    a newline between those two ("<|im_end|>\\n<|im_start|>"), and VERL's tokens leave it out, so its
    training sequence is not what the template renders for the same conversation.

    Ours is the template's rendering (the issue: "observation tokens appended as the chat template
    renders them"): VERL's observation tokens with the template's "\\n" before them, and the episode a
    prefix of the template's rendering of the whole conversation."""
    r, tok, _ = run_tools(tmp_path, [CALL, "5"], SLOW)
    tool = [{"role": "tool", "content": "5"}]
    ours = [t for t, m in zip(r.response_ids[0], r.response_mask[0]) if not m]
    verl = _verl_observation(tok, tool)
    assert tok.decode(verl) == \
        "<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    assert ours == tok.encode("\n", add_special_tokens=False) + verl
    schemas = [tool_calls.schema(f) for f in _add_tool()]
    conversation = [{"role": "user", "content": "what is 2 + 3 ?"}, {"role": "assistant", "content": CALL}, *tool,
                    {"role": "assistant", "content": "5"}]
    whole = tok.apply_chat_template(conversation, tools=schemas, tokenize=False)
    reply = tok.encode(CALL, add_special_tokens=False) + [tok.eos_token_id]
    verl_text = tok.decode(r.prompt_ids[0] + reply + verl, skip_special_tokens=False)
    ours_text = tok.decode(r.prompt_ids[0] + r.response_ids[0], skip_special_tokens=False)
    assert whole.startswith(ours_text) and not whole.startswith(verl_text)
    assert verl_text.replace("<|im_end|><|im_start|>", "<|im_end|>\n<|im_start|>") == ours_text[:len(verl_text) + 1]


def _add_tool():
    from tests.unit.test_episodes import TOOLS

    ns: dict = {}
    exec(TOOLS, ns)
    return [ns["add"]]


def _verl_hermes(text: str) -> list[tuple[str, dict]]:
    """VERL tool_parser.py HermesToolParser.extract_tool_calls, then ToolAgentLoop._call_tool's
    json.loads(arguments): (name, arguments) of each call. Malformed calls are dropped (logged)."""
    if "<tool_call>" not in text or "</tool_call>" not in text:
        return []
    calls = []
    for match in re.findall(r"<tool_call>(.*?)</tool_call>", text, re.DOTALL):
        try:
            call = json.loads(match)
            calls.append((call["name"], json.loads(json.dumps(call["arguments"], ensure_ascii=False))))
        except Exception:  # noqa: BLE001 - verl: logger.error("Failed to decode tool call")
            pass
    return calls


WELL_FORMED = [
    CALL,                                                                        # test_episodes.CALL
    "Let me add.\n" + CALL + "\nthen I answer",                                  # text around a call
    CALL + "\n" + CALL.replace('"a": 2', '"a": 7'),                             # two calls (max_parallel_calls 2)
    '<tool_call>{"name":"add","arguments":{"a":2,"b":3}}</tool_call>',          # no whitespace
]


@pytest.mark.parametrize("text", WELL_FORMED)
def test_well_formed_hermes_calls_read_as_verl_reads_them(text):
    """VERL tool_parser.py HermesToolParser: `<tool_call>(.*?)</tool_call>` (DOTALL) over the reply,
    json.loads of each, its "name" and "arguments": ours (tool_calls.parse) reads the same calls."""
    calls, problems = tool_calls.parse(text)
    assert [(c["name"], c["arguments"]) for c in calls] == _verl_hermes(text) and not problems


@pytest.mark.parametrize("text, verl, ours, why", [
    ('<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}', [], [("add", {"a": 2, "b": 3})],
     "unclosed: VERL needs both tags; ours reads a complete call until the end (vLLM's hermes parser "
     "test_hermes_parser_non_streaming_tool_call_until_eos; generation stopped on </tool_call>)"),
    ('<tool_call>\n{"name": "add", "arguments": "{\\"a\\": 2, \\"b\\": 3}"}\n</tool_call>',
     [("add", '{"a": 2, "b": 3}')], [("add", {"a": 2, "b": 3})],
     "arguments serialised once more: VERL passes a string to the tool (its execute fails); ours reads "
     "the object (vLLM's test_hermes_parser_non_streaming_serialized_arguments)"),
    ('<tool_call>\n{"name": "now"}\n</tool_call>', [], [("now", {})],
     "no arguments: VERL's call['arguments'] raises KeyError, the call is dropped; ours calls it with none"),
    ('<think>maybe <tool_call>{"name": "add", "arguments": {"a": 1, "b": 1}}</tool_call></think>\n' + CALL,
     [("add", {"a": 1, "b": 1}), ("add", {"a": 2, "b": 3})], [("add", {"a": 2, "b": 3})],
     "a call inside the reasoning: VERL's hermes parser runs it; ours does not (vLLM's reasoning parsers "
     "and Qwen-Agent split the reasoning off first)"),
])
def test_hermes_calls_where_ours_and_verls_differ(text, verl, ours, why):
    """Where ours reads a reply differently from VERL tool_parser.py HermesToolParser (each case's `why`)."""
    calls, _ = tool_calls.parse(text)
    assert _verl_hermes(text) == verl
    assert [(c["name"], c["arguments"]) for c in calls] == ours


def test_a_malformed_call_costs_a_turn_where_verl_ends_the_episode(tmp_path):
    """VERL: a malformed call is dropped (HermesToolParser logs it), and a reply with no call left ends
    the episode (_handle_generating_state: no tool_calls and no interaction -> TERMINATED): the model's
    broken call is its final answer. Ours answers it with an `error: ...` tool message and the model
    gets another turn (launcher/driver/envs/tools.py), counted as env/tool_errors."""
    bad = '<tool_call>\n{"name": "add", "arguments": {"a": 2,}\n</tool_call>'
    assert _verl_hermes(bad) == []
    r, tok, _ = run_tools(tmp_path, [bad, "5"], SLOW)
    assert r.episodes[0]["env/turns"] == 2 and r.episodes[0]["env/tool_errors"] == 1.0
    assert r.texts[0] == "5" and r.rewards[0] == 1.0                     # math_answer on the last reply


# VERL verl/interactions/gsm8k_interaction.py, as an env.fn class: gsm8k's strict "#### <number>" score
# (verl/utils/reward_score/gsm8k.py: the last "#### " number against the ground truth), the replies'
# texts of VERL tests/interactions/test_gsm8k_interaction.py
GSM8K = '''
    import re

    class Env:
        def __init__(self, example):
            self.ground_truth = example["ground_truth"]

        def first_messages(self):
            return [{"role": "user", "content": example_question()}]

        def respond(self, reply):
            found = re.findall("#### (\\\\-?[0-9\\\\.\\\\,]+)", reply)
            reward = 1.0 if found and found[-1].replace(",", "").replace("$", "") == self.ground_truth else 0.0
            if reward == 1.0:
                return {"messages": [{"role": "user", "content": "Your response is correct!"}], "reward": reward,
                        "done": True}
            return {"messages": [{"role": "user", "content": "Your response is incorrect! You need to reflect on "
                                 "your answer and try again."}], "reward": reward, "done": False}

    def example_question():
        return "What is 40+2?"
'''


def test_verl_gsm8k_interaction_rewards_and_turns(tmp_path):
    """VERL tests/interactions/test_gsm8k_interaction.py, ground truth "42":
    test_generate_response_incorrect_answer ("24": not terminated, reward 0.0, "Your response is
    incorrect! You need to reflect on your answer and try again.") then
    test_generate_response_correct_answer_with_prefix ("#### 42": terminated, reward 1.0, "Your
    response is correct!"). As an episode: two model turns.

    VERL keeps each reward in turn_scores ([0.0, 1.0]) and scores the episode with compute_score on the
    whole decoded response (reward_loop naive.py; turn_scores only reach it in extra_info); its
    __num_turns__ is 5 ([user, assistant, user, assistant, user], the last message kept). NEMO and ours
    sum the turns' rewards (1.0), and ours ends on the model's last reply."""
    r = run_env(tmp_path, GSM8K, [{"ground_truth": "42"}], ScriptedTurns(BYTES, ["24", "#### 42"]), "grpo.max_turns=4")
    assert r.rewards == [0.0 + 1.0] * 2 and [m["env/turns"] for m in r.episodes] == [2, 2]
    model, env = split(BYTES, r, 0)
    assert model == "24<|im_end|>#### 42<|im_end|>"
    assert "Your response is incorrect! You need to reflect on your answer and try again." in env
    assert "Your response is correct!" not in env
    verl_num_turns = 1 + 2 + 2
    assert verl_num_turns == 1 + r.episodes[0]["env/turns"] * 2          # + the terminating message ours leaves out


# ================================================================================ gaps found, closed
def test_a_message_the_template_does_not_render_is_not_lost_silently(tmp_path):
    """NEMO nemo_rl/environments/games/sliding_puzzle.py and tests/unit/test_envs.py answer with
    {"role": "environment", ...} (NeMo RL tokenizes the content raw, so the role never matters there).
    Through the Qwen2.5 template that message renders as nothing: after the reply's <|im_end|> the
    episode's next prompt would have "\\n<|im_start|>assistant\\n" and no result: a TemplateError names
    the role instead (launcher.driver.episode_tokens)."""
    env = CALCULATOR.replace('{"role": "user", "content": content}', '{"role": "environment", "content": content}')
    from launcher.driver.episode_tokens import TemplateError

    with pytest.raises(TemplateError, match="does not render the environment's 'environment' message"):
        run_env(tmp_path, env, PROBLEMS[:1], ScriptByPrompt(BYTES, SOLVED), "grpo.max_turns=6")


# the prompt is 17 tokens, the reply "12 13 <|im_end|>" 3: 1 token left with budget 21, 2 with budget 22
@pytest.mark.parametrize("budget", [21, 22])
def test_an_episode_the_budget_ends_is_truncated_however_much_was_left(tmp_path, budget):
    """NEMO rollouts.py marks a sample truncated whenever its observation would pass max_seq_len (cut to
    the tokens left, none included). Ours flags it truncated both when the observation does not fit
    (budget 22) and when the reply left 1 token or none (budget 21): in both the environment wanted
    another turn (done false) and the budget ended the episode."""
    r, _, _ = run(tmp_path, [{"q": "what is 2 + 3 ?", "turns": 50}], f"grpo.max_total_sequence_length={budget}",
                  f"vllm.max_model_len={budget}", "grpo.max_new_tokens=3", SLOW)
    assert len(r.prompt_ids[0]) == 17 and len(r.response_ids[0]) == 3 and r.episodes[0]["env/turns"] == 1
    assert r.truncated == [True, True]
