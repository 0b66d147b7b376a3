"""Messages through the model's chat template: the real SmolLM2 tokenizer, the tiny test
tokenizer, and the plain format of a tokenizer without a template; later turns extend the
earlier turn's ids."""

import pytest

from rl3d.agents.chat import ChatFormat
from rl3d.data.tool_task import CALL_END_ID, CALL_ID, OBS_END_ID, OBS_ID, ToolTokenizer
from rl3d.testing.chat import save_chat_tokenizer

CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "calculator", "arguments": '{"expression": "2*3"}'},
}
TOOL = {"type": "function", "function": {"name": "calculator", "parameters": {"type": "object"}}}


@pytest.fixture(scope="module")
def smollm2_tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir, local_files_only=True)


def test_smollm2_template_renders_tool_turns(smollm2_tokenizer):
    chat = ChatFormat(smollm2_tokenizer, tool_format="qwen")
    assert chat.templated and not chat.template_renders_calls  # SmolLM2's template has no tools
    messages = [
        {"role": "user", "content": "what is 2*3?"},
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": "6"},
    ]
    text = chat.render(messages, [TOOL], add_generation_prompt=True)
    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2*3"}}\n</tool_call>'
    assert f"<|im_start|>assistant\n{call}<|im_end|>" in text
    assert text.endswith("<|im_start|>tool\n6<|im_end|>\n<|im_start|>assistant\n")
    assert chat.prompt_ids(messages, [TOOL]) == smollm2_tokenizer.encode(text, add_special_tokens=False)


def test_smollm2_continuation_keeps_the_generated_ids(smollm2_tokenizer):
    chat = ChatFormat(smollm2_tokenizer)
    first = [{"role": "user", "content": "Say hi."}]
    end = smollm2_tokenizer.convert_tokens_to_ids("<|im_end|>")
    # " Hi" spelled as two tokens, as a model may sample it: the prompt keeps them as they were
    generated = (
        smollm2_tokenizer.encode("H", add_special_tokens=False)
        + smollm2_tokenizer.encode("i", add_special_tokens=False)
        + [end]
    )
    reply = {"role": "assistant", "content": "Hi"}
    later = [*first, reply, {"role": "user", "content": "Again."}]
    more = chat.continuation(first, reply, later, None, generated, stopped=True)
    ids = chat.prompt_ids(first, None) + generated + more
    assert chat.decode(ids) == chat.render(later, None, add_generation_prompt=True)
    assert more == smollm2_tokenizer.encode(
        "\n<|im_start|>user\nAgain.<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False
    )


def test_tiny_chat_tokenizer(tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(save_chat_tokenizer(tmp_path))
    chat = ChatFormat(tok)
    ids = chat.prompt_ids([{"role": "user", "content": "what is two plus three ?"}], None)
    assert chat.decode(ids).startswith("<|im_start|> system You are")
    assert ids[-2:] == tok.convert_tokens_to_ids(["<|im_start|>", "assistant"])


def test_plain_format_is_the_tool_loops_tokens():
    chat = ChatFormat(ToolTokenizer())
    assert not chat.templated
    user = {"role": "user", "content": "2*3="}
    reply = {"role": "assistant", "content": None, "tool_calls": [CALL]}
    later = [user, reply, {"role": "tool", "tool_call_id": "call_1", "content": "6"}]
    ids = chat.prompt_ids(later, [TOOL])
    c = ToolTokenizer().char_id
    call = [CALL_ID, c["2"], c["*"], c["3"], CALL_END_ID]
    assert ids == [c["2"], c["*"], c["3"], c["="], *call, OBS_ID, c["6"], OBS_END_ID]
    assert chat.continuation([user], reply, later, [TOOL], call, stopped=True) == [OBS_ID, c["6"], OBS_END_ID]


def test_an_end_token_the_template_does_not_write(smollm2_tokenizer):
    chat = ChatFormat(smollm2_tokenizer)
    first = [{"role": "user", "content": "Say hi."}]
    other_end = smollm2_tokenizer.convert_tokens_to_ids("<|endoftext|>")
    generated = smollm2_tokenizer.encode("Hi", add_special_tokens=False) + [other_end]
    reply = {"role": "assistant", "content": "Hi"}
    later = [*first, reply, {"role": "user", "content": "Again."}]
    more = chat.continuation(first, reply, later, None, generated, stopped=True)
    # the model's own end token stays; the template's ending for the turn follows it
    assert chat.decode(more).startswith("<|im_end|>\n<|im_start|>user\nAgain.")
    assert chat.continuation(first, reply, later, None, generated, stopped=False) is None
