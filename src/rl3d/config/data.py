"""`data.*`: where prompts come from and how a row becomes one (`rl3d.data.dataset`).

Column keys (`prompt_key`, `answer_key`, `source_key`) name a column, or with dots a field of a
struct column: verl's layout keeps the answer at `reward_model.ground_truth`. A column whose own
name holds a dot is found by that name first.

A prompt column holds text or chat messages (a list of `{role, content}`, as verl and TRL write
it). `chat_template` says when the tokenizer's chat template (with the generation prompt) frames
the prompt: `auto` for messages only, `always` also for text (the formatted `template` becomes
the user's message), `never` refuses a messages column. `system_prompt` is put first in every
conversation that has no system message of its own.

Images (verl's multimodal layout, `rl3d.data.images`): a file with the column `image_key` gives
each row its list of images, and its prompt one `image_placeholder` per image.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from rl3d.config.errors import FieldError


@dataclass(frozen=True, kw_only=True)
class SyntheticDataConfig:
    task: str = "copy_first"  # a task from rl3d.data.synthetic
    num_prompts: int = 512
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_prompts <= 0:
            raise FieldError("num_prompts", f"must be > 0, got {self.num_prompts}")


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    train_files: list[str] = field(default_factory=list)  # parquet files
    synthetic: SyntheticDataConfig | None = None  # used when train_files is empty
    prompt_key: str = "prompt"
    # None: the column `answer` when a file has it, else verl's `reward_model.ground_truth`
    answer_key: str | None = None
    source_key: str = "data_source"  # each row's data source, when the file has the column
    image_key: str = "images"  # each row's images, when the file has the column
    image_placeholder: str = "<image>"  # one in the prompt per image
    template: str = "{prompt}"  # str.format over a row's columns, for text prompts
    chat_template: Literal["auto", "always", "never"] = "auto"
    system_prompt: str | None = None
    tokenizer: str | None = None  # HF tokenizer dir; None = the model's, or the synthetic vocab
    max_prompt_length: int = 64
    prompts_per_step: int = 8
    shuffle: bool = True
    on_bad_row: Literal["skip", "error"] = "skip"
    val_files: list[str] = field(default_factory=list)  # parquet prompts for trainer.val_every

    def __post_init__(self) -> None:
        for name in ("max_prompt_length", "prompts_per_step"):
            if getattr(self, name) <= 0:
                raise FieldError(name, f"must be > 0, got {getattr(self, name)}")
        if not self.train_files and self.synthetic is None:
            raise FieldError("train_files", "give parquet files, or a data.synthetic block")
        if not self.image_placeholder.strip():
            raise FieldError("image_placeholder", "must be a non-empty marker such as '<image>'")
        for name in ("prompt_key", "answer_key", "source_key", "image_key"):
            key = getattr(self, name)
            if key is not None and (not key or "" in key.split(".")):
                raise FieldError(name, f"must name a column, or a field as column.field, got {key!r}")
        if self.system_prompt is not None and self.chat_template == "never":
            raise FieldError("system_prompt", "needs the chat template, but data.chat_template is never")
