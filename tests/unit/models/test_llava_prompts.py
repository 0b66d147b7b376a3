"""From verl-layout parquet to LLaVA's logits: rows with real PNG images (bytes and a path) and
`<image>` in their chat messages load through rl3d's dataset path; the loaded prompt ids (one
`<image>` per image) are megatron-core's LLaVA input as they are, the images go through CLIP's
image processor, and megatron's logits equal transformers' on the same prompts."""

import io

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image

from rl3d.config.schema import DataConfig
from rl3d.data import load_prompt_dataset, load_tokenizer
from rl3d.data.images import RuntimeImages
from rl3d.models.llava import (
    build_llava,
    hf_input_ids,
    llava_pixel_values,
    load_llava_weights,
    read_llava_config,
)
from rl3d.testing.chat import WORDS, save_chat_tokenizer, verl_row
from rl3d.testing.tiny_hf import make_tiny_llava


def _noise_png(seed: int, size: tuple[int, int]) -> bytes:
    gen = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (size[1], size[0], 3), generator=gen, dtype=torch.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels.numpy()).save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("llava_prompts")
    tok = load_tokenizer(str(save_chat_tokenizer(root / "tok", [*WORDS, "<image>"])), vocab_size=256)
    image_id = tok.convert_tokens_to_ids("<image>")
    hf = make_tiny_llava(seed=9, image_token_id=image_id)
    hf.save_pretrained(str(root / "hf"))
    (root / "cat.png").write_bytes(_noise_png(2, (16, 16)))
    rows = [
        {
            **verl_row("<image> what is two ?", "2", 0),
            "images": [{"bytes": _noise_png(1, (24, 20)), "path": None}],
        },
        {
            **verl_row("<image> plus <image> is what ?", "4", 1),
            "images": [{"bytes": None, "path": "cat.png"}, {"bytes": _noise_png(3, (40, 32)), "path": None}],
        },
    ]
    path = root / "mm.parquet"
    pq.write_table(pa.Table.from_pylist(rows), str(path))
    return tok, hf, root / "hf", str(path)


def test_parquet_rows_through_megatron_llava_equal_transformers(groups_1x1, setup):
    tok, hf, hf_dir, path = setup
    spec = read_llava_config(hf_dir)
    model = build_llava(spec, groups_1x1)
    load_llava_weights(model, spec, hf_dir, groups_1x1)
    model.eval()
    dataset = load_prompt_dataset(DataConfig(train_files=[path], max_prompt_length=64), tok)
    runtime = RuntimeImages()
    for item, num_images in zip(dataset, (1, 2), strict=True):
        assert item.prompt_ids.count(spec.image_token_id) == num_images == len(item.images)
        pixels = llava_pixel_values(runtime.load(item), spec)
        assert pixels.shape == (num_images, 3, 16, 16)
        ids = torch.tensor([item.prompt_ids])
        wide = torch.tensor([hf_input_ids(item.prompt_ids, spec)])
        assert wide.shape[1] == ids.shape[1] + num_images * (spec.num_image_tokens - 1)
        with torch.no_grad():
            ours = model(pixels, ids, torch.arange(ids.shape[1])[None], None)[0][..., : spec.text.vocab_size]
            ref = hf(input_ids=wide, pixel_values=pixels).logits
        diff = (ours - ref).abs().max().item()
        assert diff < 1e-5, (item.source, diff)  # measured: 7.2e-7 and 7.7e-7
    assert runtime.num_bad == 0
