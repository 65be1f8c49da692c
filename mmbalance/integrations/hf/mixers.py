"""Token mixers other than softmax attention in a model's decoder, which the integration does not run.

Packing several sequences into one row and splitting a sequence over context-parallel ranks are
exact only where every layer that mixes tokens keeps the sequences apart and hands state across
the split. Softmax attention does so through ``mmbalance_varlen``; a recurrence or a convolution
over the sequence (Mamba and Mamba-2 mixers, Gated DeltaNet, Kimi Delta Attention, lightning and
other linear attention, short convolutions) does not see those boundaries, so a packed row's
sequences would read the state the previous one left and a split sequence would restart its state
at every split: a silently wrong loss. Such a model is refused by name instead:

* :func:`model_mixers` reads the instantiated decoder (any ``nn.Conv1d`` over the sequence, any
  module whose class is a known kind of mixer), for ``apply_dynamic_cp`` and the trainer's
  context parallelism, before anything moves;
* :func:`config_mixers` reads a layer's config (``layer_types`` entries that are not attention),
  and, where a config has no ``layer_types``, the classes its modeling module defines; the
  attention backend calls it at the first packed forward (``attention/backend.py``).
"""

from __future__ import annotations

import inspect
import re
import sys

import torch

__all__ = [
    "ATTENTION_TYPES",
    "MIXER_NAME",
    "PADDED_EXACT",
    "SequencesApart",
    "config_mixers",
    "describe_mixers",
    "keep_sequences_apart",
    "kept_apart",
    "mixers_refusal",
    "model_mixers",
    "unwrap_forward",
    "wrap_forward",
]

#: class names of decoder token mixers that are not softmax attention
MIXER_NAME = re.compile(
    r"(Mamba|Mixer|GatedDeltaNet|DeltaNet|DeltaAttention|ShortConv|ShortConvolution|LinearAttention|"
    r"LightningAttention|RecurrentBlock|Rglru|RGLRU|Rwkv|RWKV|xLSTM|Retention|Hyena|SSM)"
)
#: ``layer_types`` entries that are softmax attention (run by the attention backend)
ATTENTION_TYPES = {
    "full_attention",
    "sliding_attention",
    "chunked_attention",
    "attention",
    "global",
    "local",
}
_NOT_MIXING = {"mlp", "moe", "dense", "ffn", "mlp_only"}


def _layer_of(name: str) -> int | None:
    m = re.search(r"(?:^|\.)layers\.(\d+)(?:\.|$)", name)
    return int(m.group(1)) if m else None


def model_mixers(decoder: torch.nn.Module) -> dict[str, list[int]]:
    """``{class name: [layer indices]}`` of the modules in ``decoder`` (the language model) that
    mix tokens outside softmax attention: a known kind of mixer, or the module holding an
    ``nn.Conv1d`` whose kernel spans more than one position; the innermost such module is named
    (a Mamba mixer, not the decoder layer or block around it)."""
    modules = dict(decoder.named_modules())
    hits: dict[str, str] = {}  # module name -> class named
    for name, module in modules.items():
        cls = type(module).__name__
        if MIXER_NAME.search(cls) and "Norm" not in cls and not cls.endswith(("Config", "Output", "Cache")):
            hits[name] = cls
        elif isinstance(module, torch.nn.Conv1d) and module.kernel_size[0] > 1:
            parent = name.rpartition(".")[0]
            hits.setdefault(parent, type(modules.get(parent, decoder)).__name__)

    # the mixer itself: not the decoder layer, block or model around it, and not the parts inside it
    # (a Gated DeltaNet's short convolutions)
    def around(name: str, cls: str) -> bool:
        return (
            bool(re.search(r"(^|\.)layers\.\d+$", name))
            or name == ""
            or cls.endswith(("DecoderLayer", "Block", "Model"))
        )

    candidates = {n: c for n, c in hits.items() if not around(n, c)} or hits

    def below(other: str, name: str) -> bool:
        return other != name and (other.startswith(name + ".") if name else True)

    inner = [n for n in candidates if not any(below(n, o) for o in candidates)]
    found: dict[str, set[int]] = {}
    for name in inner:
        layer = _layer_of(name)
        found.setdefault(hits[name], set()).update([] if layer is None else [layer])
    return {cls: sorted(layers) for cls, layers in found.items()}


_MODULE_MIXERS: dict[str, list[str]] = {}


def _module_mixers(module_name: str) -> list[str]:
    """The token-mixer classes a modeling module defines (cached)."""
    if module_name not in _MODULE_MIXERS:
        mod = sys.modules.get(module_name)
        names = []
        for attr, obj in vars(mod).items() if mod is not None else ():
            if (
                isinstance(obj, type)
                and issubclass(obj, torch.nn.Module)
                and obj.__module__ == module_name
                and MIXER_NAME.search(attr)
                and "Decoder" not in attr
                and not attr.endswith(
                    ("Model", "ForCausalLM", "Output", "RMSNorm", "Norm", "PreTrainedModel")
                )
            ):
                names.append(attr)
        _MODULE_MIXERS[module_name] = sorted(names)
    return _MODULE_MIXERS[module_name]


def config_mixers(config, module=None) -> list[str]:
    """The token mixers other than softmax attention that a model with ``config`` (a text config)
    has: its ``layer_types`` that are neither attention nor token-free (``linear_attention``,
    ``conv``, ``hybrid``, ``indexed_attention`` ...), or, without ``layer_types``, the mixer
    classes the modeling module of ``module`` (one of its layers) defines. ``[]``: none."""
    types = getattr(config, "layer_types", None)
    if types:
        return sorted({str(t) for t in types} - ATTENTION_TYPES - _NOT_MIXING)
    if module is not None:
        return _module_mixers(type(module).__module__)
    return []


def describe_mixers(mixers) -> str:
    """``model_mixers``'s or ``config_mixers``'s answer in words."""
    if isinstance(mixers, dict):
        parts = [
            f"{cls} (layers {', '.join(map(str, layers))})" if layers else cls
            for cls, layers in mixers.items()
        ]
    else:
        parts = [f"{t} layers" if not MIXER_NAME.search(t) else t for t in mixers]
    return "; ".join(parts)


def mixers_refusal(what: str, owner: str, mixers) -> str | None:
    """The refusal of ``what`` (``"packed rows"``) on a model (``owner``, its class name) with
    ``mixers`` (``model_mixers``'s or ``config_mixers``'s), or ``None`` when there are none."""
    if not mixers:
        return None
    return (
        f"{owner} mixes tokens outside attention ({describe_mixers(mixers)}), which {what} cannot run "
        "exactly as it is: those layers do not see where a packed row's sequences start, so each sequence "
        "would read the state the one before it left (a wrong loss, without an error). keep_sequences_apart(model) "
        "makes them exact for the mixers it knows (Gated DeltaNet, Mamba and Mamba-2 mixers, short "
        "convolutions, lightning attention; balance_trainer and mmbalance launch call it); otherwise train it "
        "without packing"
    )


# ------------------------------------------------------------------------ packed rows, exactly
#: mixer classes whose forward over a right-padded batch (a 2-D ``attention_mask``) gives each
#: sequence exactly what it gives the sequence alone (a causal convolution and a recurrence that
#: start at the row's first token, padding zeroed): run on a packed row's sequences as such a
#: batch, they keep the sequences apart (``tests/integrations/test_packed_mixers.py`` checks each
#: against each sequence alone, loss and every gradient)
PADDED_EXACT = frozenset(
    {
        # Gated DeltaNet
        "Qwen3_5GatedDeltaNet",
        "Qwen3_5MoeGatedDeltaNet",
        "Qwen3NextGatedDeltaNet",
        "OlmoHybridGatedDeltaNet",
        # Mamba and Mamba-2 mixers
        "JambaMambaMixer",
        "BambaMixer",
        "NemotronHMamba2Mixer",
        "FalconH1Mixer",
        "Zamba2MambaMixer",
        # short convolutions, lightning attention
        "Lfm2ShortConv",
        "MiniMaxLightningAttention",
    }
)

# id(config) of the language models whose every mixer runs packed rows exactly (keep_sequences_apart)
_KEPT_APART: dict[int, int] = {}


def kept_apart(config) -> bool:
    """Whether the model of ``config`` (a layer's) has its mixers keep packed sequences apart."""
    return config is not None and id(config) in _KEPT_APART


class SequencesApart:
    """What :func:`keep_sequences_apart` returns: ``remove()`` puts the mixers back."""

    def __init__(self, decoder, configs, hooks, modules):
        self.decoder, self._configs, self._hooks, self._modules = decoder, configs, hooks, modules
        self._forwards: list = []  # the forward put on each of the modules
        self.boundaries = None  # this forward's packing: (lengths, cu_seqlens, longest), or None

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        for m, forward in zip(self._modules, self._forwards):
            # (ours passes every call through now: no hook sets its boundaries)
            unwrap_forward(m, forward)
        for c in self._configs:
            _KEPT_APART.pop(c, None)
        self._hooks, self._modules, self._configs, self._forwards = [], [], [], []
        self.decoder.__dict__.pop("_mmbalance_apart", None)


def keep_sequences_apart(model) -> SequencesApart | None:
    """Make ``model``'s decoder keep the sequences of a packed row apart where it would not:

    * its token mixers, read from the same ``position_ids`` (restarting inside a row, the text row
      of ``[4, B, L]`` M-RoPE rows included; the three rotary rows alone carry no packing) or
      ``cu_seq_lens_q`` the attention backend reads: each mixer
      of :data:`PADDED_EXACT` runs the row's sequences as a right-padded batch (``unpack``), its
      outputs packed back (``pack``); a row of one sequence runs as before. A mixer outside
      :data:`PADDED_EXACT` is left alone, and packed rows stay refused for that model;
    * an M-RoPE text model (Qwen2-VL to Qwen3-VL, GLM-4.xV, Ernie-4.5-VL, ...) given 2-D
      ``position_ids`` that restart inside a row (what ``DataCollatorWithFlattening`` gives) turns
      them into its three rotary rows and builds its mask without them, so the sequences attend
      to each other (with any attention); here such positions reach it as ``[4, B, L]``: the same
      rows for the rotary embedding, and the 2-D positions as the text row its mask and the
      attention read. Positions that do not restart, and 3-D ones, reach it unchanged.

    Packing is read from positions only when the forward has no ``attention_mask``, as transformers
    and the backend read it: with a mask (a padded batch, LLaMA-Factory's collator, whose M-RoPE
    text row repeats a position over an image's tokens) the row is what the mask says. Under a
    flash attention (transformers drops a mask without a zero, and flash-attn reads one row's
    packing from its positions, a sequence at each smallest one) the mixers read it the same way.

    Returns the handle (``remove()``), the same one when called again, or ``None`` when the model
    has neither."""
    decoder = _language_model(model)
    old = decoder.__dict__.get("_mmbalance_apart")
    if old is not None:
        return old
    found = model_mixers(decoder)
    mixing = bool(found) and bool(set(found) & PADDED_EXACT)
    texts = [m for m in decoder.modules() if _drops_packed_positions(type(m))]
    if not mixing and not texts:
        return None
    modules = [m for m in decoder.modules() if type(m).__name__ in PADDED_EXACT] if mixing else []
    configs = []
    if mixing and set(found) <= PADDED_EXACT:
        seen = {
            id(getattr(m, "config", None))
            for m in decoder.modules()
            if getattr(m, "config", None) is not None
        }
        configs = [c for c in seen if c != id(None)]
    handle = SequencesApart(decoder, configs, [], modules)

    def read(module, args, kwargs):
        # under a dynamic-CP shard the Gated DeltaNet layers run its path (cp/linear.py), which
        # takes the sequences from the shard: the mixers' own packing stays out of its way
        handle.boundaries = None if kwargs.get(CP_KEYWORD) is not None else _boundaries(module, kwargs)
        return None

    def done(module, args, kwargs, output):
        handle.boundaries = None
        return None

    hooks = [m.register_forward_pre_hook(_with_text_row, with_kwargs=True) for m in texts]
    if mixing:
        hooks += [
            decoder.register_forward_pre_hook(read, with_kwargs=True),
            decoder.register_forward_hook(done, with_kwargs=True, always_call=True),
        ]
    handle._hooks = hooks
    handle._forwards = [wrap_forward(m, _apart_forward(m, handle)) for m in modules]
    for c in configs:
        _KEPT_APART[c] = 1
    decoder.__dict__["_mmbalance_apart"] = handle
    return handle


def _drops_packed_positions(cls: type) -> bool:
    """Whether ``cls`` is an M-RoPE text model's class of transformers' Qwen2-VL kind: its forward
    reads packing only from a ``[4, B, L]`` text row and expands 2-D ``position_ids`` into its
    rotary rows without one."""
    src = _forward_source(cls)
    return "position_ids.ndim == 2" in src and "position_ids.shape[0] == 4" in src


def _forward_source(cls: type) -> str:
    """The source of the forward ``cls`` itself defines ("" when it has none or it cannot be read)."""
    if cls not in _SOURCES:
        forward = cls.__dict__.get("forward")
        try:
            _SOURCES[cls] = inspect.getsource(forward) if forward is not None else ""
        except (OSError, TypeError):
            _SOURCES[cls] = ""
    return _SOURCES[cls]


_SOURCES: dict[type, str] = {}


# M-RoPE text models that hand their decoder layers the rotary rows, not the text row (GLM-4.5V's
# and Ernie-4.5-VL's in transformers 5.6 to 5.24; others are found by :func:`_rotary_rows_to_layers`):
# with a cache their attention learns the packing from nowhere (the mask is built without it, the
# layers' positions are the rotary rows), so a packed row runs with no cache and one given is
# refused by name
ROTARY_ROWS_TO_LAYERS = frozenset({"Glm4vMoeTextModel", "Ernie4_5_VLMoeTextModel"})
_CACHE_KEYS = ("cache", "past_key_values")
# the keyword a dynamic-CP shard reaches the model's forwards with (attention/backend.py's CP_KEYWORD)
CP_KEYWORD = "mmbalance_cp"
_LAYER_CALL = re.compile(r"(?:decoder_layer|layer)\((.*?)\n\s*\)", re.S)


def _rotary_rows_to_layers(cls) -> bool:
    """Whether the M-RoPE text model ``cls`` hands its decoder layers the rotary rows rather than
    the text row: by name (:data:`ROTARY_ROWS_TO_LAYERS`), else read from its forward (the layers'
    call passes ``position_ids=text_position_ids`` or not); a forward that cannot be read counts as
    not handing them the text row."""
    if cls.__name__ in ROTARY_ROWS_TO_LAYERS:
        return True
    call = _LAYER_CALL.search(_forward_source(cls))
    return call is None or "position_ids=text_position_ids" not in call.group(1)


def _flash(module) -> bool:
    """Whether ``module`` runs a flash attention of transformers' kind (an implementation whose
    name holds "flash", as transformers tells them): its masks drop a padding mask without a zero,
    and the attention then reads packing from the positions (``prepare_fa_kwargs_from_position_ids``:
    one row, a sequence starting at each smallest position)."""
    impl = getattr(getattr(module, "config", None), "_attn_implementation", None)
    return isinstance(impl, str) and "flash" in impl


def _mask_hides_packing(module, kwargs) -> bool:
    """Whether this forward's ``attention_mask`` keeps transformers and the attention from reading
    packing from the positions: any mask does (a padded batch, or LLaMA-Factory's, whose M-RoPE
    text row repeats a position over an image's tokens; the row is what the mask says), but under
    a flash attention a 2-D mask without a zero is dropped and the positions are read."""
    mask = kwargs.get("attention_mask")
    if mask is None:
        return False
    return not (_flash(module) and torch.is_tensor(mask) and mask.dim() == 2 and bool(mask.all()))


def _reads_positions(impl) -> bool:
    """Whether the attention registered as ``impl`` is the package's (``mmbalance_varlen``), which
    reads a row's packing from the positions its layers get, whatever the mask."""
    if not isinstance(impl, str):
        return False
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    fn = ALL_ATTENTION_FUNCTIONS[impl] if impl in ALL_ATTENTION_FUNCTIONS else None
    return str(getattr(fn, "__module__", "")).startswith("mmbalance.")


def _restarts(pos: torch.Tensor) -> bool:
    """Whether positions ``[B, L]`` restart inside a row (not one more than the one before)."""
    return pos.shape[-1] > 1 and bool((pos[:, 1:] != pos[:, :-1] + 1).any())


def _with_text_row(module, args, kwargs):
    """Packed rows for an M-RoPE text model: 2-D ``position_ids`` that restart inside a row (and no
    attention mask) reach it as ``[4, B, L]`` (the text row, then the three rotary rows the model
    would have made of them), and with ``use_cache=False``: transformers builds the packed mask
    from the text row only when it has no cache (a training step needs none), and every attention
    then keeps the sequences apart. A cache given with a packed row is refused by name for the
    models whose layers get the rotary rows (:func:`_rotary_rows_to_layers`: their attention cannot
    see the packing then), and under an attention whose only packing is the mask (``sdpa``, eager)."""
    pos = kwargs.get("position_ids")
    if pos is None or not torch.is_tensor(pos) or pos.dim() not in (2, 3):
        return None
    if _mask_hides_packing(module, kwargs):
        return None
    text = pos if pos.dim() == 2 else (pos[0] if pos.shape[0] == 4 else None)
    if text is None or not _restarts(text):
        return None  # one sequence a row (or rotary rows alone, which carry no packing)
    cache = next((kwargs[k] for k in _CACHE_KEYS if kwargs.get(k) is not None), None)
    if cache is not None:
        name = type(module).__name__
        impl = getattr(getattr(module, "config", None), "_attn_implementation", None)
        if _rotary_rows_to_layers(type(module)):
            raise ValueError(
                f"packed rows (position_ids restarting inside a row) with a cache in {name}: transformers' {name} "
                "builds its mask without the packing when it has a cache and hands its layers the rotary rows, so "
                "the sequences would run into one another; pass no cache (use_cache=False) with packed rows"
            )
        if not (_reads_positions(impl) or _flash(module)):
            # the mask is the only packing this attention sees, and it is built without it
            raise ValueError(
                f"packed rows (position_ids restarting inside a row) with a cache in {name} under "
                f"attn_implementation={impl!r}: transformers builds its mask without the packing when it has a "
                "cache, so the sequences would attend to one another; pass no cache (use_cache=False) with packed "
                "rows, or run attn_implementation='mmbalance_varlen', which reads the packing from the positions"
            )
    kwargs = dict(kwargs)
    if cache is None:
        kwargs["use_cache"] = False
    if pos.dim() == 2:
        kwargs["position_ids"] = torch.cat([pos[None], pos[None].expand(3, -1, -1)], dim=0)
    return args, kwargs


def _language_model(model):
    from .compat import language_model
    from .wrappers import inner_model

    return language_model(inner_model(model))


def _boundaries(module, kwargs) -> tuple | None:
    """``(lengths, cu_seqlens, longest)`` of the sequences of this forward's rows over the
    flattened batch, or ``None`` when every row is one sequence: read as ``module``'s attention
    reads them (``cu_seq_lens_q``; else the positions, where no mask hides them: a sequence starts
    at each position not one more than the one before, or under a flash attention, one row's
    smallest positions)."""
    import numpy as np

    cu = kwargs.get("cu_seq_lens_q")
    if cu is not None:
        cu = cu.detach().to("cpu", torch.int64)
        lengths = (cu[1:] - cu[:-1]).tolist()
        rows = None
    else:
        pos = kwargs.get("position_ids")
        if pos is None or _mask_hides_packing(module, kwargs):
            # a mixer cut where the attention reads no packing would part what it keeps together
            return None
        if pos.dim() == 3:
            if pos.shape[0] != 4:
                # the rotary rows alone (what Qwen3.5's and the other M-RoPE forwards compute when
                # given no positions): transformers reads no packing from them, and their temporal
                # row repeats a position over an image's tokens
                return None
            pos = pos[0]  # the text row of [4, B, L]
        pos = pos.detach().to("cpu", torch.int64).numpy()
        if pos.ndim != 2:
            return None
        if _flash(module):
            # flash-attn's reading: one row, packed unless it counts up from its smallest position
            if (
                pos.shape[0] != 1
                or pos.shape[1] < 2
                or bool((pos[0] == pos[0].min() + np.arange(pos.shape[1])).all())
            ):
                return None
            starts = pos == pos.min()
        else:
            starts = np.diff(pos, prepend=pos[:, :1] - 1, axis=-1) != 1  # transformers' rule: not one more
        starts[:, 0] = True
        if int(starts.sum()) <= pos.shape[0]:  # one sequence a row
            return None
        lengths, rows = [], pos.shape[0]
        for r in range(rows):
            s = np.flatnonzero(starts[r]).tolist() + [pos.shape[1]]
            lengths += [b - a for a, b in zip(s[:-1], s[1:])]
    if len(lengths) <= (rows or 1):
        return None
    cu_seqlens = torch.tensor([0, *np.cumsum(lengths).tolist()], dtype=torch.int32)
    return lengths, cu_seqlens, max(lengths)


def _apart_forward(module, handle: SequencesApart):
    """``module``'s forward, running a packed row's sequences as a right-padded batch; the forward
    it wraps is the one on the instance if there is one (dynamic CP's: installed in either order,
    each wrapper calls the other's where it has nothing to do), else the class's."""
    stock = module.forward

    def forward(hidden_states, *args, **kwargs):
        packing = handle.boundaries
        cache = kwargs.get("cache", kwargs.get("cache_params"))
        if packing is None or cache is not None or args:
            return stock(hidden_states, *args, **kwargs)
        from mmbalance.pyops import pack, unpack

        lengths, cu, longest = packing
        b, length, width = hidden_states.shape
        if int(cu[-1]) != b * length:
            raise ValueError(
                f"{type(module).__name__}: this forward's sequences cover {int(cu[-1])} tokens, its hidden states "
                f"{b * length} ({b} x {length})"
            )
        device = hidden_states.device
        cu_d = cu.to(device)
        seqlens = torch.tensor(lengths, dtype=torch.int64, device=device)
        padded = unpack(hidden_states.reshape(b * length, width), cu_d, longest)
        mask = torch.arange(longest, device=device)[None, :] < seqlens[:, None]
        for key in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "position_ids"):
            kwargs.pop(key, None)
        kwargs["attention_mask"] = mask.to(torch.long)
        result = stock(padded, **kwargs)
        out = result[0] if isinstance(result, tuple) else result  # (output, weights) as MiniMax returns
        packed = pack(out, seqlens, b * length).reshape(b, length, out.shape[-1])
        return (packed, *result[1:]) if isinstance(result, tuple) else packed

    return forward


def wrap_forward(module, forward):
    """Put ``forward`` on ``module`` (its instance), over the one there, and return it. Wrappers of
    one module (dynamic CP's Gated DeltaNet path, :func:`keep_sequences_apart`'s) stack in either
    order: each calls the forward below it where it has nothing to do."""
    forward._mmbalance_below = module.__dict__.get("forward")
    forward._mmbalance_removed = False
    module.forward = forward
    return forward


def unwrap_forward(module, forward) -> None:
    """Take ``forward`` (put by :func:`wrap_forward`) off ``module``: when it is on top, the module
    gets the highest forward below it not taken off yet (or its class's); when another sits on it,
    it stays there, passing calls through, until that one goes."""
    forward._mmbalance_removed = True
    if module.__dict__.get("forward") is not forward:
        return
    below = forward._mmbalance_below
    while below is not None and getattr(below, "_mmbalance_removed", False):
        below = below._mmbalance_below
    if below is None:
        module.__dict__.pop("forward", None)
    else:
        module.__dict__["forward"] = below
