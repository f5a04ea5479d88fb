"""Environments (env.fn): what answers the model in a multi-turn episode. A user writes a class:

    class Env:
        def __init__(self, example: dict): ...       # one instance per episode, from the data record
        def first_messages(self) -> list[dict]: ...  # [{"role": "user", "content": ...}, ...]
        def respond(self, reply: str) -> dict: ...   # {"messages": [...], "reward": float, "done": bool}

`env.fn` is a built-in (`guess_number`, the demo; `tools`, the tool-calling environment over
`env.tools`), `pkg.module:Class` or `path/to/file.py:Class` (copied into RUN/env/ at submission, as
a reward file is). An instance may have a `tools` attribute (JSON schemas, or functions): the chat
template shows them to the model. `respond` may add `"metrics": {name: number}` (summed over the
episode, averaged per step as env/<name>).

Instances live in the reward workers (launcher.driver.reward_pool), never in the driver: each
episode's calls are routed to one worker, which keeps its instance between turns. The driver side
(`Environments`) handles errors as rewards do: an exception, a timeout (reward.timeout_s per call)
or a malformed answer ends that episode, counted and logged (RUN/logs/reward_errors.log), or stops
the run naming the record with reward.on_error=fail. A worker replaced after a timeout loses the
episodes it held: they end the same way.
"""

from __future__ import annotations

import inspect
import traceback
from pathlib import Path

from launcher.config.schema import ConfigError
from launcher.driver.rewards import _short  # the rewards' one-line repr of a user's value

BUILTIN = {"guess_number": "launcher.driver.envs.guess_number:GuessNumber", "tools": "launcher.driver.envs.tools:ToolEnv"}


def load(spec: str, run_dir: Path | None = None):
    """The environment class of `spec`; ConfigError('env.fn', ...) when it cannot be had."""
    from launcher import paths
    from launcher.driver.rewards import file_part, load_callable, run_copy

    if spec not in BUILTIN and file_part(spec) is None and ":" not in spec:
        raise ConfigError("env.fn", f"{spec!r} is not a built-in ({', '.join(BUILTIN)}) nor pkg.module:Class nor "
                                    f"path/to/file.py:Class")
    copy = run_copy(run_dir, spec, paths.ENV_DIR) if run_dir is not None and file_part(spec) is not None else None
    cls = load_callable(BUILTIN.get(spec, spec), "env.fn", "environment", copy if copy and copy.is_file() else None)
    missing = [m for m in ("first_messages", "respond") if not callable(getattr(cls, m, None))]
    if inspect.isclass(cls) and missing:
        raise ConfigError("env.fn", f"{spec}: the class has no {' and no '.join(missing)}() (an environment has "
                                    f"first_messages() and respond(reply))")
    return cls


def check(cfg, submitting: bool) -> list[ConfigError]:
    """env.fn and env.tools: imported in a child process (rewards.probe) when they are files or modules."""
    from launcher.driver.rewards import file_part, probe

    e = cfg.env
    if e.fn is None:
        return ([ConfigError("env.tools", "needs env.fn=tools")] if e.tools else []) + (
            [ConfigError("reward.fn", "must be set (null only with env.fn: an environment's rewards)")]
            if cfg.reward.fn is None else [])
    errs = []
    if e.tools and e.fn != "tools":
        errs.append(ConfigError("env.tools", f"is read by env.fn=tools only (env.fn is {e.fn!r})"))
    if e.fn == "tools" and not e.tools:
        errs.append(ConfigError("env.tools", "env.fn=tools needs at least one tool: env.tools=[path/to/tools.py:fn]"))
    if e.fn not in BUILTIN:
        src = file_part(e.fn)
        if submitting or src is None or src.exists():
            err = probe(e.fn, loader=f"{__name__}:load", key="env.fn", what="an environment module")
            errs += [err] if err is not None else []
    for spec in e.tools:
        src = file_part(spec)
        if src is None and ":" not in spec:
            errs.append(ConfigError("env.tools", f"{spec!r} is not pkg.module:function nor path/to/file.py:function"))
        elif submitting or src is None or src.exists():
            err = probe(spec, loader="launcher.driver.tool_calls:load_one", key="env.tools", what="a tool module")
            errs += [err] if err is not None else []
    return errs


# ------------------------------------------------------------------------------------ the worker
_FACTORY = None
_REWARD = None
_LOAD_ERROR: str | None = None
_EPISODES: dict = {}


def init_worker(env_spec: str, tools: list[str], reward_spec: str | None, answer_key: str, data: dict,
                run_dir: str | None) -> None:
    """In a reward worker, once: the environment class (and reward.fn when set)."""
    import functools

    global _FACTORY, _REWARD, _LOAD_ERROR
    from launcher.driver import rewards

    where = Path(run_dir) if run_dir else None
    try:
        cls = load(env_spec, where)
        if env_spec == "tools":  # the tools and their schemas once, here: outside any call's timeout
            from launcher.driver.tool_calls import load_tools, schema

            functions = load_tools(list(tools), where)
            cls = functools.partial(cls, tools=functions, data=data,
                                    schemas=[schema(fn, name) for name, fn in functions.items()])
        _FACTORY = cls
        _REWARD = rewards.load(reward_spec, answer_key, where) if reward_spec else None
    except BaseException as e:  # noqa: BLE001 - reported on each call (the worker stays up)
        _LOAD_ERROR = rewards._what(e, "environment") if not isinstance(e, ConfigError) else f"{e.key}: {e.message}"


def call(op: str, key, arg, record: dict | None = None) -> tuple:
    """One request of the driver: ("ok", value) or ("error", one line, traceback).
    open(key, record) -> (messages, tools); respond(key, reply) -> (messages, reward, done, metrics);
    reward(key, reply, record) -> reward.fn's value; close(None, keys)."""
    from launcher.driver.rewards import _what, as_reward

    if op == "close":
        for k in arg:
            _EPISODES.pop(k, None)
        return ("ok", None)
    if _FACTORY is None:
        return ("error", f"the environment could not be loaded: {_LOAD_ERROR}", _LOAD_ERROR or "")
    try:
        if op == "open":
            env = _FACTORY(arg)
            _EPISODES[key] = env
            return ("ok", (_messages(env.first_messages(), "first_messages()"), _tools(env)))
        if op == "reward":
            out, why = as_reward(_REWARD(arg, record))
            return ("ok", out) if not why else ("error", f"reward.fn {why}", "")
        env = _EPISODES.get(key)
        if env is None:
            return ("error", "the episode's environment was lost (its worker was replaced after a timeout)", "")
        return ("ok", _answer(env.respond(arg)))
    except _Malformed as e:
        return ("error", str(e), "")
    except BaseException as e:  # noqa: BLE001 - the user's code: an exception or sys.exit ends the episode
        return ("error", _what(e), traceback.format_exc())


class _Malformed(Exception):
    pass


def _messages(value, what: str) -> list[dict]:
    if not isinstance(value, (list, tuple)) or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in value):
        raise _Malformed(f"{what} must return a list of {{'role': str, 'content': str}} messages, got "
                         f"{_short(value)}")
    return [dict(m) for m in value]


def _answer(value) -> tuple:
    from launcher.driver.rewards import as_reward

    if not isinstance(value, dict):
        raise _Malformed(f"respond() must return {{'messages': [...], 'reward': float, 'done': bool}}, got "
                         f"{_short(value)}")
    done = value.get("done")
    if not isinstance(done, bool):
        raise _Malformed(f"respond()['done'] must be true or false, got {_short(done)}")
    reward, why = as_reward(value.get("reward", 0.0))
    if why:
        raise _Malformed(f"respond()['reward'] {why}")
    messages = _messages(value.get("messages", []), "respond()['messages']")
    if not done and not messages:
        raise _Malformed("respond() returned no messages and done=false: the model would have nothing to answer")
    metrics = value.get("metrics") or {}
    if not isinstance(metrics, dict) or any(not isinstance(k, str) or as_reward(v)[1] for k, v in metrics.items()):
        raise _Malformed(f"respond()['metrics'] must map names to finite numbers, got {_short(metrics)}")
    return messages, reward, done, {k: float(v) for k, v in metrics.items()}


def _tools(env) -> list[dict] | None:
    tools = getattr(env, "tools", None)
    if not tools:
        return None
    from launcher.driver.tool_calls import schema

    return [t if isinstance(t, dict) else schema(t) for t in tools]


# ------------------------------------------------------------------------------------ the driver side
class Environments:
    """The episodes' environments in `reward.workers` worker processes; errors as rewards (module doc)."""

    def __init__(self, cfg, run_dir: Path):
        from dataclasses import asdict

        self.cfg, self.r = cfg, cfg.reward
        self.tokenizer = None   # the model's: the driver sets it once it has it (GrpoRun)
        self.log_path = Path(run_dir) / "logs" / "reward_errors.log"
        self.pool = None
        self._init_args = (cfg.env.fn, list(cfg.env.tools), cfg.reward.fn, cfg.data.answer_key, asdict(cfg.data),
                           str(run_dir))

    def sample(self, generators, examples, step: int, first_prompt: int = 0, greedy: bool = False):
        """n episodes of each example: launcher.driver.episodes.sample (rollout.sample with env.fn)."""
        from launcher.driver import episodes

        return episodes.sample(self.cfg, generators, self, self.tokenizer, examples, step, first_prompt, greedy)

    def _call(self, requests: list[tuple], keys: list[int]) -> list[tuple]:
        from launcher.driver.reward_pool import WorkerPool

        if self.pool is None:
            self.pool = WorkerPool(self.r.workers, __name__, self._init_args)
        n = len(self.pool.workers)
        got = self.pool.call_all(requests, self.r.timeout_s, route=[k % n for k in keys])
        return [("error", f"timed out after {self.r.timeout_s:g}s (reward.timeout_s)", "")
                if res == WorkerPool.TIMED_OUT else res for res in got]

    def open(self, keys: list[int], records: list[dict]) -> list[tuple]:
        return self._call([("open", k, rec) for k, rec in zip(keys, records)], keys)

    def respond(self, keys: list[int], replies: list[str]) -> list[tuple]:
        return self._call([("respond", k, reply) for k, reply in zip(keys, replies)], keys)

    def final_reward(self, keys: list[int], replies: list[str], records: list[dict]) -> list[tuple]:
        return self._call([("reward", k, reply, rec) for k, reply, rec in zip(keys, replies, records)], keys)

    def close_all(self, keys: list[int]) -> None:
        if self.pool is None:
            return
        n = len(self.pool.workers)
        self.pool.call_all([("close", None, [k for k in keys if k % n == w]) for w in range(n)], self.r.timeout_s,
                           route=list(range(n)))

    def failed(self, what: str, where: str, res: tuple) -> None:
        """One failed call of an episode: the run stops (on_error=fail) or it is logged once."""
        from launcher.driver.rewards import RewardFailed

        if self.r.on_error == "fail":
            raise RewardFailed(f"env.fn {self.cfg.env.fn} failed in {what} on {where}: {res[1]} (reward.on_error=fail;"
                               f" reward.on_error=zero ends the episode with what it scored and goes on)")
        if not self.log_path.exists():
            from launcher import files

            files.write(self.log_path, f"env.fn {self.cfg.env.fn} in {what} on {where}: {res[1]}\n{res[2]}")

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
            self.pool = None
