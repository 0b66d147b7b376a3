"""Images in verl's multimodal parquet layout: real PNG and JPEG bytes made by PIL, written by
pyarrow as HF `datasets` writes an `Image()` column ({bytes, path} structs), paths beside them,
`<image>` placeholders in chat messages; refusals name the file, the row and the key."""

import io
import logging
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from rl3d.cli import EXIT_BAD_INPUT, main
from rl3d.config import FieldError
from rl3d.config.schema import DataConfig
from rl3d.data import DataError, load_prompt_dataset, load_tokenizer
from rl3d.data.images import RuntimeImages, check_images_of_first_row, decode_image
from rl3d.testing.chat import WORDS, save_chat_tokenizer, verl_row

GRPO = str(Path(__file__).resolve().parents[3] / "recipes/quickstart_cpu_grpo.yaml")


def encoded(color: tuple[int, int, int], fmt: str = "PNG", size: tuple[int, int] = (8, 6)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, format=fmt)
    return buf.getvalue()


def image_row(question: str, answer: str, index: int, images: list) -> dict:
    row = verl_row(question, answer, index)
    row["images"] = images
    return row


def write(path: Path, rows: list[dict]) -> str:
    pq.write_table(pa.Table.from_pylist(rows), str(path), row_group_size=2)
    return str(path)


@pytest.fixture(scope="module")
def chat_tok(tmp_path_factory):
    directory = save_chat_tokenizer(tmp_path_factory.mktemp("chat_tok"), [*WORDS, "<image>"])
    return load_tokenizer(str(directory), vocab_size=64)


def test_verl_multimodal_rows_keep_their_images(tmp_path, chat_tok):
    red, blue = encoded((255, 0, 0)), encoded((0, 0, 255), "JPEG")
    Image.new("RGB", (4, 4), (0, 255, 0)).save(tmp_path / "green.png")
    rows = [
        image_row("<image> what is two ?", "2", 0, [{"bytes": red, "path": None}]),
        image_row(
            "<image> <image> what is three ?",
            "3",
            1,
            [{"bytes": blue, "path": "b.jpg"}, {"bytes": red, "path": None}],
        ),
        image_row("<image> what is two plus two ?", "4", 2, [{"bytes": None, "path": "green.png"}]),
        image_row("what is three plus three ?", "6", 3, []),  # a text-only row in the same file
    ]
    path = write(tmp_path / "mm.parquet", rows)
    ds = load_prompt_dataset(DataConfig(train_files=[path]), chat_tok)
    assert len(ds) == 4 and ds.num_bad_rows == 0
    assert ds[0].images == (red,) and ds[1].images == (blue, red) and ds[3].images == ()
    assert ds[2].images == (str(tmp_path / "green.png"),)  # a relative path, from the file's folder
    assert "<image>" in ds[0].prompt_text
    assert ds[0].prompt_ids.count(chat_tok.convert_tokens_to_ids("<image>")) == 1
    loaded = RuntimeImages().load(ds[1])
    assert [im.size for im in loaded] == [(8, 6), (8, 6)]
    assert loaded[1].getpixel((0, 0)) == (255, 0, 0)
    assert decode_image(ds[2].images[0]).getpixel((3, 3)) == (0, 255, 0)


def test_text_only_file_has_no_images(tmp_path, chat_tok):
    path = write(tmp_path / "text.parquet", [verl_row("what is two ?", "2", 0)])
    assert load_prompt_dataset(DataConfig(train_files=[path]), chat_tok)[0].images == ()


def test_bad_images_and_counts_are_bad_rows_naming_file_row_and_key(tmp_path, chat_tok, caplog):
    red = encoded((255, 0, 0))
    rows = [
        image_row("<image> what is two ?", "2", 0, [{"bytes": red, "path": None}]),
        image_row("<image> what is three ?", "3", 1, [{"bytes": red[:40], "path": None}]),  # truncated
        image_row("<image> <image> what is two ?", "2", 2, [{"bytes": red, "path": None}]),  # 1 of 2
        image_row("what is two ?", "2", 3, [{"bytes": red, "path": None}]),  # no placeholder
        image_row("<image> what is two ?", "2", 4, [{"bytes": None, "path": "missing.png"}]),
        image_row("<image> what is two ?", "2", 5, [{"bytes": b"no image here", "path": None}]),
    ]
    path = write(tmp_path / "bad.parquet", rows)
    with caplog.at_level(logging.WARNING):
        ds = load_prompt_dataset(DataConfig(train_files=[path]), chat_tok)
    assert [item.source for item in ds] == [f"{path}:0"]
    reasons = dict(ds.bad_rows)
    assert set(reasons) == {f"{path}:{row}" for row in range(1, 6)}
    assert reasons[f"{path}:1"].startswith("image 0 of column 'images': cannot decode (40 bytes)")
    assert reasons[f"{path}:2"] == (
        "column 'prompt' has 2 <image> placeholder(s) but column 'images' holds 1 image(s) "
        "(data.image_placeholder)"
    )
    assert "has 0 <image> placeholder(s)" in reasons[f"{path}:3"]
    assert "missing.png" in reasons[f"{path}:4"] and "cannot decode" in reasons[f"{path}:5"]
    assert f"skipping bad row {path}:1: image 0 of column 'images'" in caplog.text
    with pytest.raises(DataError, match=r"bad.parquet:1: image 0 of column 'images': cannot decode"):
        load_prompt_dataset(DataConfig(train_files=[path], on_bad_row="error"), chat_tok)


def test_image_column_of_another_type_is_a_recipe_error(tmp_path, chat_tok):
    path = write(tmp_path / "ints.parquet", [image_row("<image> what is two ?", "2", 0, [1, 2])])
    with pytest.raises(
        DataError, match=r"ints.parquet: column 'images' \(data.image_key\) is list<element: int64>"
    ):
        load_prompt_dataset(DataConfig(train_files=[path]), chat_tok)
    renamed = write(
        tmp_path / "pics.parquet", [{**verl_row("<image> two", "2", 0), "pics": [encoded((1, 2, 3))]}]
    )
    ds = load_prompt_dataset(DataConfig(train_files=[renamed], image_key="pics"), chat_tok)
    assert len(ds[0].images) == 1
    with pytest.raises(FieldError, match="image_placeholder"):
        DataConfig(train_files=[path], image_placeholder=" ")


def test_a_bad_image_at_run_time_is_reported_and_counted(tmp_path, chat_tok, caplog):
    picture = tmp_path / "p.png"
    Image.new("RGB", (4, 4), (9, 9, 9)).save(picture)
    path = write(tmp_path / "p.parquet", [image_row("<image> what is two ?", "2", 0, [str(picture)])])
    ds = load_prompt_dataset(DataConfig(train_files=[path]), chat_tok)
    picture.write_bytes(b"overwritten after loading")
    runtime = RuntimeImages()
    with caplog.at_level(logging.WARNING):
        assert runtime.load(ds[0]) is None  # no exception: the prompt is dropped
    assert runtime.num_bad == 1 and runtime.bad[0][0] == f"{path}:0"
    assert runtime.metrics() == {"data/bad_images": 1.0}
    assert f"dropping prompt {path}:0: image 0: cannot decode" in caplog.text


def test_preflight_checks_the_first_rows_images(tmp_path, capsys):
    good = write(
        tmp_path / "good.parquet", [{"prompt": "<image> a b", "answer": "1", "images": [encoded((1, 1, 1))]}]
    )
    check_images_of_first_row(good, DataConfig(train_files=[good]))
    bad = write(tmp_path / "bad.parquet", [{"prompt": "a b", "answer": "1", "images": [encoded((1, 1, 1))]}])
    with pytest.raises(DataError, match=r"bad.parquet:0: column 'prompt' has 0 <image> placeholder"):
        check_images_of_first_row(bad, DataConfig(train_files=[bad]))
    broken = write(tmp_path / "broken.parquet", [{"prompt": "<image> a", "answer": "1", "images": [b"xx"]}])
    run_dir = tmp_path / "run"
    code = main(["train", GRPO, f"trainer.run_dir={run_dir}", f"data.train_files=[{broken}]"])
    err = capsys.readouterr().err.strip()
    assert code == EXIT_BAD_INPUT and not run_dir.exists()
    assert len(err.splitlines()) == 1, err
    assert (
        "data.train_files[0]" in err and "broken.parquet:0: image 0 of column 'images': cannot decode" in err
    )
