"""What differs between the transformers versions the Hugging Face integration runs on, in one file.

Supported: transformers ``>= 5.6`` (:data:`TRANSFORMERS_FLOOR`, the lowest version the test matrix
runs; README, "Hugging Face transformers versions"). The rooms (``attention/``, ``encoders/``,
``cp/``) and ``trainer.py`` read the installed transformers through this module wherever versions
differ, and nothing else in the package looks at the version. A difference is detected by what
the installed version provides (an attribute, a keyword of a signature); only where the code
gives no such sign (the shape of what a method returns) does the version number decide, here.

What differs, newest first ("since": the first release with it; then what earlier releases get
from this module instead):

* Masks of packed sequences remap positions (``remap_positions_for_packed_sequence``), since 5.23.
  Earlier releases compose packed rows without a position map: positions are row indices, which
  equal the positions within each sequence (``attention/mask.py`` reads both forms).
* The Qwen2.5-Omni thinker keeps its towers on an inner ``model``, since 5.21. Earlier: on the
  thinker itself, whose ``get_decoder()`` returns the thinker (:func:`feature_owner`,
  :func:`language_model`).
* Forwards take encoder outputs computed outside the model (the ``mm_encoder_outputs`` keyword),
  since 5.18. Earlier: :func:`feeding_encoder_outputs` passes a one-element stand-in for the
  pixels, and the model's own ``get_image_features`` / ``get_video_features``, which the forward
  then calls, answer that one call with the outputs, in the form that release returns them.
* Qwen3-VL's ``get_image_features`` returns deepstack features per item, since 5.18. Earlier: one
  tensor per layer (:func:`feature_rows` reads both).
* Gemma 3's forward takes the loss keywords instead of averaging over the call itself, since
  5.17. Earlier: :func:`loss_takes_token_count` says it does not (balanced batches would change
  its training).
* Qwen3-VL(-MoE)'s and the Qwen2.5-Omni thinker's forwards pass their loss keywords
  (``num_items_in_batch``, ``shift_labels``) to the loss, since 5.17. Earlier:
  :func:`install_loss_keywords` hands them to the loss function.
* The Qwen2.5-Omni thinker's ``get_image_features`` returns features per item, since 5.15.
  Earlier: one tensor of every item's rows.
* ``TrainingArguments`` has ``dataloader_multiprocessing_context`` and ``dataloader_in_order``,
  since 5.15. Earlier: :func:`loader_options` leaves them out (the DataLoader's defaults).
* ``masking_utils.blockwise_overlay`` (bidirectional image blocks), since 5.9. Earlier: Gemma 3's,
  PaliGemma's and Gemma 4's own ``token_type_ids_mask_function``, read as the same piece
  (:func:`mask_pieces`).

Which model families exist in the oldest version is in the README's support table (every family
the integration lists is in transformers 5.6).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
from collections.abc import Iterator, Mapping
from typing import Any

import torch

__all__ = [
    "ENCODER_OUTPUTS",
    "FEEDS_ITSELF",
    "TRANSFORMERS_FLOOR",
    "feature_owner",
    "feature_rows",
    "forward_adds_video_newline",
    "feeding_encoder_outputs",
    "LOSS_KEYWORDS",
    "install_encoder_outputs_hook",
    "install_loss_keywords",
    "language_model",
    "loss_takes_token_count",
    "loader_options",
    "mask_pieces",
    "merges_one_slice_size",
    "remove_encoder_outputs_hook",
    "require_supported_transformers",
    "takes_encoder_outputs",
    "transformers_version",
]

#: the lowest transformers the integration supports (pyproject's ``hf`` extra says the same; the
#: test matrix runs it: ``make test``)
TRANSFORMERS_FLOOR = (5, 6)

#: the forward keyword that carries encoder outputs computed outside the model (transformers >= 5.18)
ENCODER_OUTPUTS = "mm_encoder_outputs"


def transformers_version() -> tuple[int, int, int]:
    """The installed transformers' ``(major, minor, patch)`` (pre-release tags ignored)."""
    import transformers

    parts = []
    for p in transformers.__version__.split(".")[:3]:
        digits = ""
        for ch in p:
            if not ch.isdigit():
                break
            digits += ch
        parts.append(int(digits or 0))
    while len(parts) < 3:
        parts.append(0)
    return parts[0], parts[1], parts[2]


def require_supported_transformers() -> None:
    """Raise ``ImportError`` naming the version found and the range supported when transformers is
    missing or older than :data:`TRANSFORMERS_FLOOR`."""
    try:
        import transformers
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(
            'mmbalance.integrations.hf needs transformers: pip install "mmbalance[hf]"'
        ) from exc
    if transformers_version()[:2] < TRANSFORMERS_FLOOR:
        floor = ".".join(map(str, TRANSFORMERS_FLOOR))
        raise ImportError(
            f"mmbalance.integrations.hf supports transformers >= {floor} (every release from {floor} to the "
            f"newest), found transformers {transformers.__version__}: pip install 'transformers>={floor}'"
        )


def _since(major: int, minor: int) -> bool:
    return transformers_version()[:2] >= (major, minor)


# ------------------------------------------------------------------------ encoder outputs
_TOWERS = ("visual", "vision_tower", "audio_tower", "vision_model")

# what each entry of ``mm_encoder_outputs`` replaces: the pixels' keyword of the forward and the
# model method that encodes them
_STREAMS = {
    "image": ("pixel_values", "get_image_features"),
    "video": ("pixel_values_videos", "get_video_features"),
}

# model classes whose get_*_features returned every item's rows concatenated into one tensor
# before a release (which split them per item)
# (the Qwen3-Omni thinker: one tensor in 5.10.4, per item in 5.16.1, taken as Qwen2.5-Omni's release)
_PER_ITEM_SINCE = {
    "Qwen2_5OmniThinkerForConditionalGeneration": (5, 15),
    "Qwen3OmniMoeThinkerForConditionalGeneration": (5, 15),
    # per item in 5.16.1 (5.10.4 concatenates; a release between that concatenates a tuple's rows
    # gets the same rows either way)
    "Gemma4Model": (5, 16),
}


def feature_owner(model) -> torch.nn.Module:
    """The module holding a multimodal model's towers and ``get_*_features``: the inner ``...Model``
    (``model.model``) where it has them, else the model itself (the base ``...Model`` classes, and
    the Qwen2.5-Omni thinker before transformers 5.21, which keeps its towers on itself)."""
    inner = getattr(model, "model", None)
    if isinstance(inner, torch.nn.Module) and any(t in inner._modules for t in _TOWERS):
        return inner
    return model


def language_model(model) -> torch.nn.Module:
    """The decoder of a (multimodal) model, its layers holding the language model's attention:
    ``get_decoder()``, or the text model inside the module it returns when that still holds towers
    (the Qwen2.5-Omni thinker before 5.21 returns itself)."""
    get = getattr(model, "get_decoder", None)
    decoder = get() if callable(get) else None
    if not isinstance(decoder, torch.nn.Module):
        decoder = model
    if any(t in decoder._modules for t in _TOWERS):
        for name in ("language_model", "model"):
            inner = decoder._modules.get(name)
            if isinstance(inner, torch.nn.Module) and not any(t in inner._modules for t in _TOWERS):
                return inner
    return decoder


@functools.cache
def _class_takes_encoder_outputs(cls: Any) -> bool:
    try:
        return ENCODER_OUTPUTS in inspect.signature(cls.forward).parameters
    except (TypeError, ValueError):  # pragma: no cover - a forward without a signature
        return False


def takes_encoder_outputs(model) -> bool:
    """Whether ``model``'s forward takes encoder outputs through ``mm_encoder_outputs``
    (transformers >= 5.18 for the families that have it)."""
    owner: Any = type(feature_owner(model))
    return _class_takes_encoder_outputs(owner)


def forward_adds_video_newline(model) -> bool:
    """Whether LLaVA-OneVision's forward appends each video's newline row to the features
    ``get_video_features`` returns (releases before ``mm_encoder_outputs``; since, the method
    returns the row itself)."""
    return not takes_encoder_outputs(model)


def feature_rows(features) -> torch.Tensor:
    """What ``get_*_features`` returns for several items (its ``pooler_output``, or one deepstack
    layer) as one tensor of rows: a tuple or list of per-item tensors (the form ``mm_encoder_outputs``
    takes) concatenated; one tensor (the form of older versions, see the table above) as it is."""
    if isinstance(features, (tuple, list)):
        return torch.cat(list(features)) if len(features) != 1 else features[0]
    return features


def _installed_form(owner, output):
    """``output`` (an ``mm_encoder_outputs`` entry: per-item ``pooler_output`` and deepstack
    layers) in the form this transformers' ``get_*_features`` returns for ``owner``."""
    per_item = True
    for cls in type(owner).__mro__:
        since = _PER_ITEM_SINCE.get(cls.__name__)
        if since is not None:
            per_item = _since(*since)
            break
    output = copy.copy(output)  # the caller's entry stays as it was
    pooled = output.pooler_output
    if not per_item and isinstance(pooled, (tuple, list)):
        output.pooler_output = torch.cat(list(pooled))
    deep = getattr(output, "deepstack_features", None)
    if deep is not None:  # before 5.18 (the only versions this runs on) one tensor per layer
        output.deepstack_features = [
            torch.cat(list(layer)) if isinstance(layer, (tuple, list)) else layer for layer in deep
        ]
    return output


def _answer(output):
    def get_features(*args, **kwargs):
        return output

    return get_features


@contextlib.contextmanager
def feeding_encoder_outputs(model, kwargs: dict) -> Iterator[dict]:
    """The forward keywords of ``model`` with ``mm_encoder_outputs`` in a form the installed
    transformers takes, for one call of the model's own forward inside the ``with`` block.

    Where the forward takes the keyword (transformers >= 5.18) the keywords are yielded unchanged.
    Before, every entry (``"image"``, ``"video"``) becomes a one-element stand-in for its pixels
    (``pixel_values``, ``pixel_values_videos``), and the model's ``get_image_features`` /
    ``get_video_features``, which the forward calls on those pixels, return the entry (in the
    form that version's method returns) until the block ends. Nothing else of the forward
    changes: the grids and placeholders place the rows as they place the model's own.

    Raises:
        ValueError: an entry for a stream the forward has no such method for, or pixels given
            beside their features.
    """
    mm = kwargs.get(ENCODER_OUTPUTS)
    if mm is None or takes_encoder_outputs(model):
        yield kwargs
        return
    if not isinstance(mm, Mapping):
        raise TypeError(f"{ENCODER_OUTPUTS} must be a dict of encoder outputs, got {type(mm).__name__}")
    call = dict(kwargs)
    del call[ENCODER_OUTPUTS]
    owner = feature_owner(model)
    answers: dict[str, Any] = {}
    for name, output in mm.items():
        if output is None:
            continue
        if name not in _STREAMS or not callable(getattr(owner, _STREAMS[name][1], None)):
            raise ValueError(
                f"{ENCODER_OUTPUTS}[{name!r}]: {type(owner).__name__} in transformers "
                f"{'.'.join(map(str, transformers_version()))} has no way to take these features"
            )
        pixels, method = _STREAMS[name]
        if call.get(pixels) is not None:
            raise ValueError(f"{pixels} and {ENCODER_OUTPUTS}[{name!r}] given together: give one of them")
        rows = output.pooler_output
        like = rows[0] if isinstance(rows, (tuple, list)) else rows
        call[pixels] = torch.zeros(1, dtype=like.dtype, device=like.device)
        answers[method] = _installed_form(owner, output)
    saved = {m: owner.__dict__[m] for m in answers if m in owner.__dict__}
    for m, output in answers.items():
        owner.__dict__[m] = _answer(output)
    try:
        yield call
    finally:
        for m in answers:
            if m in saved:
                owner.__dict__[m] = saved[m]
            else:
                owner.__dict__.pop(m, None)


#: a forward that calls :func:`feeding_encoder_outputs` itself (the encoder balancing's) sets this
#: attribute, so :func:`install_encoder_outputs_hook`'s hook leaves its keywords to it
FEEDS_ITSELF = "mmbalance_feeds_encoder_outputs"


_HOOK_ATTR = "_mmbalance_encoder_outputs_hook"


class _EncoderOutputsHook:
    """A forward pre-hook and forward hook pair on one module (see :func:`install_encoder_outputs_hook`)."""

    def __init__(self, module, model):
        self.module = module
        self.model = model
        self.active: list[contextlib.ExitStack] = []
        self.handles: list = []

    def attach(self) -> None:
        self.handles = [
            self.module.register_forward_pre_hook(self.before, with_kwargs=True),
            self.module.register_forward_hook(self.after, always_call=True),
        ]

    def remove(self) -> None:
        """Take the hooks off the module (idempotent)."""
        for h in self.handles:
            h.remove()
        self.handles = []
        if self.module.__dict__.get(_HOOK_ATTR) is self:
            del self.module.__dict__[_HOOK_ATTR]

    @torch.compiler.disable
    def before(self, module, args, kwargs):
        # (the model's own forward, not the hooked wrapper's, says whether it feeds them itself)
        if ENCODER_OUTPUTS not in kwargs or getattr(self.model.forward, FEEDS_ITSELF, False):
            self.active.append(contextlib.ExitStack())
            return None
        stack = contextlib.ExitStack()
        call = stack.enter_context(feeding_encoder_outputs(self.model, dict(kwargs)))
        self.active.append(stack)
        return args, call

    @torch.compiler.disable
    def after(self, module, args, output):
        if self.active:
            self.active.pop().close()
        return None


def install_encoder_outputs_hook(module, model=None):
    """Make calls of ``module`` (the model, or the wrapper users call, such as a peft model) that
    pass ``mm_encoder_outputs`` work on the installed transformers: on versions whose forward
    takes the keyword nothing is installed (``None`` is returned); before, a forward pre-hook runs
    :func:`feeding_encoder_outputs` for ``model`` (default: ``module``) and a forward hook ends it,
    also when the forward raises. Registered last, so it runs after the pre-hooks already on the
    module (those that put the features into the keywords); install it again after adding
    another. Returns the hook (``remove()`` takes it off); one per module (a second call moves it
    to the end)."""
    model = module if model is None else model
    old = module.__dict__.get(_HOOK_ATTR)
    if old is not None:
        old.remove()
    if takes_encoder_outputs(model):
        return None
    hook = _EncoderOutputsHook(module, model)
    hook.attach()
    module.__dict__[_HOOK_ATTR] = hook
    return hook


def remove_encoder_outputs_hook(module) -> None:
    """Take :func:`install_encoder_outputs_hook`'s hook off ``module`` (idempotent)."""
    hook = module.__dict__.get(_HOOK_ATTR)
    if hook is not None:
        hook.remove()


# ------------------------------------------------------------------------------- loss
#: the forward keywords of a causal-LM loss that a step's batching decides (the global count of
#: labelled tokens, the labels shifted on whole sequences before a context-parallel split)
LOSS_KEYWORDS = ("num_items_in_batch", "shift_labels")


class _LossKeywords:
    """The pre-hook that records a call's loss keywords and the loss function that adds them."""

    def __init__(self, model, module):
        self.model = model
        self.module = module
        self.calls: list[dict] = []
        self.had = "_loss_function" in model.__dict__
        self.old = model.__dict__.get("_loss_function")
        self.stock = model.loss_function
        self.handles: list = []
        self.users = 1  # who installed it (a CP handle, balance_trainer): removed when the last is done

    def attach(self) -> None:
        self.handles = [
            self.module.register_forward_pre_hook(self.before, with_kwargs=True),
            self.module.register_forward_hook(self.after, always_call=True),
        ]
        self.model.loss_function = self.loss

    def remove(self) -> None:
        """One installer is done with it; the last restores the model's loss function and takes the
        hooks off (idempotent per installer)."""
        self.users -= 1
        if self.users > 0:
            return
        for h in self.handles:
            h.remove()
        self.handles = []
        if self.model.__dict__.get(_LOSS_ATTR) is self:
            del self.model.__dict__[_LOSS_ATTR]
            if self.had:
                self.model.__dict__["_loss_function"] = self.old
            else:
                self.model.__dict__.pop("_loss_function", None)

    @torch.compiler.disable
    def before(self, module, args, kwargs):
        self.calls.append({k: kwargs[k] for k in LOSS_KEYWORDS if kwargs.get(k) is not None})

    @torch.compiler.disable
    def after(self, module, args, output):
        if self.calls:
            self.calls.pop()

    @torch.compiler.disable
    def loss(self, *args, **kwargs):
        for key, value in (self.calls[-1] if self.calls else {}).items():
            kwargs.setdefault(key, value)
        return self.stock(*args, **kwargs)


_LOSS_ATTR = "_mmbalance_loss_keywords"

# model classes whose forward calls its loss without the forward's keywords, before a release
_LOSS_WITHOUT_KEYWORDS_UNTIL = {
    "Qwen3VLForConditionalGeneration": (5, 17),
    "Qwen3VLMoeForConditionalGeneration": (5, 17),
    "Qwen2_5OmniThinkerForConditionalGeneration": (5, 17),
    # the Qwen3-Omni-MoE thinker: no keywords in 5.16.1, passed in 5.19.0 (taken as Qwen3-VL's release)
    "Qwen3OmniMoeThinkerForConditionalGeneration": (5, 17),
    "Qwen3_5ForConditionalGeneration": (5, 17),
    "Qwen3_5MoeForConditionalGeneration": (5, 17),
    # GLM-4.1V, GLM-4.5V, GLM-4.6V: no keywords in 5.16.1, passed in 5.19.0 (taken as Qwen3-VL's release)
    "Glm4vForConditionalGeneration": (5, 17),
    "Glm4vMoeForConditionalGeneration": (5, 17),
    "Glm46VForConditionalGeneration": (5, 17),
    # MiniCPM-V 4.6: no keywords in 5.10.4 and 5.16.1, passed in 5.19.0 (4.7 passes them from its first)
    "MiniCPMV4_6ForConditionalGeneration": (5, 17),
    # Ernie-4.5-VL: no keywords in 5.6.0 to 5.16.1, passed in 5.19.0
    "Ernie4_5_VLMoeForConditionalGeneration": (5, 17),
}


def merges_one_slice_size(tower) -> bool:
    """Whether a MiniCPM-V tower's window merger reads every slice's grid from the call's first one
    (transformers 5.16's vectorised merge, which assumes the slices of a call share one size: others
    fail, or with the same patch count are merged on the wrong grid); 5.10 and 5.19 on merge slice
    by slice. Read from the merger's source."""
    merger = getattr(tower, "vit_merger", None)
    return merger is not None and _merges_one_size(type(merger).forward)


@functools.cache
def _merges_one_size(forward: Any) -> bool:
    try:
        src = inspect.getsource(forward)
    except (OSError, TypeError):
        return False
    return "get_vision_merged_shape" in src or "seq_per_img" in src


def _drops_loss_keywords(model) -> bool:
    for cls in type(model).__mro__:
        until = _LOSS_WITHOUT_KEYWORDS_UNTIL.get(cls.__name__)
        if until is not None:
            return not _since(*until)
    return False


# model classes that compute their loss as a mean over the call themselves (nn.CrossEntropyLoss),
# until a release (None: every release); their ``accepts_loss_kwargs`` flag says nothing reliable
# (Qwen3-VL sets it False and passes the count on from 5.17)
_LOSS_MEAN_PER_CALL_UNTIL = {
    "Qwen2AudioForConditionalGeneration": None,
    "Gemma3ForConditionalGeneration": (5, 17),
}


def loss_takes_token_count(model) -> bool:
    """Whether ``model``'s loss can be the sum of its token losses over a count it is given
    (``num_items_in_batch``): its forward takes ``**kwargs``, and the installed release's forward
    does not compute a mean over the call itself (Qwen2-Audio on every release, Gemma 3 before
    5.17). Where a release's forward drops the keywords, :func:`install_loss_keywords` hands them
    on."""
    cls = type(model)
    for c in cls.__mro__:
        if c.__name__ in _LOSS_MEAN_PER_CALL_UNTIL:
            until = _LOSS_MEAN_PER_CALL_UNTIL[c.__name__]
            if until is None or not _since(*until):
                return False
            break
    try:
        params = inspect.signature(cls.forward).parameters.values()
    except (TypeError, ValueError):  # pragma: no cover - a forward without a signature
        return False
    return any(p.kind is p.VAR_KEYWORD for p in params)


def install_loss_keywords(model, module=None):
    """Make ``model``'s loss see the loss keywords its forward was called with (``num_items_in_batch``,
    ``shift_labels``) where the installed release's forward does not pass them on (Qwen3-VL,
    Qwen3-VL-MoE, Qwen3.5, Qwen3.5-MoE, GLM-4.xV and the Qwen2.5-Omni and Qwen3-Omni-MoE thinkers
    before 5.17 call their loss with the logits and labels alone, so a step's global token count
    and the labels shifted on whole sequences were lost): the loss function then takes them from the call, read by hooks on ``module`` (the
    module the loop calls, default ``model``; a peft wrapper calls the model's forward past its
    hooks). Returns the installed object (``remove()``; one per model), or ``None`` where the
    forward passes them itself (nothing is installed). Installing it again returns the same object
    with one more user: each ``remove()`` ends one, the last takes it off."""
    if not hasattr(type(model), "loss_function") or not _drops_loss_keywords(model):
        return None
    old = model.__dict__.get(_LOSS_ATTR)
    if old is not None:
        old.users += 1
        return old
    hook = _LossKeywords(model, model if module is None else module)
    hook.attach()
    model.__dict__[_LOSS_ATTR] = hook
    return hook


# ------------------------------------------------------------------------------ masks
def mask_pieces() -> dict[Any, tuple[str, dict[str, str]]]:
    """The mask-function pieces of the installed transformers: ``{code object: (kind, cells)}``,
    ``cells`` renaming a piece's closure variables to the names the mask parser reads (closures of
    one factory share one code object). Kinds: ``causal``, ``bidirectional``, ``and``, ``or``,
    ``sliding``, ``sliding_bidirectional``, ``chunked``, ``padding``, ``packed``, ``remap`` (5.23+),
    ``offsets``, ``blockwise`` (``masking_utils.blockwise_overlay``, or the models' own
    ``token_type_ids_mask_function`` of the versions before it)."""
    from transformers import masking_utils as mu

    t = torch.zeros(1, 1, dtype=torch.long)
    pieces: dict[Any, tuple[str, dict[str, str]]] = {}

    def add(fn, kind: str, cells: dict[str, str] | None = None) -> None:
        pieces[fn.__code__] = (kind, cells or {})

    add(mu.causal_mask_function, "causal")
    add(mu.bidirectional_mask_function, "bidirectional")
    add(mu.and_masks(mu.causal_mask_function), "and")
    add(mu.or_masks(mu.causal_mask_function), "or")
    add(mu.sliding_window_overlay(1), "sliding")
    add(mu.chunked_overlay(1, t[0]), "chunked")
    add(mu.padding_mask_function(t), "padding")
    add(mu.packed_sequence_mask_function(t), "packed")
    add(mu.add_offsets_to_mask_function(mu.causal_mask_function, 0, 0), "offsets")
    if hasattr(mu, "sliding_window_bidirectional_overlay"):
        add(mu.sliding_window_bidirectional_overlay(1), "sliding_bidirectional")
    if hasattr(mu, "remap_positions_for_packed_sequence"):
        add(mu.remap_positions_for_packed_sequence(mu.causal_mask_function, t), "remap")
    if hasattr(mu, "blockwise_overlay"):
        add(mu.blockwise_overlay(t), "blockwise")
    else:  # the same overlay, defined by each model that used it
        from transformers.models.gemma3 import modeling_gemma3
        from transformers.models.gemma4 import modeling_gemma4
        from transformers.models.paligemma import modeling_paligemma

        for module in (modeling_gemma3, modeling_paligemma, modeling_gemma4):
            fn = getattr(module, "token_type_ids_mask_function", None)
            if fn is None:
                continue
            if len(inspect.signature(fn).parameters) == 2:  # Gemma 4's (token_type_ids, image_group_ids)
                add(fn(t, t), "blockwise", {"image_group_ids": "block_sequence_ids"})
            else:
                add(fn(t), "blockwise", {"group_ids": "block_sequence_ids"})
    return pieces


# ------------------------------------------------------------------------------ Trainer
_LOADER_ARGUMENTS = {
    "multiprocessing_context": "dataloader_multiprocessing_context",
    "in_order": "dataloader_in_order",
}


def loader_options(args) -> dict[str, Any]:
    """The ``DataLoader`` keywords set by ``TrainingArguments`` fields that not every supported
    version has (``multiprocessing_context``, ``in_order``: 5.15+); absent fields are left out
    (the DataLoader's defaults, as those versions' Trainer leaves them)."""
    return {key: getattr(args, field) for key, field in _LOADER_ARGUMENTS.items() if hasattr(args, field)}
