"""Keys renamed since recipes were written with them: each still loads, as its new name, with a
warning naming the new key; a recipe that sets both is refused, naming the old one.

    algorithm.kl.placement -> algorithm.kl.apply_to   ("placement" is where generation runs)
"""

from __future__ import annotations

import logging
from typing import Any

from rl3d.config.errors import ConfigError

logger = logging.getLogger(__name__)

RENAMED = {"algorithm.kl.placement": "algorithm.kl.apply_to"}  # old -> new, same parent section


def adopt_renamed(data: dict[str, Any], sources: dict[str, str], source_of: Any) -> None:
    """Move every renamed key of `data` to its new name, in place; `sources` (dotted key -> the
    file that set it) follows, so later errors name the file."""
    for old, new in RENAMED.items():
        *parents, leaf = old.split(".")
        new_leaf = new.rsplit(".", 1)[1]
        node: Any = data
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        if not isinstance(node, dict) or leaf not in node:
            continue
        where = source_of(old)
        if new_leaf in node:
            raise ConfigError(
                f"the former name of {new}, which is set too: keep {new}", key=old, source=where
            )
        node[new_leaf] = node.pop(leaf)
        logger.warning("%s%s is deprecated: write %s", f"{where}: " if where else "", old, new)
        if old in sources:
            sources[new] = sources.pop(old)
