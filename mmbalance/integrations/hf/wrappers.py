"""The Hugging Face model inside the wrappers training code puts around it.

``apply_encoder_balance``, ``apply_dynamic_cp`` and ``balance_trainer`` act on the transformers
model itself: :func:`inner_model` finds it inside ``DistributedDataParallel`` (``.module``) and a
peft ``PeftModel`` (``get_base_model()``, LoRA's and every other tuner's), in any nesting. Hooks
that must run on every call go on the outermost module, the one the training loop calls (peft's
``LoraModel`` calls the inner model's ``forward`` directly, past its hooks). For anything else,
:func:`wrapper_hint` tells a refusal how to reach the model inside.
"""

from __future__ import annotations

import torch

__all__ = ["inner_model", "is_peft_model", "wrapper_hint"]


def is_peft_model(model) -> bool:
    """Whether ``model`` is a peft ``PeftModel`` (peft need not be installed)."""
    return any(c.__name__ == "PeftModel" and c.__module__.startswith("peft") for c in type(model).__mro__)


def inner_model(model):
    """The transformers model inside ``model``'s DistributedDataParallel and peft wrappers
    (``model`` itself when it is not wrapped)."""
    from torch.nn.parallel import DistributedDataParallel

    seen = 0
    while seen < 8:  # wrappers nest a few levels at most
        seen += 1
        if isinstance(model, DistributedDataParallel):
            model = model.module
        elif is_peft_model(model):
            model = model.get_base_model()
        else:
            return model
    return model


def wrapper_hint(model) -> str:
    """For a refusal of ``model``'s class: how to reach the model it wraps, when it looks like a
    wrapper (``" (... wraps a model: ...)"``), else ``""``."""
    if not isinstance(model, torch.nn.Module):
        return ""
    name = type(model).__name__
    if isinstance(getattr(model, "_orig_mod", None), torch.nn.Module):
        return (
            f" ({name} is torch.compile's wrapper of a {type(model._orig_mod).__name__}: apply to the model "
            "before compiling it, or pass model._orig_mod)"
        )
    inner = getattr(model, "module", None)
    if isinstance(inner, torch.nn.Module):
        return f" ({name} wraps a {type(inner).__name__}: pass model.module, or apply before wrapping)"
    base = getattr(model, "get_base_model", None)
    if callable(base):
        return f" ({name} wraps a model: pass model.get_base_model())"
    return ""
