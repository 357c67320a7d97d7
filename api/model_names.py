"""The ids a request may name the model by, as vLLM's `--served-model-name` defines them.

With served names, those (the first is the one /v1/models lists; vLLM's rule). Without, the
checkpoint's directory name, listed, and the argument the engine was started with, as given
(`serve /models/Qwen3-0.6B` answers to "/models/Qwen3-0.6B", vLLM's default id, and to
"Qwen3-0.6B"); a path is accepted but never listed: the server's directories are nobody's
business. Anything else is a 404."""
from __future__ import annotations


def served_names(llm, served_model_names=()) -> list[str]:
    """The accepted ids, the listed one first."""
    if served_model_names:
        return list(dict.fromkeys(served_model_names))
    names = [llm.model_name]
    given = getattr(getattr(llm, "config", None), "model", None)
    if given and str(given) not in names:
        names.append(str(given))
    return names


def listed_name(llm, served_model_names=()) -> str:
    """The id /v1/models lists: the first served name, else the checkpoint's name."""
    return served_names(llm, served_model_names)[0]


def hub_names(hub) -> tuple[str, ...]:
    """The served names a serving hub carries (`hub.served_model_names`, set by app.build_app or
    api.server.create_app); none on a hub that was given none."""
    return tuple(hub.served_model_names)


def check_names(names) -> tuple[str, ...]:
    """--served-model-name values, stripped; an empty one is a mistake worth naming."""
    out = tuple(str(n).strip() for n in names or ())
    if any(not n for n in out):
        raise ValueError("--served-model-name: a name is empty; pass one or more non-empty "
                         "names (the first is the one /v1/models lists)")
    return out
