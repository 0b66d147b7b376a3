"""Model techniques as features: each technique is one object with the same few hooks, and the
engine (`rl3d.engine.MegatronEngine`) applies the ones a role has, in the order of one table
(`rl3d.engine.techniques.TECHNIQUES`); no worker asks which are on.

The hooks, each a no-op on `Feature`:

- `model_options(engine)`: keyword arguments for `rl3d.models.builder.build_gpt` (the builder's
  own switches, or overrides of megatron's TransformerConfig);
- `ddp_options(engine)`: keyword arguments for `rl3d.models.training.wrap_ddp` (megatron's
  DistributedDataParallelConfig) of a trained role;
- `attach(engine)`: once the model holds its initial weights, before DDP wraps it;
- `ready(engine)`: once the optimizer exists (or would: a forward-only role calls it too);
- `session(batch, record=...)`: a context around the forwards over one batch, yielding the batch
  those forwards run on;
- `around_forward(micro, lead=..., trail=...)`: a context around one micro-batch's forward
  (`lead`/`trail`: pad tokens added in front of / behind its real ones);
- `before_update()` and `after_update(batch)`: around the optimizer steps of one update; the
  latter returns metrics (collective over the role's ranks; kept on the last pipeline stage);
- `footprint(plain)`: the role's `Footprint` (the memory plan's inputs for it: its largest
  micro-batch, what goes to the host while the rollout engine generates, the adapters it trains)
  as this technique changes it; the memory plan (`rl3d.planning`) asks the very features the
  engine builds, so that the plan and the run agree on what is on.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

from rl3d.config.lora import LoraConfig
from rl3d.costs.micro_batch import MicroBatchShape
from rl3d.models.spec import ModelSpec
from rl3d.single_controller.batch import DataBatch

F = TypeVar("F", bound="Feature")


@dataclass(frozen=True)
class FeatureSource:
    """What a role's features are built from: its recipe section (None: a padded role with no
    technique on) and that section's key (`actor`, `reward.model`: errors name its settings),
    the model, the TP size, and the settings kept outside the section."""

    key: str
    section: Any
    spec: ModelSpec
    tp: int
    lora: LoraConfig | None = None
    routing_replay: bool = False

    def setting(self, key: str, default: Any) -> Any:
        """The section's `key` (`default` where the section has no such key, or is None)."""
        return getattr(self.section, key, default)


@dataclass(frozen=True)
class Footprint:
    """What the memory plan counts for one role on one rank, as far as the role's techniques
    shape it: `batch`, its largest micro-batch; `offload`, the kinds it moves to the host while
    the rollout engine generates; `adapters`, the LoRA adapters it trains in place of its frozen
    base. `tp`, `cuda` and `transformer_engine` say where it runs: the TP size, a CUDA run or
    not, and whether that run has Transformer Engine."""

    batch: MicroBatchShape
    tp: int = 1
    cuda: bool = False
    transformer_engine: bool = True
    offload: tuple[str, ...] = ()
    adapters: LoraConfig | None = None


class Feature:
    """A model technique. Subclasses set `name` and override the hooks they need."""

    name = ""

    @classmethod
    def from_source(cls: type[F], source: FeatureSource) -> F | None:
        """This technique as `source` configures it; None where it is off."""
        raise NotImplementedError

    def model_options(self, engine: Any) -> dict[str, Any]:
        return {}

    def ddp_options(self, engine: Any) -> dict[str, Any]:
        return {}

    def attach(self, engine: Any) -> None:
        pass

    def ready(self, engine: Any) -> None:
        pass

    @contextlib.contextmanager
    def session(self, batch: DataBatch, *, record: bool = False) -> Iterator[DataBatch]:
        yield batch

    def around_forward(self, micro: DataBatch, *, lead: int, trail: int) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def before_update(self) -> None:
        pass

    def after_update(self, batch: DataBatch) -> dict[str, float]:
        return {}

    def footprint(self, plain: Footprint) -> Footprint:
        return plain


class Features:
    """The features of one role, in table order; each hook runs over all of them."""

    def __init__(self, items: Iterable[Feature] = ()):
        self.items = tuple(items)
        kinds = [type(f) for f in self.items]
        assert len(set(kinds)) == len(kinds), f"a technique twice: {[f.name for f in self.items]}"

    def get(self, kind: type[F]) -> F | None:
        """The feature of `kind`, None where the role does not have it."""
        return next((f for f in self.items if isinstance(f, kind)), None)

    def __repr__(self) -> str:
        return f"Features({', '.join(f.name for f in self.items) or 'none'})"

    def model_options(self, engine: Any) -> dict[str, Any]:
        options: dict[str, Any] = {}
        for feature in self.items:
            mine = feature.model_options(engine)
            clash = {k for k in mine.keys() & options.keys() if mine[k] != options[k]}
            assert not clash, f"{feature.name} sets {sorted(clash)} another feature set otherwise"
            options |= mine
        return options

    def ddp_options(self, engine: Any) -> dict[str, Any]:
        options: dict[str, Any] = {}
        for feature in self.items:
            options |= feature.ddp_options(engine)
        return options

    def attach(self, engine: Any) -> None:
        for feature in self.items:
            feature.attach(engine)

    def ready(self, engine: Any) -> None:
        for feature in self.items:
            feature.ready(engine)

    @contextlib.contextmanager
    def session(self, batch: DataBatch, *, record: bool = False) -> Iterator[DataBatch]:
        with contextlib.ExitStack() as stack:
            for feature in self.items:
                batch = stack.enter_context(feature.session(batch, record=record))
            yield batch

    @contextlib.contextmanager
    def around_forward(self, micro: DataBatch, *, lead: int = 0, trail: int = 0) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for feature in self.items:
                stack.enter_context(feature.around_forward(micro, lead=lead, trail=trail))
            yield

    def before_update(self) -> None:
        for feature in self.items:
            feature.before_update()

    def after_update(self, batch: DataBatch) -> list[dict[str, float]]:
        """Every feature's metrics of the update (every rank of the role calls it)."""
        return [m for feature in self.items if (m := feature.after_update(batch))]

    def footprint(self, plain: Footprint) -> Footprint:
        """`plain` (the role without any technique) as each feature changes it, in table order."""
        footprint = plain
        for feature in self.items:
            footprint = feature.footprint(footprint)
        return footprint
