"""Per-example sizes of real multimodal data, and a three-modality mixture built from them.

The shipped file ``mmbalance/data/mm_sizes.npz`` (sources and licenses in its README) holds sizes
only: image tiles and text tokens of four InternVL SFT sets (OmniBal), duration and caption words of
ActivityNet videos, and samples of LibriSpeech utterances. :func:`mixture` turns them into what each
phase of an MLLM sees, with the conversion rates as arguments:

=============  ==============================  ==================================================
kind           encoder tokens                  LLM tokens
=============  ==============================  ==================================================
image          1024 ViT patches per 448px tile 256 per tile (pixel shuffle) + the example's text
video          ``fps`` frames (capped), each   ``video_llm_per_frame`` per frame + caption
               ``video_patches_per_frame``     tokens (1.3 per word) + a 32-token prompt
speech, ASR    50 encoder frames per second    25 per second (2x downsample) + transcript,
                                               ``asr_tokens_per_s`` per second + 16
speech, QA     same                            same audio + a real text length of the image sets
=============  ==============================  ==================================================
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

KINDS = ("image", "video", "speech_asr", "speech_qa")
DEFAULT_WEIGHTS = {"image": 0.6, "video": 0.15, "speech_asr": 0.15, "speech_qa": 0.1}


def default_path() -> str:
    return os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data", "mm_sizes.npz")


def _shipped_path() -> str:
    path = default_path()
    if os.path.isfile(path):
        return path
    raise FileNotFoundError("the shipped size file mm_sizes.npz is missing from the installation")


_CACHE: dict[str, dict[str, np.ndarray]] = {}


def load_sizes(path: str | None = None) -> dict[str, np.ndarray]:
    """The raw size arrays of the shipped file (or ``path``), cached."""
    path = path or _shipped_path()
    if path not in _CACHE:
        with np.load(path) as f:
            _CACHE[path] = {k: f[k] for k in f.files}
    return _CACHE[path]


@dataclass(frozen=True)
class ExampleSizes:
    """Per-example sizes of a batch of multimodal examples (int64 arrays of one length ``n``).

    ``vision``: ViT patches (0 without an image/video); ``audio``: audio-encoder frames (0 without
    speech); ``vision_llm`` / ``audio_llm``: the tokens the connectors hand to the LLM; ``text``:
    text tokens; ``kind``: index into :data:`KINDS`. ``llm`` is the interleaved LLM sequence length.
    """

    vision: np.ndarray
    audio: np.ndarray
    vision_llm: np.ndarray
    audio_llm: np.ndarray
    text: np.ndarray
    kind: np.ndarray

    @property
    def llm(self) -> np.ndarray:
        return self.text + self.vision_llm + self.audio_llm

    def __len__(self) -> int:
        return int(self.text.shape[0])

    def take(self, idx) -> ExampleSizes:
        return ExampleSizes(
            *(getattr(self, f)[idx] for f in ("vision", "audio", "vision_llm", "audio_llm", "text", "kind"))
        )

    def phase(self, name: str) -> np.ndarray:
        """Lengths of one phase: ``"vision"``, ``"audio"`` or ``"llm"``."""
        if name == "llm":
            return self.llm
        if name in ("vision", "audio"):
            return getattr(self, name)
        raise ValueError(f"phase must be 'vision', 'audio' or 'llm', got {name!r}")


def mixture(
    n: int,
    rng: np.random.Generator | int | None = None,
    *,
    weights: dict[str, float] | None = None,
    video_fps: float = 1.0,
    video_max_frames: int = 256,
    video_patches_per_frame: int = 256,
    video_llm_per_frame: int = 64,
    asr_tokens_per_s: float = 3.5,
    path: str | None = None,
) -> ExampleSizes:
    """Sample ``n`` examples (with replacement) from the real-data mixture."""
    if not isinstance(n, (int, np.integer)) or isinstance(n, bool) or n < 0:
        raise ValueError(f"n must be a non-negative int, got {n!r}")
    rng = rng if isinstance(rng, np.random.Generator) else np.random.default_rng(rng)
    w = dict(DEFAULT_WEIGHTS if weights is None else weights)
    unknown = set(w) - set(KINDS)
    if unknown:
        raise ValueError(f"weights has unknown kinds {sorted(unknown)}; known: {KINDS}")
    p = np.array([max(0.0, float(w.get(k, 0.0))) for k in KINDS])
    if p.sum() <= 0:
        raise ValueError("weights must have a positive entry")
    raw = load_sizes(path)
    kind = rng.choice(len(KINDS), size=n, p=p / p.sum()).astype(np.int64)
    z = np.zeros(n, dtype=np.int64)
    vision, audio, vision_llm, audio_llm, text = z.copy(), z.copy(), z.copy(), z.copy(), z.copy()

    sel = np.flatnonzero(kind == 0)
    j = rng.integers(0, raw["image_tiles"].shape[0], size=sel.size)
    tiles = raw["image_tiles"][j].astype(np.int64)
    vision[sel] = 1024 * tiles
    vision_llm[sel] = 256 * tiles
    text[sel] = raw["image_text_tokens"][j]

    sel = np.flatnonzero(kind == 1)
    j = rng.integers(0, raw["video_duration_ms"].shape[0], size=sel.size)
    frames = np.clip(np.round(raw["video_duration_ms"][j] / 1000.0 * video_fps), 1, video_max_frames).astype(
        np.int64
    )
    vision[sel] = frames * video_patches_per_frame
    vision_llm[sel] = frames * video_llm_per_frame
    text[sel] = np.round(raw["video_caption_words"][j] * 1.3).astype(np.int64) + 32

    for k in (2, 3):
        sel = np.flatnonzero(kind == k)
        j = rng.integers(0, raw["speech_samples_16k"].shape[0], size=sel.size)
        seconds = raw["speech_samples_16k"][j] / 16000.0
        audio[sel] = np.round(seconds * 50).astype(np.int64)
        audio_llm[sel] = np.round(seconds * 25).astype(np.int64)
        if k == 2:
            text[sel] = np.round(seconds * asr_tokens_per_s).astype(np.int64) + 16
        else:
            jt = rng.integers(0, raw["image_text_tokens"].shape[0], size=sel.size)
            text[sel] = raw["image_text_tokens"][jt]
    return ExampleSizes(vision, audio, vision_llm, audio_llm, text, kind)
