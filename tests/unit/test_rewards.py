"""Rewards: every way a reward.fn can be wrong is one line naming it; the built-ins score as
documented; the pool counts exceptions, timeouts and non-finite values as errors (0, first
traceback logged) or stops with the record named; a file reward is copied into the run."""

from __future__ import annotations

import pytest

from launcher.config.compose import compose
from launcher.config.schema import Reward, typed
from launcher.config.validate import validate
from launcher.driver import data, rewards

REWARD_FILE = '''
import math, time

def score(response, example):
    """1 when the response contains the record's `expected` word."""
    if example["expected"] == "boom":
        raise ValueError("no reward for " + example["expected"])
    if example["expected"] == "slow":
        time.sleep(30)
    if example["expected"] == "nan":
        return math.nan
    if example["expected"] == "text":
        return "high"
    return float(example["expected"] in response.split())

not_callable = 3

def one_arg(response):
    return 1.0
'''


def errors(*overrides: str) -> list[str]:
    return [str(e) for e in validate(typed(compose(list(overrides))), submitting=True)]


@pytest.fixture
def reward_file(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text(REWARD_FILE)
    (tmp_path / "broken.py").write_text("def score(response, example):\n    return 1 +\n")
    return path


@pytest.mark.parametrize("fn, message", [
    ("{dir}/nope.py:score", "reward.fn: {dir}/nope.py: no such file"),
    ("{dir}/my_reward.py:missing", "reward.fn: {dir}/my_reward.py:missing: the module has no 'missing'"),
    ("{dir}/my_reward.py:not_callable", "reward.fn: {dir}/my_reward.py:not_callable: 'not_callable' is not callable"),
    ("{dir}/my_reward.py:one_arg", "reward.fn: {dir}/my_reward.py:one_arg: one_arg(response) cannot be called as "
                                   "fn(response, example)"),
    ("no_such_pkg.mod:fn", "reward.fn: cannot import module 'no_such_pkg.mod': ModuleNotFoundError: No module named "
                           "'no_such_pkg'"),
    ("json:nothing_here", "reward.fn: json:nothing_here: the module has no 'nothing_here'"),
    ("exact", "reward.fn: 'exact' is not a built-in (say_number, math_answer, math_verify, exact_match) nor "
              "pkg.module:function nor path/to/file.py:function"),
])
def test_bad_reward_is_one_line(reward_file, fn, message):
    d = reward_file.parent
    assert errors(f"reward.fn={fn.format(dir=d)}") == [message.format(dir=d)]


def test_a_reward_that_does_not_import_names_the_error(reward_file):
    (err,) = errors(f"reward.fn={reward_file.parent}/broken.py:score")
    assert err.startswith(f"reward.fn: cannot import {reward_file.parent}/broken.py: SyntaxError: ") and "\n" not in err


@pytest.mark.parametrize("override, message", [
    ("reward.on_error=skip", "reward.on_error: must be zero or fail, got 'skip'"),
])
def test_bad_reward_settings(override, message):
    assert errors(override) == [message]


def test_good_forms_pass(reward_file):
    assert errors(f"reward.fn={reward_file}:score", "data.train=say_number") == []
    assert errors("reward.fn=launcher.driver.rewards:exact_match") == []
    assert errors("reward.fn=math_verify") == []


def test_builtins():
    ex = {"answer": "\\frac{1}{2}", "other": "Paris"}
    assert rewards.load("math_verify")("so the answer is $0.5$", ex) == 1.0
    assert rewards.load("math_verify")("the answer is \\boxed{\\frac{2}{4}}", ex) == 1.0
    assert rewards.load("math_verify")("the answer is 2", ex) == 0.0
    assert rewards.load("math_verify")("12", {"answer": 12}) == 1.0
    assert rewards.load("exact_match", answer_key="other")("  paris. ", ex) == 1.0
    assert rewards.load("exact_match", answer_key="other")("Paris, France", ex) == 0.0
    assert rewards.load("math_answer")("it is 37 .", {"answer": 37}) == 1.0
    assert rewards.load("say_number")("42 41 9", {"answer": [40, 49]}) == pytest.approx(2 / 3)


# MATH-style answers are bare LaTeX (the dataset's `\\boxed{...}` contents), GSM8K-style answers plain
# numbers, thousands separators included. (response, answer, score) under verl's and NeMo RL's call.
MATH_VERIFY_CASES = [
    ("so \\boxed{2\\sqrt{3}}", "2\\sqrt{3}", 1.0),            # read raw, the answer scored 0 ...
    ("so \\boxed{2}", "2\\sqrt{3}", 0.0),                       # ... and this 1
    ("\\boxed{3}", "3\\pi", 0.0),                               # ... and this 1
    ("\\boxed{3\\pi}", "3\\pi", 1.0),
    ("\\boxed{\\pi}", "\\pi", 1.0),
    ("\\boxed{3.14}", "\\pi", 0.0),
    ("\\boxed{\\dfrac{\\sqrt{3}}{2}}", "\\frac{\\sqrt{3}}{2}", 1.0),
    ("\\boxed{1.5}", "\\frac32", 1.0),
    ("\\boxed{(1, 3]}", "(1,3]", 1.0),                            # intervals: ends and brackets count
    ("\\boxed{[1, 3]}", "(1,3]", 0.0),
    ("\\boxed{x \\in (-\\infty, 2)}", "(-\\infty,2)", 1.0),
    ("\\boxed{(2, -1)}", "(2,-1)", 1.0),                          # tuples: order counts
    ("\\boxed{(-1, 2)}", "(2,-1)", 0.0),
    ("\\boxed{50\\%}", "50\\%", 1.0),                         # percentages
    ("\\boxed{0.5}", "50\\%", 0.0),
    ("\\boxed{50}", "50\\%", 0.0),
    ("\\boxed{\\text{Monday}}", "\\text{Monday}", 1.0),       # \\text{} answers
    ("\\boxed{\\text{Tuesday}}", "\\text{Monday}", 0.0),
    ("\\boxed{x^2+2x+1}", "(x+1)^2", 1.0),
    ("\\boxed{-3}", "-3", 1.0),
    ("\\boxed{3}", "-3", 0.0),
    ("She paid $1000 in all. The answer is 1000", "1,000", 1.0),  # GSM8K: thousands separators
    ("\\boxed{1,000}", "1000", 1.0),
    ("\\boxed{100}", "1,000", 0.0),
    ("Natalia sold 48 + 24 = 72 clips.\n#### 72", "72", 1.0),
    ("The answer is 17", "18", 0.0),
    ("\\boxed{18}", 18, 1.0),                                       # a number, not a string, in the record
    ("I do not know", "5", 0.0),                                  # nothing to read in the response: wrong
]


# NVIDIA-NeMo/RL @ 7ea279abfbeb698b092856d0dab61e7cf39bc909, tests/unit/environments/test_math_environment.py:
# the fixtures of test_math_env_step_basic, test_math_env_step_mixed and
# test_math_env_step_multiple_assistant_messages (the assistant messages joined, as the environment
# joins them), and test_math_exception_handling (a reward of 0, no crash).
NEMO_RL_MATH_ENV_CASES = [
    ("2 + 2 = \\boxed{4}", "4", 1.0),
    ("3 * 4 = \\boxed{12}", "\\boxed{12}", 1.0),
    ("10 - 5 = \\boxed{5}", "\\boxed{5}", 1.0),
    ("2 + 2 = \\boxed{\\frac{8}{2}}", "4.0", 1.0),
    ("3 * 4 = 13", "\\boxed{12}", 0.0),
    ("Let me think...2 + 2 = \\boxed{4}", "4", 1.0),
    ("I'll calculate that...3 * 4 = \\boxed{12}", "\\boxed{12}", 1.0),
    ("\\boxed{Eq(x**2/16 + y**2/12, 1)}", "Eq(x**2/4 + y**2/3, 1)", 0.0),
]


@pytest.mark.parametrize("response, answer, score", NEMO_RL_MATH_ENV_CASES)
def test_math_verify_on_nemo_rls_math_environment_cases(response, answer, score):
    assert rewards.load("math_verify")(response, {"answer": answer}) == score


@pytest.mark.parametrize("response, answer, score", MATH_VERIFY_CASES)
def test_math_verify_reads_the_answer_as_the_field_does(response, answer, score):
    assert rewards.load("math_verify")(response, {"answer": answer}) == score


def test_the_readmes_own_data_reward_scores_as_the_builtin(tmp_path):
    """README.md's "Train on your own data" reward file, taken from the README as a user copies it."""
    from pathlib import Path

    text = (Path(__file__).parents[2] / "README.md").read_text()
    block = text.split("a reward, `my_reward.py`", 1)[1].split("\n\n", 1)[1].split("\n\n(", 1)[0]
    (tmp_path / "my_reward.py").write_text("\n".join(line[4:] for line in block.splitlines()) + "\n")
    score = rewards.load(f"{tmp_path}/my_reward.py:score")
    for response, answer, expected in MATH_VERIFY_CASES:
        assert score(response, {"solution": answer}) == expected, (response, answer)


def test_an_answer_math_verify_cannot_read_is_a_counted_error(tmp_path):
    r = rewards.Rewards(Reward(fn="math_verify", workers=1, timeout_s=20), "answer", tmp_path)
    exs = [data.Example(i, {"answer": a}, prompt="p", where=f"line {i + 1} of t.jsonl")
           for i, a in enumerate(["", "2\\sqrt{3}"])]
    try:
        assert r.score(["\\boxed{5}", "\\boxed{2\\sqrt{3}}"], exs) == ([0.0, 1.0], 1)
    finally:
        r.close()
    assert (tmp_path / "logs" / "reward_errors.log").read_text().startswith(
        "reward.fn math_verify on line 1 of t.jsonl: ValueError: math-verify cannot read the answer ''\n")


def examples(words):
    return [data.Example(i, {"expected": w}, prompt="p", where=f"line {i + 1} of q.jsonl") for i, w in enumerate(words)]


@pytest.mark.parametrize("workers", [1, 2])
def test_errors_score_zero_are_counted_and_the_first_is_logged(reward_file, tmp_path, workers):
    run = tmp_path / "run"
    rewards.copy_into_run(f"{reward_file}:score", run)
    r = rewards.Rewards(Reward(fn=f"{reward_file}:score", workers=workers, timeout_s=5), "answer", run)
    try:
        got, errs = r.score(["yes", "yes", "no", "x", "x"], examples(["yes", "boom", "yes", "nan", "text"]))
    finally:
        r.close()
    assert got == [1.0, 0.0, 0.0, 0.0, 0.0] and errs == 3
    log = (run / "logs" / "reward_errors.log").read_text()
    assert log.startswith(f"reward.fn {reward_file}:score on line 2 of q.jsonl: ValueError: no reward for boom\n")
    assert "Traceback" in log and 'raise ValueError("no reward for "' in log


def test_a_timeout_scores_zero_and_the_pool_recovers(reward_file, tmp_path):
    r = rewards.Rewards(Reward(fn=f"{reward_file}:score", workers=1, timeout_s=2), "answer", tmp_path)
    try:
        got, errs = r.score(["a", "yes"], examples(["slow", "yes"]))
        assert got[0] == 0.0 and errs >= 1
        assert "timed out after 2s (reward.timeout_s)" in (tmp_path / "logs" / "reward_errors.log").read_text()
        assert r.score(["yes"], examples(["yes"])) == ([1.0], 0)  # fresh workers after the stuck one
    finally:
        r.close()


def test_on_error_fail_names_the_record(reward_file, tmp_path):
    r = rewards.Rewards(Reward(fn=f"{reward_file}:score", workers=1, on_error="fail"), "answer", tmp_path)
    try:
        with pytest.raises(rewards.RewardFailed) as e:
            r.score(["yes", "yes"], examples(["yes", "boom"]))
    finally:
        r.close()
    assert str(e.value) == (f"reward.fn {reward_file}:score failed on line 2 of q.jsonl: ValueError: no reward for "
                            f"boom (reward.on_error=fail; reward.on_error=zero scores it 0 and goes on)")


def test_the_run_uses_its_copy_of_a_reward_file(reward_file, tmp_path):
    run = tmp_path / "run"
    rewards.copy_into_run(f"{reward_file}:score", run)
    assert (run / "reward" / "my_reward.py").read_text() == REWARD_FILE
    reward_file.write_text("def score(response, example):\n    return 0.5\n")  # edited after submission
    assert rewards.load(f"{reward_file}:score", run_dir=run)("yes", {"expected": "yes"}) == 1.0
    assert rewards.load(f"{reward_file}:score")("yes", {"expected": "yes"}) == 0.5


def test_a_slow_import_does_not_count_against_the_call_timeout(tmp_path):
    slow = tmp_path / "slow_import.py"
    slow.write_text("import time\ntime.sleep(3)  # a heavy import\n\ndef score(response, example):\n    return 1.0\n")
    r = rewards.Rewards(Reward(fn=f"{slow}:score", workers=2, timeout_s=1), "answer", tmp_path)
    try:
        assert r.score(["a", "b"], examples(["x", "y"])) == ([1.0, 1.0], 0)
    finally:
        r.close()


def test_workers_outlive_the_jobs_signals_and_ctrl_c_and_close_still_ends_them(reward_file, tmp_path):
    """Slurm sends SIGTERM/USR2 to every process of the job, Ctrl-C sends SIGINT to the terminal's
    process group: a reward worker lives on (the step being checkpointed still needs it), and
    close() ends the workers all the same, without hanging (multiprocessing.Pool's terminate()
    blocked on a queue lock held by a killed idle worker)."""
    import os
    import signal
    import threading

    r = rewards.Rewards(Reward(fn=f"{reward_file}:score", workers=2, timeout_s=5), "answer", tmp_path)
    try:
        assert r.score(["yes"], examples(["yes"])) == ([1.0], 0)
        procs = [w.proc for w in r.pool.workers]
        assert len(procs) == 2
        for p in procs:
            for sig in (signal.SIGUSR2, signal.SIGTERM, signal.SIGINT):
                os.kill(p.pid, sig)
        assert r.score(["yes", "no"], examples(["yes", "yes"])) == ([1.0, 0.0], 0)
        assert all(p.poll() is None for p in procs)
        assert [w.proc for w in r.pool.workers] == procs  # none was replaced
    finally:
        closing = threading.Thread(target=r.close, daemon=True)
        closing.start()
        closing.join(20)  # a hang bound, not a timing: close() sends each worker its end message
    assert not closing.is_alive()
    assert all(p.poll() is not None for p in procs)


def test_a_worker_killed_in_a_call_is_one_error_and_is_replaced(reward_file, tmp_path):
    import os
    import signal
    import threading

    r = rewards.Rewards(Reward(fn=f"{reward_file}:score", workers=1, timeout_s=20), "answer", tmp_path)
    try:
        assert r.score(["yes"], examples(["yes"])) == ([1.0], 0)
        victim = r.pool.workers[0].proc
        threading.Timer(1.0, os.kill, (victim.pid, signal.SIGKILL)).start()
        assert r.score(["a", "yes"], examples(["slow", "yes"])) == ([0.0, 1.0], 1)
        assert "the reward worker died (exit code -9)" in (tmp_path / "logs" / "reward_errors.log").read_text()
        assert r.pool.workers[0].proc is not victim
    finally:
        r.close()


ROUND_THREE = '''
import sys

def score(response, example):
    kind = example["expected"]
    if kind == "huge":
        return 10 ** 400            # an int no float holds: float() raised OverflowError in the worker
    if kind == "exit":
        sys.exit(3)                 # a SystemExit ended the worker
    if kind == "none":
        return None
    if kind == "list":
        return [1.0]
    if kind == "bool":
        return True
    return 1
'''


def test_what_the_users_code_returns_or_raises_cannot_end_a_worker(tmp_path):
    """Results that are not finite real numbers (an int too large for a float, None, a list) and a
    sys.exit in the call are reward errors, scored 0 and counted; the worker stays up (the same
    worker, 1 of them, scores the next record) and the run's output gets no traceback."""
    path = tmp_path / "odd.py"
    path.write_text(ROUND_THREE)
    r = rewards.Rewards(Reward(fn=f"{path}:score", workers=1, timeout_s=5), "answer", tmp_path)
    try:
        assert r.score(["x"], examples(["one"])) == ([1.0], 0)
        pid = r.pool.workers[0].proc.pid
        got, errs = r.score(["x"] * 6, examples(["huge", "exit", "none", "list", "bool", "one"]))
        assert r.pool.workers[0].proc.pid == pid
    finally:
        r.close()
    assert (got, errs) == ([0.0, 0.0, 0.0, 0.0, 1.0, 1.0], 4)
    assert (tmp_path / "logs" / "reward_errors.log").read_text().startswith(
        f"reward.fn {path}:score on line 1 of q.jsonl: returned 1000000000")


@pytest.mark.parametrize("value,ok", [(1, True), (0.5, True), (True, True), (10 ** 400, False), (float("nan"), False),
                                      (float("inf"), False), ("1.0", False), (None, False), ([1.0], False)])
def test_a_reward_is_a_finite_real_number(value, ok):
    got, why = rewards.as_reward(value)
    assert (got is not None, why == "") == (ok, ok)


def test_a_reward_module_that_exits_at_import_is_one_line(tmp_path):
    path = tmp_path / "exits.py"
    path.write_text("raise SystemExit(3)\n")
    assert errors(f"reward.fn={path}:score") == [f"reward.fn: cannot import {path}: it called sys.exit(3) "
                                                 f"(SystemExit): a reward module must not exit"]


@pytest.mark.parametrize("code,message", [
    ("import os\nos._exit(0)\n", "ended its process (exit code 0) before it was loaded"),
    ("import ctypes\nctypes.string_at(0)\n", "ended its process (signal SIGSEGV) before it was loaded"),
    ("import time\nwhile True:\n    time.sleep(0.1)\n",
     "took more than 3 s (stopped): a reward module must not block"),
    ("import threading, time\nthreading.Thread(target=time.sleep, args=(600,)).start()\nprint('hi')\n"
     "def score(response, example):\n    return 1.0\n", None),
])
def test_the_users_module_is_imported_at_submission_in_a_process_of_its_own(tmp_path, code, message):
    """Whatever the module does when it is imported (ends its process, crashes, blocks, leaves a thread
    running) the launcher goes on and says so in one line naming the file; a good module passes and
    leaves nothing behind (its thread ended with its process)."""
    path = tmp_path / "mod.py"
    path.write_text(code)
    err = rewards.probe(f"{path}:score", timeout_s=3)
    if message is None:
        assert err is None
        return
    assert str(err).startswith(f"reward.fn: importing {path} ") and message in str(err), err


def test_reward_workers_run_below_the_ray_daemons_priority(tmp_path):
    """Busy reward workers must not starve their node's raylet (its health checks): they run at Ray's
    workers' niceness, as the trainer and engine actors do, whatever the driver's."""
    import os

    from launcher.driver.reward_pool import NICENESS, WorkerPool

    fn = tmp_path / "nice.py"
    fn.write_text("import os\n\ndef niceness(response, example):\n    return float(os.nice(0))\n")
    pool = WorkerPool(1, "launcher.driver.rewards", (f"{fn}:niceness", "answer", None))
    try:
        assert pool.call_all([("x", {})], 30.0) == [("ok", float(max(NICENESS, os.nice(0))))]
    finally:
        pool.close()
    assert os.nice(0) < NICENESS  # the test's own process (the driver's stand-in) is untouched
