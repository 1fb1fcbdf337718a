"""Strict, llama-swap compatible configuration.

A YAML file is decoded into raw msgspec Structs shaped like the file (`raw`,
camelCase keys, checked by `checks`), then resolved (`resolution`) into the
`Config`/`ModelConfig` of `resolved`: macros expanded (`macros`), ports
assigned, defaults merged. Resolution has a module per part: `models`,
`routers` (with `matrix`), `peers`, `api_keys`, `scheduling`, and `values`
(plain checks of one value); priority settings read with `app.core.priority`'s
grammar. The modules import one another one way only.

Every problem is collected before failing, so a user
fixes a config in one pass; llama-swap keys that mean nothing to a
one-model-at-a-time scheduler load with a warning instead of an error, so an
existing llama-swap config keeps working. `commands` is `gpulane check-config`.
"""

from __future__ import annotations

from app.config.loading import ConfigError, load_config, parse_config
from app.config.resolved import Config, ModelConfig

__all__ = ["Config", "ConfigError", "ModelConfig", "load_config", "parse_config"]
