"""rl3d.data: prompts for the RL loop.

    tokenizer = load_tokenizer(cfg.data.tokenizer or cfg.model.hf_path, vocab_size=spec.vocab_size)
    dataset = load_prompt_dataset(cfg.data, tokenizer, answer_check=answer_check_for(cfg.reward, cfg.data))
    sampler = PromptSampler(dataset, prompts_per_step=cfg.data.prompts_per_step,
                            seed=cfg.trainer.seed, shuffle=cfg.data.shuffle)
    batch = sampler.next_batch()  # list[PromptItem]

Parquet files (see `rl3d.data.dataset`), or a synthetic task (`rl3d.data.synthetic`) when
`data.train_files` is empty. `python -m rl3d.data.gsm8k` converts GSM8K jsonl into parquet;
`python -m rl3d.data.gsm8k_synth` writes GSM8K-style problems of its own in verl's layout.
"""

from rl3d.data.columns import check_first_row, check_layout
from rl3d.data.dataset import PromptDataset, PromptItem, load_prompt_dataset, template_columns
from rl3d.data.errors import DataError
from rl3d.data.sampler import PromptSampler
from rl3d.data.synthetic import SYNTHETIC_TASKS, SyntheticTask, get_synthetic_task, register_synthetic_task
from rl3d.data.tokenizer import EOS_ID, PAD_ID, SYMBOL_BASE, SyntheticTokenizer, load_tokenizer

__all__ = [
    "EOS_ID",
    "PAD_ID",
    "SYMBOL_BASE",
    "SYNTHETIC_TASKS",
    "DataError",
    "PromptDataset",
    "PromptItem",
    "PromptSampler",
    "SyntheticTask",
    "SyntheticTokenizer",
    "check_first_row",
    "check_layout",
    "get_synthetic_task",
    "load_prompt_dataset",
    "load_tokenizer",
    "register_synthetic_task",
    "template_columns",
]
