"""samples.jsonl: which rows, how they are decoded and labelled, TensorBoard's text, resume, the
summary's sample."""

import json

import torch

from rl3d.controller.summary import sample_lines
from rl3d.data import SyntheticTokenizer
from rl3d.logging import TensorBoardWriter, drop_rows_after
from rl3d.logging.samples import SAMPLES_NAME, SamplesLog, last_sample, pick_rows, sample_records
from rl3d.single_controller.batch import DataBatch

EOS, STOP = 1, 7  # an end id of the model, and a recipe's other stop id


def _batch():
    """3 prompts x 2 samples, prompt-major as the engines return them."""
    responses = [[20, 21, EOS], [22, STOP], [23, 24, 25], [26, EOS], [27], [28, 29]]
    reasons = ["stop", "stop", "length", "stop", "length", "length"]
    width = max(map(len, responses))
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in responses])
    return DataBatch(
        {
            "uid": torch.tensor([10, 10, 11, 11, 12, 12]),
            "score": torch.tensor([1.0, 0.0, 0.5, 0.25, 0.0, 1.0]),
            "response_mask": mask,
        },
        {
            "prompt_text": ["16 17", "16 17", "18 19", "18 19", "30 31", "30 31"],
            "response_ids": responses,
            "finish_reason": reasons,
            "source": [f"synthetic:t:{i // 2}" for i in range(6)],
        },
    )


def test_one_row_per_prompt_first():
    assert pick_rows([10, 10, 11, 11, 12, 12], 4) == [0, 2, 4, 1]
    assert pick_rows([5, 5], 4) == [0, 1] and pick_rows([1, 2], 0) == []


def test_records_decode_with_the_run_tokenizer_and_name_the_finish():
    records = sample_records(_batch(), SyntheticTokenizer(64), step=3, split="train", num=4, end_ids={EOS})
    assert [r["response"] for r in records] == ["20 21 1", "23 24 25", "27", "22 7"]  # special ids kept
    assert [r["finish_reason"] for r in records] == ["eos", "length", "length", "stop"]
    assert [r["num_tokens"] for r in records] == [3, 3, 1, 2]
    assert [r["reward"] for r in records] == [1.0, 0.5, 0.0, 0.0]
    assert records[0] == records[0] | {
        "step": 3,
        "split": "train",
        "prompt": "16 17",
        "source": "synthetic:t:0",
    }
    # a synthetic task has no end id: its stop token is a plain "stop"
    plain = sample_records(_batch(), SyntheticTokenizer(64), step=3, split="train", num=1, end_ids=())
    assert plain[0]["finish_reason"] == "stop"


def test_samples_log_file_tensorboard_text_resume_and_summary(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = TensorBoardWriter(tmp_path / "tb")
    log = SamplesLog(tmp_path, SyntheticTokenizer(64), num=2, end_ids={EOS}, text_sinks=[tb])
    for step in (1, 2, 3):
        log.log(step, _batch())
    log.log(3, _batch(), split="val")
    tb.close()
    rows = [json.loads(line) for line in (tmp_path / SAMPLES_NAME).read_text().splitlines()]
    assert [(r["step"], r["split"]) for r in rows] == [(1, "train")] * 2 + [(2, "train")] * 2 + [
        (3, "train")
    ] * 2 + [(3, "val")] * 2
    assert set(rows[0]) == {
        "step",
        "split",
        "prompt",
        "response",
        "reward",
        "finish_reason",
        "num_tokens",
        "source",
    }
    acc = EventAccumulator(str(tmp_path / "tb"), size_guidance={"tensors": 0})
    acc.Reload()
    assert {"samples/train/text_summary", "samples/val/text_summary"} <= set(acc.Tags()["tensors"])
    text = acc.Tensors("samples/train/text_summary")[-1].tensor_proto.string_val[0].decode()
    assert "**reward 1**, eos, 3 tokens (synthetic:t:0)" in text and "20 21 1" in text

    assert last_sample(tmp_path) == rows[4]  # the last step's first training sample
    lines = sample_lines(tmp_path)
    assert lines[0] == "a sample (step 3, reward 1, eos, 3 tokens):"
    assert lines[1:] == ["  prompt:   16 17", "  response: 20 21 1"]
    assert drop_rows_after(tmp_path, 1) == 6  # a resumed run keeps step 1's rows only
    assert [json.loads(line)["step"] for line in (tmp_path / SAMPLES_NAME).read_text().splitlines()] == [1, 1]
