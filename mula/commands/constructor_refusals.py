"""A sentence that a class named by a recipe raises while the CLI builds it reaches the user as that sentence.

jsonargparse builds the classes a recipe names (the strategy, callbacks, loggers, ...) while it
instantiates the parsed configuration. A class whose type is a Union (the Trainer's `strategy: str |
Strategy`, its `callbacks`) is tried against every member of the Union, and a constructor's
`ValueError` then arrives wrapped in "Does not validate against any of the Union subtypes ...", followed
by a dump of the whole namespace: hundreds of characters around the one sentence that matters.

`constructor_refusals()` records the first `ValueError` / `FileNotFoundError` a constructor raises
(through jsonargparse's public `add_instantiator`, registered once per process for every class, at the
lowest precedence, so Lightning's own instantiators of the model and data module still apply) and, when
instantiation then fails with an error that carries that sentence, raises that sentence instead, headed
by the class's name, which `mula.commands.entry.report_bad_input` prints as `mula: error: <Class>: <sentence>`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

# the refusals recorded inside the current `constructor_refusals()` block (None outside one)
_REFUSALS: ContextVar[list[tuple[type, Exception]] | None] = ContextVar(
    "mula_constructor_refusals", default=None
)
_registered = False


def _instantiate_recording_refusals(class_type: type, *args: Any, **kwargs: Any) -> Any:
    """jsonargparse's default instantiation (`class_type(*args, **kwargs)`), remembering a refusal."""
    try:
        return class_type(*args, **kwargs)
    except (ValueError, FileNotFoundError) as refusal:
        recorded = _REFUSALS.get()
        if recorded is not None:
            recorded.append((class_type, refusal))
        raise


def _register() -> None:
    global _registered
    if not _registered:
        from jsonargparse import add_instantiator

        add_instantiator(_instantiate_recording_refusals, object, subclasses=True)
        _registered = True


@contextmanager
def constructor_refusals() -> Iterator[None]:
    """Within the block, a `ValueError` that wraps a constructor's refusal is replaced by the refusal's
    sentence, headed by the refusing class's name.

    Only an error whose text contains the refusal's sentence is replaced, so a constructor that failed
    for one member of a Union while another member was taken leaves later, unrelated errors alone.
    """
    _register()
    token = _REFUSALS.set([])
    try:
        yield
    except ValueError as wrapped:
        for class_type, refusal in _REFUSALS.get() or []:
            sentence = str(refusal)
            if sentence and sentence in str(wrapped):
                raise type(refusal)(f"{class_type.__name__}: {sentence}") from wrapped
        raise
    finally:
        _REFUSALS.reset(token)
