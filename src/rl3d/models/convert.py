"""HF <-> Megatron weight conversion, one tensor at a time, on CPU without process groups.

Megatron weight directory (what `rl3d convert hf2mcore` writes, `load_weights` reads):

    DIR/rl3d_meta.json                       format, tp, pp, ep, padded_vocab, model_type, spec,
                                             HF config
    DIR/mp_rank_{tp:02d}_{pp:03d}/model.safetensors
                                             the TP shard `tp` of PP stage `pp`, stage-local names
                                             (`decoder.layers.{local}.…`, see rl3d.models.builder)
    DIR/mp_rank_{tp:02d}_{pp:03d}_{ep:03d}/model.safetensors
                                             with expert parallelism (ep > 1): EP rank `ep`'s file
                                             holds its experts (EP-local indices) and a copy of
                                             every other parameter, so each rank reads one file
    DIR/mp_rank_{tp:02d}_{pp:03d}/ + DIR/expert_rank_{etp:02d}_{pp:03d}_{ep:03d}/
                                             with expert tensor parallelism apart from tp (`etp`):
                                             the dense weights by TP shard, each EP rank's experts
                                             by expert TP shard (each file written by one rank)
    DIR/hf_extra/                            the HF directory's other files (config, tokenizer, …)

Tensors keep the HF checkpoint's dtype, so HF -> Megatron -> HF is bit for bit. The embedding
(and untied output layer) is padded to `padded_vocab_size(vocab, tp)` rows with zeros. With
tied embeddings no output layer is stored; a p > 1 last stage fills its copy from the embedding.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from rl3d.models.builder import layers_per_stage, stage_param_names
from rl3d.models.hf_mapping import TensorMap, spec_from_hf_config, tensor_maps
from rl3d.models.params import EMBEDDING, OUTPUT_LAYER, megatron_params
from rl3d.models.safetensors_io import INDEX_NAME, ShardedReader, StreamingWriter, split_into_files
from rl3d.models.spec import ModelSpec
from rl3d.ops.layouts import merge_tp_shards, padded_vocab_size, shard_for_tp

logger = logging.getLogger(__name__)

META_NAME = "rl3d_meta.json"
FORMAT = "rl3d-mcore-v1"
HF_EXTRA = "hf_extra"
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".index.json", ".msgpack", ".h5")
_VOCAB_PARAMS = (EMBEDDING, OUTPUT_LAYER)


def shard_dir_name(tp_rank: int, pp_rank: int, ep_rank: int | None = None) -> str:
    """A shard's directory; `ep_rank` only when the directory is expert-parallel (ep > 1)."""
    suffix = "" if ep_rank is None else f"_{ep_rank:03d}"
    return f"mp_rank_{tp_rank:02d}_{pp_rank:03d}{suffix}"


def expert_dir_name(etp_rank: int, pp_rank: int, ep_rank: int) -> str:
    """The directory of EP rank `ep_rank`'s experts, expert TP shard `etp_rank`, of a stage."""
    return f"expert_rank_{etp_rank:02d}_{pp_rank:03d}_{ep_rank:03d}"


@dataclass(frozen=True)
class McoreMeta:
    tp: int
    pp: int
    padded_vocab: int
    model_type: str
    spec: ModelSpec
    hf_config: dict[str, Any]
    ep: int = 1
    etp: int | None = None  # expert TP apart from tp; None: experts split like the dense weights

    def shard_dir(self, tp_rank: int, pp_rank: int, ep_rank: int = 0, *, expert: bool = False) -> str:
        """The directory holding TP shard `tp_rank` (an expert's: expert TP shard) of a stage."""
        if self.etp is None:
            return shard_dir_name(tp_rank, pp_rank, ep_rank if self.ep > 1 else None)
        return expert_dir_name(tp_rank, pp_rank, ep_rank) if expert else shard_dir_name(tp_rank, pp_rank)

    def split(self, expert: bool) -> int:
        """How many TP shards a parameter is stored in."""
        return self.etp if expert and self.etp is not None else self.tp

    def write(self, directory: Path) -> None:
        record = {"format": FORMAT, **asdict(self)}
        if self.etp is None:  # a directory without expert TP reads as before
            del record["etp"]
        (directory / META_NAME).write_text(json.dumps(record, indent=2, sort_keys=True))

    @classmethod
    def read(cls, directory: str | Path) -> McoreMeta:
        path = Path(directory) / META_NAME
        if not path.exists():
            raise FileNotFoundError(f"{directory} is not an rl3d Megatron weight directory (no {META_NAME})")
        record = json.loads(path.read_text())
        if record.pop("format", None) != FORMAT:
            raise ValueError(f"{path}: unknown format, expected {FORMAT}")
        record["spec"] = ModelSpec(**record["spec"])
        return cls(**record)


@contextlib.contextmanager
def atomic_output(dst: Path) -> Iterator[Path]:
    """A fresh temporary directory next to `dst` that replaces it only when the block succeeds.

    On any error the temporary directory is removed and an existing `dst` is left exactly as
    it was: a failed conversion never leaves a half-written directory that looks complete.
    """
    dst = Path(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(f".{dst.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = dst.with_name(f".{dst.name}.old-{os.getpid()}")
    if dst.exists():
        os.replace(dst, old)
    os.replace(tmp, dst)
    shutil.rmtree(old, ignore_errors=True)


def _stage_of(spec: ModelSpec, p: int, ep: int = 1) -> dict[str, list[tuple[int, int, str]]]:
    """Global name -> every (pp_rank, ep_rank, rank-local name) holding it: one place for an
    expert, each EP rank of its stage for any other parameter."""
    out: dict[str, list[tuple[int, int, str]]] = {}
    for pp_rank in range(p):
        for ep_rank in range(ep):
            for global_name, local in stage_param_names(spec, p, pp_rank, ep=ep, ep_rank=ep_rank).items():
                out.setdefault(global_name, []).append((pp_rank, ep_rank, local))
    return out


def check_layout(spec: ModelSpec, *, tp: int, pp: int, ep: int = 1, etp: int | None = None) -> None:
    """A ValueError unless (tp, pp, ep, etp) shards `spec`."""
    if etp is not None and (not spec.is_moe or tp % etp or spec.moe_ffn_hidden_size % etp):
        raise ValueError(
            f"etp={etp} must divide tp={tp} and the experts' width ({spec.moe_ffn_hidden_size}) "
            f"of a mixture of experts ({spec.name})"
        )
    layers_per_stage(spec, pp)
    ffn = spec.moe_ffn_hidden_size if spec.is_moe else spec.ffn_hidden_size
    if spec.num_query_groups % tp or ffn % tp or spec.shared_expert_ffn_hidden_size % tp:
        raise ValueError(f"tp={tp} must divide the KV heads ({spec.num_query_groups}) and the ffn size")
    if ep > 1 and not spec.is_moe:
        raise ValueError(f"ep={ep}: {spec.name} is dense (no experts to split); use ep=1")
    if spec.is_moe and spec.num_experts % ep:
        raise ValueError(f"ep={ep} must divide the number of experts ({spec.num_experts})")


def _meta_tensor(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="meta")


def hf_to_mcore(
    src: str | Path, dst: str | Path, *, tp: int, pp: int, ep: int = 1, etp: int | None = None
) -> McoreMeta:
    """Convert an HF directory (config.json + safetensors) into Megatron weights for (tp, pp,
    ep) with the experts split over `etp` (None: tp)."""
    src, dst = Path(src), Path(dst)
    try:
        hf_config = json.loads((src / "config.json").read_text())
    except ValueError as err:
        raise ValueError(f"{src / 'config.json'}: not valid JSON ({err})") from None
    spec = spec_from_hf_config(hf_config)
    etp = None if etp == tp else etp
    check_layout(spec, tp=tp, pp=pp, ep=ep, etp=etp)
    meta = McoreMeta(
        tp,
        pp,
        padded_vocab_size(spec.vocab_size, tp),
        hf_config["model_type"],
        spec,
        hf_config,
        ep=ep,
        etp=etp,
    )
    maps = tensor_maps(spec, meta.padded_vocab)
    stages = _stage_of(spec, pp, ep)
    with atomic_output(dst) as out:
        _write_mcore(src, out, meta, maps, stages)
    logger.info("wrote %s: %s as tp=%d pp=%d ep=%d", dst, spec.name, tp, pp, ep)
    return meta


def _write_mcore(src: Path, dst: Path, meta: McoreMeta, maps: list[TensorMap], stages: dict) -> None:
    spec = meta.spec
    experts = {p.name for p in megatron_params(spec) if p.expert is not None}

    def places(name: str):  # (directory, local name, TP rank, TP size) of every stored shard
        expert = name in experts
        size = meta.split(expert)
        for pp_rank, ep_rank, local in stages[name]:
            if meta.etp is not None and not expert and ep_rank:  # dense: once, not per EP rank
                continue
            for r in range(size):
                yield meta.shard_dir(r, pp_rank, ep_rank, expert=expert), local, r, size

    with ShardedReader(src) as reader:
        plans: dict[str, list] = {}
        for tmap in maps:
            full = _meta_tensor(tmap.shape, reader.dtype(tmap.hf[0]))
            for where, local, r, size in places(tmap.mcore):
                shard = shard_for_tp(full, tmap.kind, size, r)
                plans.setdefault(where, []).append((local, shard.dtype, tuple(shard.shape)))
        writers = {
            where: StreamingWriter(dst / where / "model.safetensors", plan) for where, plan in plans.items()
        }
        for tmap in maps:
            tensors = [reader.get(name) for name in tmap.hf]
            try:
                full = tmap.to_mcore(tensors)
                for where, local, r, size in places(tmap.mcore):
                    writers[where].write(local, shard_for_tp(full, tmap.kind, size, r))
            except (RuntimeError, AssertionError) as err:  # a tensor of the wrong shape or dtype
                shapes = ", ".join(f"{n} {tuple(t.shape)}" for n, t in zip(tmap.hf, tensors))
                raise ValueError(f"{src}: tensor {shapes}: does not fit {spec.name}'s {tmap.mcore}") from err
            del full
        for writer in writers.values():
            writer.close()
    copy_extras(src, dst / HF_EXTRA)
    meta.write(dst)


def copy_extras(src: Path, dst: Path) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    for path in src.iterdir():
        if path.is_file() and not path.name.endswith(_WEIGHT_SUFFIXES):
            shutil.copy2(path, dst / path.name)


class McoreReader:
    """Full (t=1) or resharded tensors by global name from a Megatron weight directory."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        self.meta = McoreMeta.read(directory)
        self._stages = _stage_of(self.meta.spec, self.meta.pp, self.meta.ep)
        self._kinds = {m.mcore: m.kind for m in tensor_maps(self.meta.spec, self.meta.padded_vocab)}
        self._experts = {p.name for p in megatron_params(self.meta.spec) if p.expert is not None}
        self._readers: dict[str, ShardedReader] = {}

    def _file(self, name: str, tp_rank: int) -> tuple[ShardedReader, str]:
        """(reader of the file holding TP shard `tp_rank` of `name`, its local name there)."""
        pp_rank, ep_rank, local = self._stages[name][0]
        where = self.meta.shard_dir(tp_rank, pp_rank, ep_rank, expert=name in self._experts)
        if where not in self._readers:
            self._readers[where] = ShardedReader(self.directory / where)
        return self._readers[where], local

    def _get(self, name: str, tp_rank: int) -> torch.Tensor:
        reader, local = self._file(name, tp_rank)
        return reader.get(local)

    def dtype(self, name: str) -> torch.dtype:
        reader, local = self._file(name, 0)
        return reader.dtype(local)

    def full(self, name: str) -> torch.Tensor:
        shards = [self._get(name, r) for r in range(self.meta.split(name in self._experts))]
        return merge_tp_shards(shards, self._kinds[name])

    def shard(self, name: str, tp: int, tp_rank: int, padded_vocab: int) -> torch.Tensor:
        if tp == self.meta.split(name in self._experts) and padded_vocab == self.meta.padded_vocab:
            return self._get(name, tp_rank)  # only this rank's file is read
        full = self.full(name)
        if name in _VOCAB_PARAMS:
            full = _repad(full, self.meta.spec.vocab_size, padded_vocab)
        return shard_for_tp(full, self._kinds[name], tp, tp_rank)

    def close(self) -> None:
        for reader in self._readers.values():
            reader.close()

    def __enter__(self) -> McoreReader:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _repad(full: torch.Tensor, vocab: int, padded: int) -> torch.Tensor:
    assert padded >= vocab, (padded, vocab)
    out = full.new_zeros(padded, *full.shape[1:])
    out[:vocab] = full[:vocab]
    return out


def mcore_to_hf(src: str | Path, dst: str | Path, *, max_shard_bytes: int = 5 * 2**30) -> Path:
    """Convert a Megatron weight directory into an HF directory `transformers` loads."""
    with atomic_output(Path(dst)) as out:
        names = _write_hf(Path(src), out, max_shard_bytes)
    logger.info("wrote HF directory %s (%d files)", dst, len(names))
    return Path(dst)


def _write_hf(src: Path, dst: Path, max_shard_bytes: int) -> list[str]:
    with McoreReader(src) as reader:
        meta = reader.meta
        names = write_hf_weights(reader, meta.spec, meta.padded_vocab, dst, max_shard_bytes)
    extra = Path(src) / HF_EXTRA
    for path in extra.iterdir() if extra.exists() else []:
        shutil.copy2(path, dst / path.name)
    if not (dst / "config.json").exists():
        (dst / "config.json").write_text(json.dumps(meta.hf_config, indent=2))
    return names


def write_hf_weights(
    reader: Any, spec: ModelSpec, padded_vocab: int, dst: Path, max_shard_bytes: int
) -> list[str]:
    """Write the HF safetensors files (sharded, with an index, past `max_shard_bytes`) of the
    model whose full Megatron tensors `reader` gives by global name (`reader.dtype(name)`,
    `reader.full(name)`: `McoreReader`, `rl3d.models.export.DistCheckpointReader`)."""
    maps = tensor_maps(spec, padded_vocab)
    plan = []
    for tmap in maps:
        full = _meta_tensor(tmap.shape, reader.dtype(tmap.mcore))
        plan += [(n, t.dtype, tuple(t.shape)) for n, t in zip(tmap.hf, tmap.to_hf(full))]
    files = list(split_into_files(plan, max_shard_bytes))
    names = (
        ["model.safetensors"]
        if len(files) == 1
        else [f"model-{i + 1:05d}-of-{len(files):05d}.safetensors" for i in range(len(files))]
    )
    _write_hf_files(reader, maps, dst, names, files)
    return names


def _write_hf_files(
    reader: Any, maps: list[TensorMap], dst: Path, names: list[str], files: list[list]
) -> None:
    file_of = {item[0]: i for i, group in enumerate(files) for item in group}
    writers = [StreamingWriter(dst / name, group) for name, group in zip(names, files)]
    for tmap in maps:
        for hf_name, tensor in zip(tmap.hf, tmap.to_hf(reader.full(tmap.mcore))):
            writers[file_of[hf_name]].write(hf_name, tensor)
    for writer in writers:
        writer.close()
    if len(names) > 1:
        index = {
            "metadata": {"total_size": sum((dst / n).stat().st_size for n in names)},
            "weight_map": {hf_name: names[i] for hf_name, i in file_of.items()},
        }
        (dst / INDEX_NAME).write_text(json.dumps(index, indent=2))
