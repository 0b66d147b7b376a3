"""The tool loop (`rollout.agent.kind: tool_loop`) on rl3d's torch engine with real tools.

The policy is a real `TorchRolloutEngine` whose weights make it a *bigram machine*: every layer's
output projections are zero, so the residual stream is the current token's embedding (one-hot),
and the output layer maps token t to a large logit on `NEXT[t]`. The next token is then a fixed
function of the last one, with log-probs ~0 at temperature 1, so each prompt's last token
selects a script: a good calculator call, a malformed one, a slow call, a crashing one... and
the loop's bookkeeping can be checked exactly on the engine it runs on in training.
"""

import threading
import time

import pytest
import torch

from rl3d.agents.tool_loop import ToolLoop, ToolLoopAgent, ToolLoopConfig, trajectory_metrics
from rl3d.data.tool_task import CALL_END_ID, CALL_ID, OBS_END_ID, OBS_ID, ToolTokenizer
from rl3d.models.spec import get_model_spec
from rl3d.rollout import SamplingParams, TorchRolloutEngine
from rl3d.testing.bigram import bigram_weights
from rl3d.tools import Tool, ToolBox, ToolResult
from rl3d.tools.calculator import Calculator
from rl3d.tools.python_sandbox import PythonSandbox, SandboxConfig, isolation_problem

ROOT = __import__("pathlib").Path(__file__).resolve().parents[3]
TOK = ToolTokenizer(32)
EOS = 1
SPEC = get_model_spec("tiny-llama-v32")


def c(ch: str) -> int:
    return TOK.char_id[ch]


# Scripts, by the prompt's last token (each token has one successor, so scripts share no token):
#   "="  -> CALL 1 + 2 CALL_END            a good call: calculator("1+2") = 3
#   "?"  -> CALL_END                       a close tag without an open one: malformed
#   "%"  -> CALL / CALL_END                calculator("/"): the tool reports an error
#   "("  -> CALL ) CALL_END                expression ")": routed to the slow / crashing tools
#   "-"  -> 9 9 9 ... (never stops)        runs into the token budget
# After an observation (its last token OBS_END) the policy answers "7" then EOS.
NEXT = {
    c("="): CALL_ID,
    CALL_ID: c("1"),
    c("1"): c("+"),
    c("+"): c("2"),
    c("2"): CALL_END_ID,
    c("?"): CALL_END_ID,
    c("%"): CALL_ID,  # CALL -> "1" ... : overridden per test below when needed
    OBS_END_ID: c("7"),
    c("7"): EOS,
    c("-"): c("9"),
    c("9"): c("9"),
}


def make_loop(next_of=NEXT, tools=None, **config) -> ToolLoop:
    engine = TorchRolloutEngine(SPEC, bigram_weights(SPEC, next_of))
    cfg = ToolLoopConfig(**({"max_turns": 3, "tool_timeout_s": 2.0, "max_observation_tokens": 16} | config))
    return ToolLoop(engine, TOK, ToolBox(tools or [Calculator()]), cfg)


def prompt(last: str) -> list[int]:
    return TOK.encode("12*34" + last)


PARAMS = SamplingParams(max_new_tokens=40, stop_token_ids=(EOS,), n=2, seed=0)


def test_a_good_call_then_an_answer():
    loop = make_loop()
    trajs = loop.generate([prompt("=")], PARAMS)
    assert len(trajs) == 2
    for t in trajs:
        text = TOK.decode(t.response_ids)
        assert text == '<tool_call>{"name": "calculator", "arguments": {"expression": "1+2"}}</tool_call>' \
            "<result>3</result>7"  # fmt: skip
        assert t.response_ids[-1] == EOS and t.finish_reason == "stop"
        obs = [OBS_ID, c("3"), OBS_END_ID]
        # policy tokens mask 1 (with their log-probs), the observation 0 (log-prob 0)
        assert t.mask == [1] * 5 + [0] * 3 + [1, 1]
        assert t.response_ids[5:8] == obs and t.logprobs[5:8] == [0.0] * 3
        assert all(-1e-3 < lp <= 0 for lp, m in zip(t.raw_logprobs, t.mask) if m)
        rec = t.record()
        assert rec["num_turns"] == 2 and rec["num_calls"] == 1 and rec["num_errors"] == 0
        assert rec["turns"][0]["call"] == {"name": "calculator", "arguments": {"expression": "1+2"}}
        assert rec["turns"][0]["observation"] == "3" and rec["turns"][1]["text"] == "7"
    metrics = trajectory_metrics([t.record() for t in trajs])
    assert metrics == {
        "tool/calls_mean": 1.0,
        "tool/errors": 0.0,
        "tool/timeouts": 0.0,
        "turns/mean": 2.0,
        "response/tool_token_fraction": 3 / 10,
    }


def test_error_kinds_become_observations_and_are_counted():
    # malformed (close tag without open), tool-reported error ("/"), unknown tool (a second loop
    # without the calculator), each an error observation; the step goes on to the answer
    script = dict(NEXT) | {c("%"): CALL_ID, CALL_ID: c("/"), c("/"): CALL_END_ID}
    loop = make_loop(script)
    malformed, bad_expression = loop.generate([prompt("?"), prompt("%")], PARAMS)[::2]
    assert malformed.turns[0]["error"].startswith("tool call has no opening")
    assert bad_expression.turns[0]["call"] == {"name": "calculator", "arguments": {"expression": "/"}}
    assert "not an arithmetic expression" in bad_expression.turns[0]["error"]
    unknown = make_loop(tools=(PythonSandbox(),)).generate([prompt("=")], PARAMS)[0]
    assert unknown.turns[0]["error"].startswith("unknown tool 'calculator'")
    for t in (malformed, bad_expression, unknown):
        assert t.num_calls == 1 and t.num_errors == 1 and t.num_timeouts == 0
        assert TOK.decode(t.response_ids).endswith("</result>7") and t.finish_reason == "stop"
        assert t.turns[0]["observation"].startswith("[error] ")


class Raising(Tool):
    name = "calculator"
    parameters = Calculator.parameters

    def call(self, arguments):
        raise RuntimeError("boom")


class Sleepy(Tool):
    """Its first call sleeps `seconds`, the others 0.2 s; records how many ran at once."""

    name = "calculator"
    parameters = Calculator.parameters

    def __init__(self, seconds: float):
        self.seconds, self.calls, self.active, self.most, self.lock = seconds, 0, 0, 0, threading.Lock()
        self.release = threading.Event()  # set at the end of the test: the sleeper's thread ends

    def call(self, arguments):
        with self.lock:
            first = self.calls == 0
            self.calls += 1
            self.active += 1
            self.most = max(self.most, self.active)
        try:
            self.release.wait(self.seconds if first else 0.2)
        finally:
            with self.lock:
                self.active -= 1
        return ToolResult("5")


def test_a_tool_exception_is_an_error_observation():
    t = make_loop(tools=(Raising(),)).generate([prompt("=")], PARAMS)[0]
    assert t.num_errors == 1 and "RuntimeError: boom" in t.turns[0]["error"]
    assert t.finish_reason == "stop"


def test_slow_tool_times_out_without_stalling_the_others():
    # eight trajectories call at once: seven 0.2 s calls and one that would sleep 60 s
    sleepy = Sleepy(60.0)
    loop = make_loop(tools=(sleepy,), tool_timeout_s=1.0, concurrency=8)
    begin = time.monotonic()
    trajs = loop.generate([prompt("=")] * 8, SamplingParams(max_new_tokens=40, stop_token_ids=(EOS,), seed=0))
    took = time.monotonic() - begin
    sleepy.release.set()
    assert took < 30.0, took  # the round ended at the 1 s timeout, not after the 60 s call
    assert sleepy.most >= 4  # the calls ran concurrently
    slow = [t for t in trajs if t.num_timeouts]
    assert len(slow) == 1 and slow[0].num_errors == 1 and "timed out after 1s" in slow[0].turns[0]["error"]
    assert sum(t.turns[0]["observation"] == "5" for t in trajs) == 7
    assert all(t.finish_reason == "stop" for t in trajs)  # the slow one answered too
    assert trajectory_metrics([t.record() for t in trajs])["tool/timeouts"] == 1.0
    loop.close()


@pytest.mark.skipif(
    isolation_problem(SandboxConfig()) is not None,
    reason="the python tool's kernel isolation is unavailable here",
)
def test_sandbox_timeout_and_crash_are_counted():
    class Sandboxed(PythonSandbox):
        """The calculator's name and arguments, run as Python: ")" loops forever, "/" crashes."""

        name, parameters = "calculator", Calculator.parameters

        def call(self, arguments):
            code = {")": "while True: pass", "/": "import os; os.abort()"}[arguments["expression"]]
            return super().call({"code": code})

    script = dict(NEXT) | {c("("): CALL_ID, CALL_ID: c(")"), c(")"): CALL_END_ID}
    spin = make_loop(script, tools=(Sandboxed(cpu_seconds=1, wall_seconds=1.5),), tool_timeout_s=10.0)
    looped = spin.generate([prompt("(")], SamplingParams(max_new_tokens=40, stop_token_ids=(EOS,), seed=0))[0]
    assert looped.num_timeouts == 1 and looped.num_errors == 1, looped.turns[0]
    script = dict(NEXT) | {c("%"): CALL_ID, CALL_ID: c("/"), c("/"): CALL_END_ID}
    crash = make_loop(script, tools=(Sandboxed(),))
    crashed = crash.generate([prompt("%")], SamplingParams(max_new_tokens=40, stop_token_ids=(EOS,), seed=0))[
        0
    ]
    assert crashed.num_errors == 1 and crashed.num_timeouts == 0 and crashed.finish_reason == "stop"


def test_max_turns_and_the_token_budget_are_respected():
    # calls forever: after each observation the policy calls again
    script = dict(NEXT) | {OBS_END_ID: CALL_ID}
    loop = make_loop(script, max_turns=3)
    t = loop.generate([prompt("=")], SamplingParams(max_new_tokens=200, stop_token_ids=(EOS,), seed=0))[0]
    assert len(t.turns) == 3 and t.num_calls == 3 and t.finish_reason == "length"
    assert t.turns[2]["observation"] is None  # the last turn's call is not run: nobody reads it
    # the budget counts observation tokens too, and cuts wherever it falls
    for budget in (3, 5, 7, 9, 11, 18):
        t = loop.generate(
            [prompt("=")], SamplingParams(max_new_tokens=budget, stop_token_ids=(EOS,), seed=0)
        )[0]
        assert len(t.response_ids) == len(t.mask) == len(t.logprobs) == budget
        assert t.finish_reason == "length"
    t = make_loop().generate([prompt("-")], SamplingParams(max_new_tokens=12, stop_token_ids=(EOS,), seed=0))[
        0
    ]
    assert TOK.decode(t.response_ids) == "9" * 12 and t.num_calls == 0 and len(t.turns) == 1


def test_a_multi_character_close_tag_cuts_the_turn_after_it():
    # tags that are not single tokens: the engine runs on, the loop cuts after "]" + "]"
    script = {c("="): c("("), c("("): c("["), c("["): c("1"), c("1"): c("]"), c("]"): c(")"), c(")"): c(")")}
    script |= {OBS_END_ID: c("7"), c("7"): EOS}
    loop = make_loop(script, call_tags=("([", "])"))
    t = loop.generate([prompt("=")], PARAMS)[0]
    assert TOK.decode(t.response_ids[: t.mask.index(0)]) == "([1])"  # the turn stops at the tag
    assert "must be a JSON object" in t.turns[0]["error"]  # "1" is not a call object
    assert t.finish_reason == "stop"


@pytest.mark.parametrize("t_budget", [16])
def test_rows_stay_prompt_major_and_seeded(t_budget):
    loop = make_loop()
    prompts = [prompt("="), prompt("-"), prompt("?")]
    params = SamplingParams(max_new_tokens=t_budget, stop_token_ids=(EOS,), n=3, seed=5)
    a, b = loop.generate(prompts, params), loop.generate(prompts, params)
    assert [t.prompt_index for t in a] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert [t.response_ids for t in a] == [t.response_ids for t in b]


def test_policy_logprobs_of_multi_turn_trajectories_match_an_independent_forward():
    """Random weights (far from uniform), real calculator: the log-probs the engine reported for
    each policy token, in contexts holding earlier turns and observations, equal HF
    transformers' log_softmax over the whole prompt + response in one forward (fp32, the
    single-turn tolerance of test_rollout_torch_engine)."""
    from test_rollout_torch_engine import LOGPROB_TOL, hf_reference, megatron_model

    spec, _, full = megatron_model("tiny-llama-v32", seed=2)
    loop = ToolLoop(
        TorchRolloutEngine(spec, full),
        TOK,
        ToolBox([Calculator()]),
        ToolLoopConfig(max_turns=4, max_observation_tokens=6),
    )
    prompts = [prompt("="), TOK.encode("4213*7789="), TOK.encode("5*6=")]
    trajs = loop.generate(prompts, SamplingParams(max_new_tokens=48, stop_token_ids=(EOS,), n=4, seed=11))
    model = hf_reference(spec, full)
    multi_turn = worst = 0
    for t in trajs:
        ids = torch.tensor([t.prompt_ids + t.response_ids])
        with torch.no_grad():
            logits = model(ids).logits[0].float()
        ref = torch.log_softmax(logits[len(t.prompt_ids) - 1 : -1], -1).gather(
            -1, ids[0, len(t.prompt_ids) :, None]
        )[:, 0]
        mask = torch.tensor(t.mask, dtype=torch.bool)
        worst = max(worst, (torch.tensor(t.raw_logprobs) - ref)[mask].abs().max().item())
        assert (torch.tensor(t.raw_logprobs)[~mask] == 0).all()  # observations: never used
        multi_turn += 0 in t.mask and 1 in t.mask[t.mask.index(0) :]  # policy tokens after an observation
    assert worst <= LOGPROB_TOL, worst
    assert multi_turn >= 2, [t.turns for t in trajs]


def test_generation_lays_the_trajectories_out_as_the_loop_made_them():
    """`rollout.agent.kind: tool_loop` through `Generation` (the one agent slot): each row is the
    prompt left-padded, then the trajectory's tokens, its mask as `response_mask` and its raw
    log-probs as `rollout_logp`, exactly as the loop returns them on the same engine and seed."""
    from rl3d.config import load_config
    from rl3d.single_controller.batch import DataBatch
    from rl3d.workers.generation import TRAJECTORY, Generation, rollout_sampling

    cfg = load_config(ROOT / "recipes" / "quickstart_cpu_tool_grpo.yaml").config
    engine = TorchRolloutEngine(SPEC, bigram_weights(SPEC, NEXT))
    generation = Generation(cfg, engine, TOK, pad_token_id=0)
    assert generation.multi_turn and isinstance(generation.agent, ToolLoopAgent)
    prompts_ids = [prompt("="), TOK.encode("1?"), prompt("-")]  # a call, a malformed one, no stop
    prompts = DataBatch({"uid": torch.tensor([5, 6, 7])}, {"prompt_ids": prompts_ids, "index": [0, 1, 2]})
    batch = generation.generate(prompts, step=2, gen_dp_rank=1).batch

    params = rollout_sampling(cfg, step=2, gen_dp_rank=1)
    loop = ToolLoop(
        engine, TOK, cfg.rollout.agent.build_tools(), ToolLoopConfig.from_config(cfg.rollout.agent)
    )
    trajs = loop.generate(prompts_ids, params)
    assert len(batch) == len(trajs) == 3 * cfg.rollout.n
    width = max(len(p) for p in prompts_ids)
    for i, t in enumerate(trajs):
        n = len(t.response_ids)
        pad = [0] * (width - len(t.prompt_ids))
        assert batch["input_ids"][i, : width + n].tolist() == pad + t.prompt_ids + t.response_ids
        assert batch["response_mask"][i, :n].tolist() == t.mask and not batch["response_mask"][i, n:].any()
        assert batch["rollout_logp"][i, :n].tolist() == torch.tensor(t.raw_logprobs).tolist()
        assert batch["uid"][i] == 5 + t.prompt_index and batch["finish_reason"][i] == t.finish_reason
    assert batch[TRAJECTORY] == [t.record() for t in trajs]
