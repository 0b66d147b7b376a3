"""Several tool calls in one reply under the real `openai` client, over a real torch engine (the
bigram machine): with `parallel_tool_calls` the reply's two `<tool_call>` blocks come back as two
`tool_calls`, each answered by its own `role: tool` message, and the next turn's prompt extends
the first's ids token-exactly with both results; without it the reply stops after the first call.
Each call here is one token of a word-level tokenizer, so the bigram machine can write two
different calls in a row."""

import json

import pytest

from rl3d.agents import AgentServer, training_sequences
from rl3d.agents.chat import ChatFormat
from rl3d.rollout import SamplingParams
from rl3d.testing.bigram import bigram_engine
from rl3d.tools.calculator import Calculator

openai = pytest.importorskip("openai")

ADD = '<tool_call>{"name":"calculator","arguments":{"expression":"1+2"}}</tool_call>'
MUL = '<tool_call>{"name":"calculator","arguments":{"expression":"3*4"}}</tool_call>'
VOCAB = [
    "[PAD]",
    "[UNK]",
    "<|im_start|>",
    "<|im_end|>",
    "user",
    "assistant",
    "tool",
    "go",
    ADD,
    MUL,
    "3",
    "12",
]
ID = {w: i for i, w in enumerate(VOCAB)}
TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + ' ' + m['content'] + '<|im_end|> ' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant ' }}{% endif %}"
)
TOOLS = [Calculator().schema()]


@pytest.fixture(scope="module")
def tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(ID, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", eos_token="<|im_end|>",
        additional_special_tokens=["<|im_start|>"],
    )  # fmt: skip
    fast.chat_template = TEMPLATE
    return fast


def serve(tokenizer, **kw):
    # after "assistant": the addition's call, then the multiplication's, then the end
    engine = bigram_engine(
        "tiny-llama-v32", {ID["assistant"]: ID[ADD], ID[ADD]: ID[MUL], ID[MUL]: ID["<|im_end|>"]}
    )
    defaults = SamplingParams(max_new_tokens=6, stop_token_ids=(ID["<|im_end|>"],), seed=1)
    return AgentServer(engine, tokenizer, defaults, chat=ChatFormat(tokenizer, tool_format="qwen"), **kw)


def _ask(api, messages, **kw):
    return api.chat.completions.create(model="m", messages=messages, tools=TOOLS, **kw).choices[0]


@pytest.mark.parametrize("by", ["request", "server"])
def test_several_calls_each_answered_by_its_own_tool_message(tokenizer, by):
    server = serve(tokenizer, parallel_tool_calls=by == "server")
    parallel = {"parallel_tool_calls": True} if by == "request" else {}
    with server:
        api = openai.OpenAI(
            base_url=server.base_url, api_key="rl3d", default_headers={"X-Session-Id": "s"}, max_retries=0
        )
        messages = [{"role": "user", "content": "go"}]
        first = _ask(api, messages, **parallel)
        assert first.finish_reason == "tool_calls" and first.message.content is None
        calls = first.message.tool_calls
        assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
            ("calculator", {"expression": "1+2"}),
            ("calculator", {"expression": "3*4"}),
        ]
        assert len({c.id for c in calls}) == 2 and all(c.type == "function" for c in calls)
        messages.append(first.message.model_dump(exclude_none=True))
        for call in calls:
            result = Calculator().call(json.loads(call.function.arguments)).observation()
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
        _ask(api, messages, **parallel)
    first_turn, second_turn = server.sessions.completions["s"]
    assert first_turn.response_ids == [ID[ADD], ID[MUL], ID["<|im_end|>"]]
    # the second prompt is the first prompt and reply as generated, then both results
    head = first_turn.prompt_ids + first_turn.response_ids
    assert second_turn.prompt_ids[: len(head)] == head
    results = [
        ID["<|im_start|>"],
        ID["tool"],
        ID["3"],
        ID["<|im_end|>"],
        ID["<|im_start|>"],
        ID["tool"],
        ID["12"],
    ]
    assert second_turn.prompt_ids[len(head) : len(head) + len(results)] == results
    (seq,) = training_sequences([first_turn, second_turn])  # one training sequence
    assert [t for t, m in zip(seq.ids, seq.mask) if m] == first_turn.response_ids + second_turn.response_ids


def test_without_parallel_calls_a_reply_stops_at_its_first_call(tokenizer):
    with serve(tokenizer) as server:
        api = openai.OpenAI(base_url=server.base_url, api_key="rl3d", max_retries=0)
        for parallel in ({}, {"parallel_tool_calls": False}):
            reply = _ask(api, [{"role": "user", "content": "go"}], **parallel)
            (call,) = reply.message.tool_calls
            assert json.loads(call.function.arguments) == {"expression": "1+2"}
        with pytest.raises(openai.BadRequestError) as err:
            _ask(api, [{"role": "user", "content": "go"}], extra_body={"parallel_tool_calls": "yes"})
        assert err.value.body["param"] == "parallel_tool_calls"
