"""Derive ``mmbalance/data/mm_sizes.npz`` (per-example sizes of real multimodal data sets).

Run from the repository root with the raw files in ``DIR`` (default ``../shared/data``)::

    python data/derive.py [DIR]

Only sizes are kept (no content): image tiles and text tokens per example of the OmniBal SFT sets,
duration and caption words per ActivityNet video, samples per LibriSpeech utterance. See
``mmbalance/data/README.md`` for sources and licenses.
"""

from __future__ import annotations

import csv
import json
import os
import sys

import numpy as np

IMAGE_SETS = ["ai2d_train_12k", "chartqa_train_18k", "docvqa_train_10k", "synthdog_en"]
LLM_TOKENS_PER_TILE = 256


def main(src: str) -> None:
    out: dict[str, np.ndarray] = {}
    tiles, text, set_id = [], [], []
    for k, name in enumerate(IMAGE_SETS):
        with open(os.path.join(src, f"omnibal_{name}_wh_token_lengths.json")) as f:
            rows = json.load(f)
        for r in rows:
            t = int(r["vit_num"])
            tiles.append(t)
            text.append(int(r["token_num"]) - LLM_TOKENS_PER_TILE * t)
            set_id.append(k)
    out["image_tiles"] = np.asarray(tiles, dtype=np.int16)
    out["image_text_tokens"] = np.asarray(text, dtype=np.int16)
    out["image_set"] = np.asarray(set_id, dtype=np.int8)
    out["image_set_names"] = np.asarray(IMAGE_SETS)

    with open(os.path.join(src, "activitynet_captions_train_modified.json")) as f:
        videos = json.load(f)
    dur, words = [], []
    for key in sorted(videos):
        v = videos[key]
        dur.append(int(round(float(v["duration"]) * 1000)))
        words.append(sum(len(s.split()) for s in v["sentences"]))
    out["video_duration_ms"] = np.asarray(dur, dtype=np.int32)
    out["video_caption_words"] = np.asarray(words, dtype=np.int32)

    samples = []
    with open(os.path.join(src, "librispeech_train-clean-100_librimix.csv")) as f:
        for row in csv.DictReader(f):
            samples.append(int(row["length"]))
    out["speech_samples_16k"] = np.asarray(samples, dtype=np.int32)

    dst = os.path.join(os.path.dirname(__file__), "..", "mmbalance", "data", "mm_sizes.npz")
    np.savez_compressed(dst, **out)
    print(f"wrote {os.path.normpath(dst)} ({os.path.getsize(dst) / 1e6:.2f} MB)")
    for k, v in out.items():
        print(f"  {k}: {v.shape} {v.dtype}")


if __name__ == "__main__":
    main(
        sys.argv[1]
        if len(sys.argv) > 1
        else os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data")
    )
