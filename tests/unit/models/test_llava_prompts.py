"""From verl-layout parquet to LLaVA's logits: rows with real PNG images (bytes and a path) and
`<image>` in their chat messages load through rl3d's dataset path; the loaded prompt ids (one
`<image>` per image) are megatron-core's LLaVA input as they are, the images go through CLIP's
image processor, and megatron's logits equal transformers' on the same prompts."""

import io
from pathlib import Path

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

GRPO = Path(__file__).resolve().parents[3] / "recipes" / "quickstart_cpu_grpo.yaml"


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


def test_image_rows_roll_out_through_the_llava_engine(groups_1x1, setup):
    """The loaded rows as the rollout's prompt batch (`prompt_batch`: images carried, still
    encoded) through `Generation` on a `LlavaRolloutEngine`: n=4 rows a prompt, each row keeps
    its prompt's images, the tokens are the engine's on the processed pixels, each prompt's
    images are encoded once; a prompt whose image no longer decodes is dropped and counted."""
    from rl3d.config import load_config
    from rl3d.controller.prompts import prompt_batch
    from rl3d.rollout.vision import LlavaRolloutEngine
    from rl3d.single_controller.dispatch import INPUT_ROW
    from rl3d.workers.generation import Generation, rollout_sampling

    tok, _, hf_dir, path = setup
    spec = read_llava_config(hf_dir)
    model = build_llava(spec, groups_1x1)
    load_llava_weights(model, spec, hf_dir, groups_1x1)
    items = list(load_prompt_dataset(DataConfig(train_files=[path], max_prompt_length=64), tok))
    engine = LlavaRolloutEngine(spec, {n: p.detach() for n, p in model.named_parameters()})
    cfg = load_config(GRPO, ["rollout.max_new_tokens=5"]).config
    prompts = prompt_batch(items).set("uid", torch.tensor([10, 11]))
    assert prompts["images"] == [tuple(i.images) for i in items]
    batch = Generation(cfg, engine, tok, pad_token_id=0).generate(prompts, step=1, gen_dp_rank=0).batch
    n = cfg.rollout.n
    assert batch["uid"].tolist() == [10] * n + [11] * n
    assert batch["images"] == [items[0].images] * n + [items[1].images] * n
    assert engine.images_encoded == 3  # 1 + 2 images, not n times
    pixels = [llava_pixel_values(RuntimeImages().load(i), spec) for i in items]
    direct = engine.generate(
        [i.prompt_ids for i in items], rollout_sampling(cfg, step=1, gen_dp_rank=0), images=pixels
    )
    assert batch["response_ids"] == direct.responses()

    prompts["images"][0] = (b"not an image",)
    generation = Generation(cfg, engine, tok, pad_token_id=0)
    dropped = generation.generate(prompts, step=1, gen_dp_rank=0).batch
    assert dropped["uid"].tolist() == [11] * n and dropped[INPUT_ROW].tolist() == [1] * n
    alone = engine.generate(
        [items[1].prompt_ids], rollout_sampling(cfg, step=1, gen_dp_rank=0), images=pixels[1:]
    )
    assert dropped["response_ids"] == alone.responses()
    assert generation.images.metrics() == {"data/bad_images": 1.0}


def test_the_trainer_reads_the_rollouts_image_rows(groups_1x1, setup):
    """`Generation`'s batch of image rows (n=4 a prompt; the `images` column still encoded)
    as the trainer takes it: `row_pixels` decodes each prompt's images once for its rows, and
    `llava_response_logprobs` on megatron's LLaVA gives the engine's log-probs of every response
    token. An image that stops decoding is an error naming its row."""
    from rl3d.config import load_config
    from rl3d.controller.prompts import prompt_batch
    from rl3d.models.llava_logprobs import llava_response_logprobs
    from rl3d.rollout.vision import LlavaRolloutEngine
    from rl3d.workers.generation import Generation
    from rl3d.workers.vision_inputs import row_pixels

    tok, _, hf_dir, path = setup
    spec = read_llava_config(hf_dir)
    model = build_llava(spec, groups_1x1)
    load_llava_weights(model, spec, hf_dir, groups_1x1)
    model.eval()
    items = list(load_prompt_dataset(DataConfig(train_files=[path], max_prompt_length=64), tok))
    engine = LlavaRolloutEngine(spec, {n: p.detach() for n, p in model.named_parameters()})
    cfg = load_config(GRPO, ["rollout.max_new_tokens=6"]).config
    prompts = prompt_batch(items).set("uid", torch.tensor([10, 11]))
    # a random tiny model samples the image token now and then (the engine does not ban it):
    # step 2's 8 x 6 tokens hold none, step 1's hold one (refused below)
    batch = Generation(cfg, engine, tok, pad_token_id=0).generate(prompts, step=2, gen_dp_rank=0).batch
    assert not any(spec.image_token_id in r for r in batch["response_ids"])
    n = cfg.rollout.n
    runtime = RuntimeImages()
    loads = []
    load = runtime.load
    runtime.load = lambda item: loads.append(item.source) or load(item)
    pixels = row_pixels(batch, spec, runtime, str(hf_dir))
    assert loads == [items[0].source, items[1].source]  # once a prompt, not n times
    assert [len(p) for p in pixels] == [1] * n + [2] * n
    assert all(p is pixels[0] for p in pixels[:n])
    with torch.no_grad():
        logp, _ = llava_response_logprobs(
            model, spec, batch["input_ids"], batch["attention_mask"], batch["responses"], pixels
        )
    mask = batch["response_mask"].bool()
    worst = (logp - batch["rollout_logp"])[mask].abs().max().item()
    assert worst < 1e-5, worst  # measured 4.8e-7 (fp32)

    sampled = Generation(cfg, engine, tok, pad_token_id=0).generate(prompts, step=1, gen_dp_rank=0).batch
    with pytest.raises(ValueError, match=r"row \d+: response token \d+ is the image token"):
        llava_response_logprobs(
            model, spec, sampled["input_ids"], sampled["attention_mask"], sampled["responses"], pixels
        )

    batch["images"][n] = (b"not an image",)
    with pytest.raises(RuntimeError, match=rf"row {n} \(.*mm.parquet:1\): an image of column 'images'"):
        row_pixels(batch, spec, RuntimeImages(), str(hf_dir))
