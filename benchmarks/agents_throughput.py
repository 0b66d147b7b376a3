"""Rollout throughput of an OpenAI-client agent through the endpoint (`rollout.agent.kind:
endpoint`) against rl3d's tool loop (`kind: tool_loop`), on the same engine and the same tool task.

The policy is the bigram machine (`rl3d.testing.bigram`) over the tool task's tokenizer,
scripted to do the task's two turns: a calculator call, then, after the result, an answer and
EOS. Both loops then produce the same trajectories (the same tokens), so the difference is the
machinery: the built-in loop's rounds of one batched `generate` call against the endpoint's
HTTP requests, batched by its queue. `--prompts` prompts x `--n` samples per rollout, `--repeats`
rollouts each; the median is reported.

    python benchmarks/agents_throughput.py --prompts 8 --n 4 --repeats 5
"""

from __future__ import annotations

import argparse
import statistics
import time

from rl3d.agents import EndpointAgent, ToolLoop, ToolLoopConfig
from rl3d.config.agent import AgentConfig
from rl3d.data.tool_task import CALL_END_ID, CALL_ID, OBS_END_ID, TOOL_MULTIPLY, ToolTokenizer
from rl3d.rollout import SamplingParams
from rl3d.testing.bigram import bigram_engine
from rl3d.tools import ToolBox
from rl3d.tools.calculator import Calculator

TOK = ToolTokenizer(32)
EOS = 1


def script() -> dict[int, int]:
    c = TOK.char_id
    # "=" -> CALL 1 + 2 CALL_END; after the result -> 7 EOS
    chain = [c["="], CALL_ID, c["1"], c["+"], c["2"], CALL_END_ID]
    return {**dict(zip(chain, chain[1:])), OBS_END_ID: c["7"], c["7"]: EOS}


class CountingEngine:
    def __init__(self, engine):
        self.engine, self.spec, self.calls, self.tokens = engine, engine.spec, 0, 0

    def generate(self, prompts, params):
        out = self.engine.generate(prompts, params)
        self.calls += 1
        self.tokens += int(out.lengths.sum())
        return out


def timed(fn, repeats: int) -> tuple[float, object]:
    times, out = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--batch-wait-ms", type=float, default=5.0)
    args = parser.parse_args()
    prompts = TOOL_MULTIPLY.make_prompts(args.prompts, seed=0)
    params = SamplingParams(max_new_tokens=24, stop_token_ids=(EOS,), n=args.n, seed=1)
    samples = len(prompts) * args.n

    builtin = CountingEngine(bigram_engine("tiny-llama-v32", script()))
    loop = ToolLoop(builtin, TOK, ToolBox([Calculator()]), ToolLoopConfig(max_turns=3, concurrency=8))
    loop_s, trajectories = timed(lambda: loop.generate(prompts, params), args.repeats)
    loop.close()

    served = CountingEngine(bigram_engine("tiny-llama-v32", script()))
    cfg = AgentConfig(
        fn="rl3d.agents.examples:calculator_agent", tool_format="qwen", concurrency=args.concurrency,
        timeout_s=60.0, max_batch_rows=256, batch_wait_ms=args.batch_wait_ms, max_body_bytes=1 << 20,
    )  # fmt: skip
    rollout = EndpointAgent(cfg, served, TOK)
    rows = [{"prompt": TOK.decode(p), "sample_index": j} for p in prompts for j in range(args.n)]
    agent_s, outcomes = timed(lambda: rollout.run(rows, params), args.repeats)

    same = all(
        [t for c in o.completions for t in c.response_ids]
        == [t for t, m in zip(tr.response_ids, tr.mask) if m]
        for o, tr in zip(outcomes, trajectories)
    )
    print(f"{samples} trajectories per rollout ({args.prompts} prompts x {args.n}), median of {args.repeats}")
    print("| loop | rollout s | trajectories/s | engine calls per rollout | generated tokens per rollout |")
    print("|---|---|---|---|---|")
    for name, seconds, eng in (
        ("tool loop (tool_loop)", loop_s, builtin),
        ("endpoint + openai agent", agent_s, served),
    ):
        per_rollout = f"{eng.calls / args.repeats:.1f} | {eng.tokens / args.repeats:.0f}"
        print(f"| {name} | {seconds:.3f} | {samples / seconds:.1f} | {per_rollout} |")
    print(f"same generated tokens per trajectory: {same}; rewards: {sorted({o.reward for o in outcomes})}")


if __name__ == "__main__":
    main()
