"""`top_logprobs` through the endpoint under the real `openai` client, over a real torch engine
with random weights (tiny-llama-v32 and the tool task's tokenizer, whose distributions are far
from uniform): each generated token's alternatives in OpenAI's format, most likely first, the
sampled token's own log-prob among them, equal to HF transformers' log_softmax on the recorded
ids within 1e-5."""

import sys
from pathlib import Path

import pytest
import torch

from rl3d.agents import AgentServer
from rl3d.agents.chat import ChatFormat
from rl3d.data.tool_task import ToolTokenizer
from rl3d.rollout import SamplingParams, TorchRolloutEngine

openai = pytest.importorskip("openai")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "rollout"))
from test_rollout_torch_engine import LOGPROB_TOL, hf_reference, megatron_model  # noqa: E402

TOK = ToolTokenizer(32)
K = 4


@pytest.fixture(scope="module")
def model():
    spec, _, full = megatron_model("tiny-llama-v32")
    return spec, full, hf_reference(spec, full)


def _reference_top(hf, prompt_ids, response_ids):
    with torch.no_grad():
        logits = hf(torch.tensor([prompt_ids + response_ids])).logits[0, len(prompt_ids) - 1 : -1].float()
    return torch.log_softmax(logits, -1).topk(K, -1)


def test_chat_and_text_completions_serve_the_models_top_logprobs(model):
    spec, full, hf = model
    engine = TorchRolloutEngine(spec, full)
    defaults = SamplingParams(max_new_tokens=6, seed=5)
    with AgentServer(engine, TOK, defaults, chat=ChatFormat(TOK)) as server:
        api = openai.OpenAI(base_url=server.base_url, api_key="rl3d", max_retries=0)
        chat = api.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "3*4="}], logprobs=True, top_logprobs=K, n=2,
            extra_headers={"X-Session-Id": "chat"},
        )  # fmt: skip
        text = api.completions.create(
            model="m", prompt="12+", logprobs=K, max_tokens=6, extra_headers={"X-Session-Id": "text"}
        )
    recorded = server.sessions.completions["chat"]
    assert len(recorded) == 2 and len(chat.choices) == 2
    worst, hits = 0.0, 0
    for choice, c in zip(chat.choices, recorded):
        ref_lp, ref_ids = _reference_top(hf, c.prompt_ids, c.response_ids)
        content = choice.logprobs.content
        assert [t.logprob for t in content] == c.logprobs  # the sampled tokens' (recorded) log-probs
        for step, (entry, token) in enumerate(zip(content, c.response_ids)):
            alts = entry.top_logprobs
            assert len(alts) == K and [a.token for a in alts] == [
                TOK.decode([i]) for i in ref_ids[step].tolist()
            ]
            lps = [a.logprob for a in alts]
            assert lps == sorted(lps, reverse=True)
            worst = max(worst, (torch.tensor(lps) - ref_lp[step]).abs().max().item())
            if token in ref_ids[step].tolist():  # the sampled token is listed with its own log-prob
                assert entry.logprob in lps and entry.token in [a.token for a in alts]
                hits += 1
    assert worst <= LOGPROB_TOL, worst
    assert hits > 0
    # the legacy text completion: `logprobs: k` gives {token: log-prob} per generated token
    (c,) = server.sessions.completions["text"]
    ref_lp, ref_ids = _reference_top(hf, c.prompt_ids, c.response_ids)
    tops = text.choices[0].logprobs.top_logprobs
    assert len(tops) == len(c.response_ids)
    for step, alts in enumerate(tops):
        want = {TOK.decode([i]): lp for i, lp in zip(ref_ids[step].tolist(), ref_lp[step].tolist())}
        assert alts.keys() == want.keys()
        assert max(abs(alts[t] - want[t]) for t in want) <= LOGPROB_TOL
