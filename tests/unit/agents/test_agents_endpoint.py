"""The endpoint under the real `openai` client, over a real `TorchRolloutEngine` (the bigram
machine of `rl3d.testing.bigram` over the tool task's tokenizer, so each prompt's last token
picks what the policy writes): multi-turn chat with tool calls, recorded ids and log-probs equal
to the engine's, batching, errors in OpenAI's shape."""

import http.client
import json
import threading
import time

import pytest

from rl3d.agents import AgentServer, training_sequences
from rl3d.agents.chat import ChatFormat
from rl3d.data.tool_task import CALL_END_ID, CALL_ID, OBS_END_ID, ToolTokenizer
from rl3d.rollout import SamplingParams
from rl3d.testing.bigram import bigram_engine
from rl3d.tools.calculator import Calculator

openai = pytest.importorskip("openai")

TOK = ToolTokenizer(32)
EOS = 1
c = TOK.char_id
# "=" -> CALL 1 + 2 CALL_END (a calculator call); "?" -> CALL_END (a close tag alone: malformed);
# after a tool result (OBS_END) -> "7" EOS; "-" -> 9 9 9 ... (never stops)
NEXT = {
    c["="]: CALL_ID,
    CALL_ID: c["1"],
    c["1"]: c["+"],
    c["+"]: c["2"],
    c["2"]: CALL_END_ID,
    c["?"]: CALL_END_ID,
    OBS_END_ID: c["7"],
    c["7"]: EOS,
    c["-"]: c["9"],
    c["9"]: c["9"],
}
TOOLS = [Calculator().schema()]


class RecordingEngine:
    """The real engine, with every generate call's prompts and output kept for the checks."""

    def __init__(self, engine):
        self.engine, self.spec, self.calls = engine, engine.spec, []

    def generate(self, prompts, params):
        out = self.engine.generate(prompts, params)
        self.calls.append(([list(p) for p in prompts], params, out))
        return out

    def engine_rows(self):
        """(prompt ids, response ids, raw log-probs) of every row the engine generated."""
        for prompts, _, out in self.calls:
            for row, (ids, lps) in enumerate(zip(out.responses(), out.token_logprobs(raw=True))):
                yield prompts[out.prompt_index[row]], ids, lps


def serve(wait_s=0.005, **kw):
    engine = RecordingEngine(bigram_engine("tiny-llama-v32", NEXT))
    defaults = SamplingParams(max_new_tokens=8, stop_token_ids=(EOS,), seed=3)
    return engine, AgentServer(engine, TOK, defaults, chat=ChatFormat(TOK), batch_wait_s=wait_s, **kw)


def client(server, session):
    return openai.OpenAI(
        base_url=server.base_url, api_key="rl3d", default_headers={"X-Session-Id": session}, max_retries=0
    )


def test_multi_turn_tool_calls_are_recorded_token_exact():
    engine, server = serve()
    with server:
        assert server.base_url.startswith("http://127.0.0.1:")
        api = client(server, "s1")
        messages = [{"role": "user", "content": "3*4="}]
        first = api.chat.completions.create(model="any-name", messages=messages, tools=TOOLS, logprobs=True)
        choice = first.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        (call,) = choice.message.tool_calls
        assert call.type == "function" and call.function.name == "calculator"
        assert json.loads(call.function.arguments) == {"expression": "1+2"}
        messages.append(choice.message.model_dump(exclude_none=True))
        result = Calculator().call(json.loads(call.function.arguments)).observation()
        messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
        second = api.chat.completions.create(model="any-name", messages=messages, tools=TOOLS, logprobs=True)
        assert second.choices[0].message.content == "7" and second.choices[0].finish_reason == "stop"
        messages += [
            second.choices[0].message.model_dump(exclude_none=True),
            {"role": "user", "content": "5="},
        ]
        third = api.chat.completions.create(model="any-name", messages=messages, tools=TOOLS, logprobs=True)
        assert third.choices[0].finish_reason == "tool_calls"
    recorded = server.sessions.completions["s1"]
    assert len(recorded) == 3
    rows = list(engine.engine_rows())
    for completion, reply in zip(recorded, (first, second, third)):
        # the ids the engine was given and generated, and its raw log-probs, exactly
        assert (completion.prompt_ids, completion.response_ids, completion.logprobs) in rows
        assert [t.logprob for t in reply.choices[0].logprobs.content] == completion.logprobs
    assert recorded[0].response_ids == [CALL_ID, c["1"], c["+"], c["2"], CALL_END_ID]
    assert recorded[1].prompt_ids[-3:] == TOK.encode("<result>3</result>")
    assert recorded[1].response_ids == [c["7"], EOS]
    (seq,) = training_sequences(recorded)  # every turn extends the last: one sequence
    assert seq.ids == recorded[2].prompt_ids + recorded[2].response_ids
    generated = [t for r in recorded for t in r.response_ids]
    assert [t for t, m in zip(seq.ids, seq.mask) if m] == generated
    assert [lp for lp, m in zip(seq.logprobs, seq.mask) if m] == [lp for r in recorded for lp in r.logprobs]
    assert seq.mask[: seq.prompt_length] == [0] * seq.prompt_length


def test_concurrent_requests_share_engine_calls():
    engine, server = serve(wait_s=0.2)
    replies = {}
    with server:

        def ask(i):
            out = client(server, f"s{i}").chat.completions.create(
                model="m", messages=[{"role": "user", "content": f"{i}="}]
            )
            replies[i] = out.choices[0]

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    # no tools offered: the call is text, and generation runs on to max_tokens
    assert len(replies) == 6 and all(r.finish_reason == "length" for r in replies.values())
    assert all(r.message.content.startswith('<tool_call>{"name": "calculator"') for r in replies.values())
    assert len(engine.calls) < 6 and sum(len(p) for p, _, _ in engine.calls) == 6
    assert server.batcher.stats.requests == 6


def test_requests_of_every_running_agent_go_at_once():
    """When every running agent waits on a request, none can come before a reply: the batch
    goes without waiting out `batch_wait_s` (30 s here), in one engine call."""
    from rl3d.agents.batcher import GenerateBatcher

    engine = RecordingEngine(bigram_engine("tiny-llama-v32", NEXT))
    batcher = GenerateBatcher(engine, wait_s=30.0, live=lambda: 3)
    params = SamplingParams(max_new_tokens=4, stop_token_ids=(EOS,), seed=1)
    start = time.monotonic()
    futures = [batcher.submit(TOK.encode(f"{i}="), params) for i in range(3)]
    replies = [f.result(timeout=60) for f in futures]
    batcher.close()
    assert time.monotonic() - start < 10 and len(engine.calls) == 1
    assert all(len(r) == 1 for r in replies)


def test_malformed_call_text_comes_back_as_content():
    _, server = serve()
    with server:
        reply = client(server, "s").chat.completions.create(
            model="m", messages=[{"role": "user", "content": "1?"}], tools=TOOLS
        )
    assert reply.choices[0].message.tool_calls is None
    assert reply.choices[0].message.content == '"}}</tool_call>' and reply.choices[0].finish_reason == "stop"


def test_text_completions_n_stop_and_length():
    engine, server = serve()
    with server:
        api = client(server, "t")
        out = api.completions.create(model="m", prompt=TOK.encode("1-"), max_tokens=5, n=2, logprobs=0)
        assert [ch.finish_reason for ch in out.choices] == ["length", "length"]
        assert out.choices[0].text == "99999" and out.usage.completion_tokens == 10
        cut = api.completions.create(model="m", prompt="1-", max_tokens=6, stop=["99"])
        assert cut.choices[0].text == "" and cut.choices[0].finish_reason == "stop"
        models = api.models.list()
        assert [m.id for m in models.data] == ["rl3d-policy"]
    kept = server.sessions.completions["t"][-1]
    assert kept.response_ids == [c["9"], c["9"]]  # the tokens up to the stop string stay recorded


def _raw(server, method, path, body: bytes, headers=None):
    port = int(server.base_url.split(":")[-1].split("/")[0])
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request(method, path, body=body, headers=headers or {})
    response = conn.getresponse()
    return response.status, json.loads(response.read())


def test_bad_requests_get_openai_errors():
    _, server = serve(max_body_bytes=1000)
    with server:
        status, body = _raw(server, "POST", "/v1/chat/completions", b"{not json")
        assert status == 400 and body["error"]["type"] == "invalid_request_error"
        status, body = _raw(server, "POST", "/v1/chat/completions", b"x" * 2000)
        assert status == 413 and "over the limit" in body["error"]["message"]
        status, body = _raw(server, "GET", "/v1/nothing", b"")
        assert status == 404
        api = client(server, "e")
        for kwargs, param in [
            ({"temperature": 5}, "temperature"),
            ({"stream": "yes"}, "stream"),
            ({"top_logprobs": 3}, "top_logprobs"),  # without logprobs: true
            ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
            ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0]"),
        ]:
            args = {"model": "m", "messages": [{"role": "user", "content": "1="}]} | kwargs
            with pytest.raises(openai.BadRequestError) as err:
                api.chat.completions.create(**args)
            assert err.value.body["param"] == param, err.value.body
        server.sessions.close("e")  # an agent past its time
        with pytest.raises(openai.BadRequestError, match="is over"):
            api.chat.completions.create(model="m", messages=[{"role": "user", "content": "1="}])
        assert "e" not in server.sessions.completions


def test_streaming_clients_get_the_reply_as_events():
    _, server = serve()
    with server:
        api = client(server, "st")
        stream = api.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "3*4="}], tools=TOOLS, stream=True,
            stream_options={"include_usage": True},
        )  # fmt: skip
        chunks = list(stream)
        text = api.completions.create(model="m", prompt="1-", max_tokens=3, stream=True)
        assert "".join(ch.choices[0].text for ch in text) == "999"
    calls = [c for ch in chunks for choice in ch.choices for c in choice.delta.tool_calls or []]
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("calculator", {"expression": "1+2"})
    ]
    assert [choice.finish_reason for ch in chunks for choice in ch.choices][-1] == "tool_calls"
    assert chunks[-1].usage.completion_tokens == 5
    assert len(server.sessions.completions["st"]) == 2  # recorded as any other request
