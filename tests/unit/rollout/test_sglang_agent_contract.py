"""What the agent endpoint needs from an engine, checked against the pinned SGLang wheel's source
(read with `ast`, never imported): token ids in; each output's ids, the log-probs of those very
tokens and a finish reason out; and, for `top_logprobs`, each token's alternatives, most likely
first, from the same (original, temperature-1) log-probs as the sampled token's. The adapter's
parsing of an output of that shape gives the batch the endpoint serves. Skipped, saying why,
where the wheel cannot be downloaded."""

import ast
import re

import pytest
import torch
from sglang_wheel import param_names, wheel_or_skip

from rl3d.rollout.base import RolloutBatch
from rl3d.rollout.sglang_outputs import parse_output, top_tensors
from rl3d.rollout.sglang_weights import REQUIRED_ENGINE_API, SGLANG_CHILD_ENV

TOKENIZER_MANAGER = "sglang/srt/managers/tokenizer_manager.py"


@pytest.fixture(scope="module")
def wheel():
    return wheel_or_skip()


def test_generate_takes_ids_and_asks_for_the_top_logprobs(wheel):
    names, _ = param_names(wheel.engine_methods()["generate"])
    assert set(REQUIRED_ENGINE_API["generate"]) == {
        "input_ids",
        "sampling_params",
        "return_logprob",
        "top_logprobs_num",
        "lora_path",
    }
    assert set(REQUIRED_ENGINE_API["generate"]) <= names


def test_outputs_carry_the_fields_the_adapter_reads(wheel):
    text = wheel.text(TOKENIZER_MANAGER)
    for key in ("output_token_logprobs", "output_top_logprobs", "finish_reason"):
        assert re.search(rf'meta_info\["{key}"\]|"{key}":', text), key
    # every entry is (log-prob, token id, text), with or without the text
    detok = wheel.class_node(TOKENIZER_MANAGER, "TokenizerManager")
    fn = next(n for n in detok.body if getattr(n, "name", "") == "detokenize_logprob_tokens")
    body = ast.unparse(fn)
    assert (
        "(logprob, token_id, None)" in body
        and "zip(token_logprobs_val, token_logprobs_idx, token_texts)" in body
    )
    # a position without alternatives is None (the adapter reads it as none)
    tops = next(n for n in detok.body if getattr(n, "name", "") == "detokenize_top_logprobs_tokens")
    assert "ret.append(None)" in ast.unparse(tops)


def test_alternatives_are_the_top_k_of_the_sampled_tokens_logprobs(wheel):
    # sorted, most likely first
    raw = ast.unparse(wheel.function_node("sglang/srt/layers/logprob_processor.py", "get_top_logprobs_raw"))
    assert "logprobs.topk(max_k, dim=-1)" in raw
    # the same tensor as the sampled token's log-prob: the original softmax under the flag rl3d sets
    assert "SGLANG_RETURN_ORIGINAL_LOGPROB" in SGLANG_CHILD_ENV
    sampler = wheel.text("sglang/srt/layers/sampler.py")
    assert re.search(
        r"elif SGLANG_RETURN_ORIGINAL_LOGPROB:\s+logprobs = original_logprobs\s+logprob_result = "
        r"self\.output_logprob_processor\.compute_logprobs\(\s+logprobs,\s+top_logprobs_nums,",
        sampler,
    )


def test_an_output_of_that_shape_is_the_batch_the_endpoint_serves():
    """Two rows as SGLang answers them with top_logprobs_num=2 (one stopped, one at its
    length); the adapter's batch lists each token's alternatives with their log-probs."""
    outputs = [
        {
            "output_ids": [7, 2],
            "meta_info": {
                "finish_reason": {"type": "stop", "matched": 2},
                "output_token_logprobs": [(-0.1, 7, None), (-0.5, 2, None)],
                "output_top_logprobs": [[(-0.1, 7, None), (-2.4, 9, None)], [(-0.5, 2, "x"), (-1.2, 4, "y")]],
            },
        },
        {
            "output_ids": [5],
            "meta_info": {
                "finish_reason": {"type": "length", "length": 1},
                "output_token_logprobs": [(-3.0, 5, None)],
                "output_top_logprobs": [
                    [(-0.7, 1, None), (-0.9, 3, None)]
                ],  # the sampled token not among them
            },
        },
    ]
    rows = [parse_output(o, 2) for o in outputs]
    batch = RolloutBatch.from_lists(
        [r[0] for r in rows],
        [r[1] for r in rows],
        [r[2] for r in rows],
        [0, 1],
        raw_logprobs=[r[1] for r in rows],
    )
    batch.top_ids, batch.top_logprobs = top_tensors([r[3] for r in rows], 2)
    assert batch.finish_reasons == ["stop", "length"] and batch.responses() == [[7, 2], [5]]
    lps = batch.token_logprobs(raw=True)
    assert lps[0] == pytest.approx([-0.1, -0.5]) and lps[1] == pytest.approx([-3.0])
    top = batch.token_top()
    assert [[[i for i, _ in alts] for alts in row] for row in top] == [[[7, 9], [2, 4]], [[1, 3]]]
    assert top[0][1][1][1] == pytest.approx(-1.2) and batch.top_ids.shape == (2, 2, 2)
    assert torch.equal(batch.top_logprobs[1, 1], torch.zeros(2))  # past the row's one token
    assert parse_output(outputs[0])[3] == []  # not asked: none read
    short = {**outputs[0], "meta_info": {**outputs[0]["meta_info"], "output_top_logprobs": [None]}}
    with pytest.raises(RuntimeError, match="top log-probs for 1 of 2 tokens"):
        parse_output(short, 2)
