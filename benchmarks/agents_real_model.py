"""The agents endpoint over the torch engine serving the real SmolLM2-135M-Instruct, driven by the
real `openai` client: a two-turn chat (the second turn sends the first reply back), greedy, with
`top_logprobs` on the first; prints the replies, how they finished, the first token's
alternatives, and the largest gap between the log-probs the endpoint recorded and HF's forward
on the same ids.

    python benchmarks/agents_real_model.py     # needs `rl3d models fetch smollm2-135m` once
"""

import time

import openai
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rl3d.agents import AgentServer
from rl3d.agents.chat import ChatFormat
from rl3d.models.hub import model_dir
from rl3d.models.spec import spec_in_dir
from rl3d.parallel.sharding import padded_vocab_size
from rl3d.rollout import SamplingParams, TorchRolloutEngine
from rl3d.testing.lora import hf_logprobs, megatron_from_hf


def main() -> None:
    path = model_dir("smollm2-135m")
    spec, tok = spec_in_dir(path), AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    engine = TorchRolloutEngine(spec, megatron_from_hf(spec, model, padded_vocab_size(spec.vocab_size, 1)))
    defaults = SamplingParams(max_new_tokens=24, stop_token_ids=(tok.eos_token_id,), seed=3)
    with AgentServer(engine, tok, defaults, chat=ChatFormat(tok)) as server:
        client = openai.OpenAI(
            base_url=server.base_url, api_key="rl3d", default_headers={"X-Session-Id": "s"}, max_retries=0
        )
        messages = [{"role": "user", "content": "What is 2 + 3? Answer with the number."}]
        started = time.perf_counter()
        first = client.chat.completions.create(
            model="any", messages=messages, max_tokens=24, temperature=0, logprobs=True, top_logprobs=3
        ).choices[0]
        messages += [first.message.model_dump(exclude_none=True), {"role": "user", "content": "And 10 + 5?"}]
        second = client.chat.completions.create(model="any", messages=messages, max_tokens=24, temperature=0)
        seconds = time.perf_counter() - started
        completions = server.sessions.close("s")
    alternatives = [(t.token, round(t.logprob, 3)) for t in first.logprobs.content[0].top_logprobs]
    print(f"turn 1: {first.message.content!r} ({first.finish_reason}); first token's top 3: {alternatives}")
    reply = second.choices[0]
    print(f"turn 2: {reply.message.content!r} ({reply.finish_reason}); {seconds:.1f} s")
    gap = max(
        float((torch.tensor(c.logprobs) - hf_logprobs(model, c.prompt_ids, c.response_ids)).abs().max())
        for c in completions
    )
    print(f"{len(completions)} completions recorded; largest |endpoint - HF| log-prob {gap:.2e}")


if __name__ == "__main__":
    main()
