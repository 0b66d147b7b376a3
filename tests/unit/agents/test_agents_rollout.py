"""`rollout.agent`: user agents per sample with failures and timeouts counted, and their sessions
as the trainer's rows, on a real engine through the real `openai` client. The tokenizer here
fuses tokens when decoding, so the text "ab" the policy wrote as the tokens `a`, `b` tokenizes
back as the single token `ab`: the rows must hold `a`, `b`."""

import time

import pytest
import torch

from rl3d.agents.rollout import AgentOutcome, agent_record, agent_reward, run_agents
from rl3d.config import ConfigError, load_config
from rl3d.single_controller.batch import PROMPT_WIDTH, DataBatch
from rl3d.testing.bigram import bigram_engine
from rl3d.tools.trajectory import trajectory_metrics

pytest.importorskip("openai")

ROOT = __import__("pathlib").Path(__file__).resolve().parents[3]
RECIPE = ROOT / "recipes" / "quickstart_cpu_tool_agent.yaml"
VOCAB = ["[PAD]", "[UNK]", "<|im_start|>", "<|im_end|>", "user", "assistant", "a", "b", "ab", "hi", "go"]
ID = {w: i for i, w in enumerate(VOCAB)}
TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + ' ' + m['content'] + '<|im_end|> ' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant ' }}{% endif %}"
)


@pytest.fixture(scope="module")
def fused_tokenizer(tmp_path_factory):
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


def two_turn_agent(client, sample):
    """Says the sample's word, then "go"; the reward is how many replies were "ab"."""
    prompt = sample["prompt"]  # a chat row's messages, else text
    messages = list(prompt) if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
    score = 0.0
    for follow_up in ("go", None):
        reply = client.chat.completions.create(model="m", messages=messages).choices[0].message
        score += reply.content == "ab"
        if follow_up:
            messages += [reply.model_dump(exclude_none=True), {"role": "user", "content": follow_up}]
    return score, {"sample": sample["sample_index"]}


def test_sessions_become_rows_with_the_generated_ids(fused_tokenizer):
    from rl3d.workers.generation import TRAJECTORY, Generation

    tok = fused_tokenizer
    assert tok.encode(tok.decode([ID["a"], ID["b"]]), add_special_tokens=False) == [ID["ab"]]
    cfg = load_config(
        RECIPE, [f"rollout.agent.fn={__name__}:two_turn_agent", "rollout.stop_token_ids=[3]"]
    ).config
    engine = bigram_engine(
        "tiny-llama-v32", {ID["assistant"]: ID["a"], ID["a"]: ID["b"], ID["b"]: ID["<|im_end|>"]}
    )
    generation = Generation(cfg, engine, tok, pad_token_id=0)
    prompts = DataBatch(
        {"uid": torch.tensor([10, 11])},
        {
            "prompt_ids": [[ID["hi"]], [ID["go"]]],
            "prompt_text": ["hi", "<|im_start|>user go<|im_end|> <|im_start|>assistant "],  # framed
            "answer": [None, None],
            "index": [0, 1],
            "messages": [None, [{"role": "user", "content": "go"}]],  # a text row, a chat row
        },
        {PROMPT_WIDTH: 4},
    )
    batch = generation.generate(prompts, step=1, gen_dp_rank=0).batch
    assert len(batch) == 8 and batch["uid"].tolist() == [10] * 4 + [11] * 4  # n = 4 sessions a prompt
    records = batch[TRAJECTORY]
    assert [r["reward"] for r in records] == [2.0] * 8 and [r["agent"]["turns"] for r in records] == [2] * 8
    end = ID["<|im_end|>"]
    for i in range(8):
        mask = batch["response_mask"][i].bool()
        assert batch["responses"][i][mask].tolist() == [ID["a"], ID["b"], end] * 2  # never [ab]
        assert (batch["rollout_logp"][i][~mask] == 0).all()  # (the endpoint test pins the generated ones)
        # the first prompt (the template's, 6 tokens) fills the 4 prompt columns, then goes on unmasked
        ids = batch["input_ids"][i][batch["attention_mask"][i].bool()].tolist()
        word = "hi" if i < 4 else "go"
        assert ids[:6] == [ID["<|im_start|>"], ID["user"], ID[word], end, ID["<|im_start|>"], ID["assistant"]]
    assert records[0]["turns"] == [
        {"text": "ab<|im_end|>", "observation": "<|im_start|>usergo<|im_end|><|im_start|>assistant"},
        {"text": "ab<|im_end|>", "observation": None},
    ]
    metrics = trajectory_metrics(records)
    assert (
        metrics["agent/calls_mean"] == 2 and metrics["agent/errors"] == 0 and metrics["agent/timeouts"] == 0
    )

    class Row:
        trajectory = records[0]

    assert agent_reward(Row()) == 2.0


def two_questions_agent(client, sample):
    """Two independent questions (neither extends the other); the reward is the sample's index."""
    for word in ("hi", "go"):
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": word}])
    return float(sample["sample_index"])


@pytest.mark.parametrize("max_rows", [1, 2])
def test_completions_off_the_chain_train_as_their_own_rows(fused_tokenizer, max_rows):
    """Each of a session's sequences is a row (up to `max_rows_per_session`) with the session's
    reward and its prompt's group; the rest are counted, not trained."""
    from rl3d.workers.generation import TRAJECTORY, Generation

    cfg = load_config(
        RECIPE,
        [
            f"rollout.agent.fn={__name__}:two_questions_agent",
            "rollout.stop_token_ids=[3]",
            f"rollout.agent.max_rows_per_session={max_rows}",
        ],
    ).config
    engine = bigram_engine(
        "tiny-llama-v32", {ID["assistant"]: ID["a"], ID["a"]: ID["b"], ID["b"]: ID["<|im_end|>"]}
    )
    prompts = DataBatch(
        {"uid": torch.tensor([10, 11])},
        {
            "prompt_ids": [[ID["hi"]], [ID["go"]]],
            "prompt_text": ["hi", "go"],
            "answer": [None, None],
            "index": [0, 1],
        },
        {PROMPT_WIDTH: 4},
    )
    batch = (
        Generation(cfg, engine, fused_tokenizer, pad_token_id=0)
        .generate(prompts, step=1, gen_dp_rank=0)
        .batch
    )
    records = batch[TRAJECTORY]
    assert len(batch) == 8 * max_rows
    assert batch["uid"].tolist() == [10] * 4 * max_rows + [11] * 4 * max_rows  # a prompt's rows together
    sessions = [r["agent"]["session"] for r in records]
    assert sessions == [f"{uid}-{j}" for uid in (10, 11) for j in range(4) for _ in range(max_rows)]
    assert [r["reward"] for r in records] == [float(s.split("-")[1]) for s in sessions]
    # the longest chain first (the last on a tie: the second question), then the other
    words = [ID["go"], ID["hi"]][:max_rows] * 8
    end = ID["<|im_end|>"]
    for i in range(len(batch)):
        ids = batch["input_ids"][i][batch["attention_mask"][i].bool()].tolist()
        assert ids[:6] == [ID["<|im_start|>"], ID["user"], words[i], end, ID["<|im_start|>"], ID["assistant"]]
        mask = batch["response_mask"][i].bool()
        assert batch["responses"][i][mask].tolist() == [ID["a"], ID["b"], end]
        assert records[i]["num_turns"] == 1
    stats = trajectory_metrics(records)
    assert stats["agent/extra_rows"] == 8 * (max_rows - 1)
    assert stats["agent/unused_completions"] == 8 * (2 - max_rows)
    assert stats["agent/calls_mean"] == 2 and stats["agent/turns_mean"] == 1


def test_failures_and_timeouts_score_zero_and_do_not_stall():
    def agent(client, sample):
        if sample == "raise":
            raise RuntimeError("agent bug")
        if sample == "hang":
            time.sleep(30)
        if sample == "text":
            return "not a number"
        return (0.5, {"ok": True}) if sample == "pair" else 1

    closed = []
    samples = ["raise", "hang", "text", "pair", "plain", "hang"]
    start = time.monotonic()
    outcomes = run_agents(
        agent, samples, [f"s{i}" for i in range(6)], lambda s: None, lambda s: closed.append(s) or [],
        concurrency=2, timeout_s=0.5,
    )  # fmt: skip
    assert time.monotonic() - start < 5  # two hung agents, 0.5 s each, two at a time
    assert [o.reward for o in outcomes] == [0.0, 0.0, 0.0, 0.5, 1.0, 0.0]
    assert [o.timed_out for o in outcomes] == [False, True, False, False, False, True]
    assert "agent bug" in outcomes[0].error and "not a finite number" in outcomes[2].error
    assert outcomes[3].info == {"ok": True} and sorted(closed) == [f"s{i}" for i in range(6)]
    records = [agent_record(o, None) for o in outcomes]
    stats = trajectory_metrics(records)
    assert stats["agent/errors"] == 2 and stats["agent/timeouts"] == 2
    assert isinstance(outcomes[0], AgentOutcome)


@pytest.mark.parametrize(
    "override, key",
    [
        ("rollout.agent.fn=no_such_module:run", "rollout.agent.fn"),
        ("rollout.agent.timeout_s=0", "rollout.agent.timeout_s"),
        ("rollout.agent.kind=tool_loop", "rollout.agent.fn"),  # the tool loop reads no fn
        ("rollout.multi_turn.enabled=true", "rollout.multi_turn.enabled"),  # the tool loop's old key
        ("rollout.agent.tool_format=hermes", "rollout.agent.tool_format"),
        ("rollout.agent.max_rows_per_session=0", "rollout.agent.max_rows_per_session"),
    ],
)
def test_bad_agent_settings_name_the_key(override, key):
    with pytest.raises(ConfigError) as err:
        load_config(RECIPE, [override])
    assert err.value.key == key, str(err.value)
