"""KernelConfig: the kernel and fusion choices still worth a switch, built once at engine start
and passed down (runner -> model -> layers -> launchers), never read from a module global.

Each choice comes from `EngineConfig(kernels={...})`, else the `GLASSBOX_*` environment variable
(read when an engine is built, not at import), else the default. TP workers receive rank 0's
object. Choices bench/RESULTS.md settled are not here: the winner is the only code.
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path

from .errors import InvalidArgumentError

_TRUE, _FALSE = ("1", "true", "on", "yes"), ("0", "false", "off", "no")


def _choice(env: str, why: str, parse) -> dict:
    return {"env": env, "why": why, "parse": parse}


def _parse_bool(value) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in _TRUE + _FALSE:
        return value.strip().lower() in _TRUE
    raise ValueError("must be true or false (or one of '1', '0', 'on', 'off')")


def _parse_caps(value) -> tuple[int, ...]:
    if isinstance(value, str):
        value = [c.strip() for c in value.split(",") if c.strip()]
    if not isinstance(value, (list, tuple)):
        raise ValueError("must be a list of positive token counts, e.g. [256, 512] or '256,512' "
                         "(empty: no bounded graphs)")
    caps = []
    for c in value:
        n = int(c) if (isinstance(c, int) and not isinstance(c, bool)) or \
            (isinstance(c, str) and c.isdigit()) else 0
        if n < 1:
            raise ValueError(f"must hold positive token counts; {c!r} is not one")
        caps.append(n)
    return tuple(sorted(set(caps)))     # context_caps keeps the largest bound per split count


def _parse_count(value) -> int:
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value.strip())
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError("must be a whole number >= 0")
    return value


def _parse_dir(value) -> str | None:
    if value is None or value == "":
        return None
    if not isinstance(value, (str, os.PathLike)):
        raise ValueError("must be a directory path (or None for engine/kernels/configs/)")
    if not Path(value).is_dir():
        raise ValueError(f"{os.fspath(value)!r} is not a directory (bench/tune_moe.py --out-dir "
                         "writes one)")
    return os.fspath(value)


@dataclass(frozen=True)
class KernelConfig:
    pdl: bool = field(default=True, metadata=_choice(
        "GLASSBOX_PDL", "programmatic dependent launch on Hopper+; off to rule out a cross-kernel "
        "race when debugging a kernel (batch-1 decode 1,203 -> 974 tok/s without it)", _parse_bool))
    prefill_graphs: bool = field(default=True, metadata=_choice(
        "GLASSBOX_PREFILL_GRAPHS", "CUDA graphs for short prefills (TTFT 19.5 -> 5.4 ms at 1,024 "
        "tokens); off saves their capture time and memory, or isolates a graph bug", _parse_bool))
    attn_context_caps: tuple[int, ...] = field(default=(256, 512, 1024, 2048), metadata=_choice(
        "GLASSBOX_ATTN_CONTEXT_CAPS", "context bounds small decode buckets also capture graphs at "
        "(fewer attention splits at short contexts); each bound is more graphs to capture and "
        "hold, () none", _parse_caps))
    cascade_min_saved_tokens: int = field(default=8192, metadata=_choice(
        "GLASSBOX_CASCADE_MIN_SAVED_TOKENS", "cascade attention (engine/cascade.py) runs a decode "
        "step whose rows share prefix blocks when it saves this many token reads per KV head "
        "and layer: ~8k tokens' K/V is the cost of its extra launch; 0 turns it off",
        _parse_count))
    moe_config_dir: str | None = field(default=None, metadata=_choice(
        "GLASSBOX_MOE_CONFIG_DIR", "where the tuned MoE launch tables are read (None: "
        "engine/kernels/configs/); a table from bench/tune_moe.py can be tried without copying "
        "it into the source tree", _parse_dir))

    def __post_init__(self):
        # KernelConfig(...) built by hand (tests, benches) is checked like an override
        for f in fields(self):
            value = getattr(self, f.name)
            try:
                parsed = f.metadata["parse"](value)
            except ValueError as exc:
                raise InvalidArgumentError(f"KernelConfig.{f.name}={value!r}: {exc}",
                                           f"kernels.{f.name}") from None
            object.__setattr__(self, f.name, parsed)

    @classmethod
    def build(cls, engine_config=None, environ: Mapping[str, str] = os.environ) -> "KernelConfig":
        """engine_config.kernels first, then `environ`'s GLASSBOX_* names, then the defaults."""
        overrides = cls.parse_overrides(getattr(engine_config, "kernels", None))
        values = {}
        for f in fields(cls):
            env = f.metadata["env"]
            if f.name in overrides:
                values[f.name] = overrides[f.name]
            elif env in environ:
                try:
                    values[f.name] = f.metadata["parse"](environ[env])
                except ValueError as exc:
                    raise InvalidArgumentError(f"environment {env}={environ[env]!r} (kernel choice "
                                               f"{f.name!r}): {exc}", env) from None
        return cls(**values)

    @classmethod
    def parse_overrides(cls, kernels: Mapping | None) -> dict:
        """EngineConfig.kernels checked and parsed: {name: value} for the names given."""
        if kernels is None:
            return {}
        if not isinstance(kernels, Mapping):
            raise InvalidArgumentError(f"kernels must be a dict of kernel choices, not "
                                       f"{type(kernels).__name__}; valid names: "
                                       f"{', '.join(cls.names())}", "kernels")
        known = {f.name: f for f in fields(cls)}
        out = {}
        for name, value in kernels.items():
            f = known.get(name)
            if f is None:
                raise InvalidArgumentError(f"kernels: {name!r} is not a kernel choice; valid "
                                           f"names: {', '.join(cls.names())}", "kernels")
            try:
                out[name] = f.metadata["parse"](value)
            except ValueError as exc:
                raise InvalidArgumentError(f"kernels[{name!r}]={value!r}: {exc}",
                                           f"kernels.{name}") from None
        return out

    @classmethod
    def names(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    def describe(self) -> list[dict]:
        """One row per choice: name, value, default, environment name, why it is a switch."""
        return [{"name": f.name, "value": getattr(self, f.name), "default": f.default,
                 "env": f.metadata["env"], "why": f.metadata["why"]} for f in fields(self)]


# what a layer or launcher built outside an engine (tests, benches) runs with: the defaults
DEFAULT_KERNELS = KernelConfig()
